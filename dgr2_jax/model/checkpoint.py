"""Model directories: HF (safetensors) <-> ours (Orbax), streamed one tensor at a time.

Two on-disk formats, both holding a `config.json` in HF form (`Qwen3Config.to_hf_dict()`, with the
block-diffusion fields under "dgr2") and any tokenizer files:

* HF: `model.safetensors`, or shards `model-0000K-of-0000N.safetensors` + `model.safetensors.index.json`.
  Loads in `transformers.AutoModelForCausalLM.from_pretrained`.
* Ours: `params/`, an Orbax PyTree checkpoint of the parameter dict of `qwen3.py`.

The name mapping is the table `TABLE` of (HF template, our path template, hook); a hook maps a
tensor (and its shape) between the layouts and is its own inverse (a transpose). Conversions never
hold two full copies of the weights: HF tensors are read one `safe_open` at a time (the file map is
closed after each tensor so its pages leave the resident set), the only per-tensor copy is a
transpose, and HF shards are written tensor by tensor from per-array Orbax restores. Every input is
validated from headers/metadata before anything is written, and outputs are written to a temporary
sibling directory that is renamed into place, so a failure leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
from typing import Any, Callable, Iterator

import ml_dtypes
import numpy as np

from dgr2_jax import multihost
from dgr2_jax.fileio import InputError
from dgr2_jax.model import qwen3
from dgr2_jax.model.config import Qwen3Config

CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
# {file under params/: bytes}, written once every process has written its shards: a copied or
# uploaded model dir whose weights were cut short fails with this file's name before Orbax reads it.
PARAMS_SIZES_FILE = "params_sizes.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 1024**3
# Tokenizer (and generation) files copied along with the weights when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")

_ST_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
              "F16": np.dtype(np.float16)}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(ml_dtypes.bfloat16): "bfloat16",
                np.dtype(np.float16): "float16"}


def _transpose(a: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(a.T)


# hook -> how it maps a shape. Every hook is an involution, so the same one serves both directions.
_HOOK_SHAPES: dict[Callable, Callable] = {_transpose: lambda s: tuple(s)[::-1]}

# Placeholders usable in the templates below, with the regex each matches.
_SLOTS = {
    "i": r"\d+",
    "ln": "input_layernorm|post_attention_layernorm",
    "proj": "q_proj|k_proj|v_proj|o_proj",
    "qk": "q_norm|k_norm",
    "mlp": "gate_proj|up_proj|down_proj",
}

# (HF state-dict name, our parameter path, hook applied to go from one layout to the other).
TABLE = (
    ("model.embed_tokens.weight", "embed_tokens/embedding", None),
    ("model.layers.{i}.{ln}.weight", "layers_{i}/{ln}/scale", None),
    ("model.layers.{i}.self_attn.{proj}.weight", "layers_{i}/self_attn/{proj}/kernel", _transpose),
    ("model.layers.{i}.self_attn.{proj}.bias", "layers_{i}/self_attn/{proj}/bias", None),
    ("model.layers.{i}.self_attn.{qk}.weight", "layers_{i}/self_attn/{qk}/scale", None),
    ("model.layers.{i}.mlp.{mlp}.weight", "layers_{i}/mlp/{mlp}/kernel", _transpose),
    ("model.norm.weight", "norm/scale", None),
    ("lm_head.weight", "lm_head/kernel", _transpose),
)


def _template_regex(template: str) -> re.Pattern:
  parts = re.split(r"\{(\w+)\}", template)
  out = "".join(re.escape(p) if k % 2 == 0 else f"(?P<{p}>{_SLOTS[p]})" for k, p in enumerate(parts))
  return re.compile(out + r"\Z")


_HF_RE = [(_template_regex(hf), ours, hook) for hf, ours, hook in TABLE]
_OURS_RE = [(_template_regex(ours), hf, hook) for hf, ours, hook in TABLE]


def hf_to_ours(name: str) -> tuple[str, Callable | None] | None:
  """HF tensor name -> (our '/'-joined path, hook), or None when the table has no row for it."""
  for rx, ours, hook in _HF_RE:
    m = rx.match(name)
    if m:
      return ours.format(**m.groupdict()), hook
  return None


def ours_to_hf(path: str) -> tuple[str, Callable | None]:
  for rx, hf, hook in _OURS_RE:
    m = rx.match(path)
    if m:
      return hf.format(**m.groupdict()), hook
  raise KeyError(f"parameter {path} has no HF name in checkpoint.TABLE")


def _map_shape(hook, shape) -> tuple[int, ...]:
  return tuple(shape) if hook is None else _HOOK_SHAPES[hook](shape)


def _apply(hook, a: np.ndarray) -> np.ndarray:
  return a if hook is None else hook(a)


# ---- pytree helpers -------------------------------------------------------------------------------
def _natural_key(path: str):
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
  """Nested dict -> {'a/b/c': leaf}, in natural order (layers_2 before layers_10)."""
  out = {}
  for k, v in tree.items():
    p = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(flatten(v, p + "/"))
    else:
      out[p] = v
  return dict(sorted(out.items(), key=lambda kv: _natural_key(kv[0])))


def unflatten(flat: dict[str, Any]) -> dict:
  tree: dict = {}
  for path, v in flat.items():
    node = tree
    *parents, leaf = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = v
  return tree


def expected_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
  """Our parameter path -> shape, from `qwen3.param_shapes` (no allocation)."""
  return {p: tuple(s.shape) for p, s in flatten(qwen3.param_shapes(config)).items()}


def _hf_order(config: Qwen3Config) -> list[tuple[str, str, Callable | None, tuple[int, ...]]]:
  """(HF name, our path, hook, HF shape) for every parameter, in HF's usual order."""
  rows = []
  for path, shape in expected_shapes(config).items():
    name, hook = ours_to_hf(path)
    rows.append((name, path, hook, _map_shape(hook, shape)))
  rank = lambda n: (n.startswith("lm_head"), n == "model.norm.weight", _natural_key(n))
  return sorted(rows, key=lambda r: rank(r[0]))


# ---- output directories --------------------------------------------------------------------------
@contextlib.contextmanager
def _atomic_output(path: str, overwrite: bool, finish: Callable[[str], None] | None = None
                   ) -> Iterator[str]:
  """Yields a temporary sibling of `path` that replaces it on success; removed on any failure.

  Several processes: collective. Process 0 makes the temporary directory and tells the others its
  name; all write their share (Orbax: each its shards); process 0 publishes once all are done,
  after `finish(tmp)` (its own last word on the whole directory)."""
  path = os.path.abspath(path)
  multi = multihost.is_multi()
  if not multihost.is_writer():
    if not multi:
      raise RuntimeError(f"{path}: process {multihost.process_index()} must not write alone")
    tmp = multihost.broadcast("atomic_output.tmp")
    if tmp is None:  # process 0 refused (the output exists); it raises the error
      raise FileExistsError(f"output directory already exists: {path}")
    multihost.barrier("atomic_output.open")
    yield tmp
    multihost.barrier("atomic_output.written")
    multihost.barrier("atomic_output.published")
    return
  if os.path.exists(path) and not overwrite:
    multihost.broadcast("atomic_output.tmp", None)
    raise FileExistsError(f"output directory already exists: {path} (pass overwrite=True / --overwrite)")
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".tmp-", dir=parent)
  multihost.broadcast("atomic_output.tmp", tmp)
  multihost.barrier("atomic_output.open")
  try:
    yield tmp
    multihost.barrier("atomic_output.written")
    if finish is not None:
      finish(tmp)
    if os.path.exists(path):
      shutil.rmtree(path)
    os.replace(tmp, path)
    multihost.barrier("atomic_output.published")
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _write_json(path: str, obj) -> None:
  if not multihost.is_writer():
    return
  with open(path, "w") as f:
    json.dump(obj, f, indent=2)
    f.write("\n")


def _write_tokenizer(out_dir: str, tokenizer_src) -> None:
  """`tokenizer_src`: None, a directory (known tokenizer files are copied), a tokenizer object, or a
  list of those (earlier ones win)."""
  if tokenizer_src is None or not multihost.is_writer():
    return
  if isinstance(tokenizer_src, (list, tuple)):
    for src in tokenizer_src:
      _write_tokenizer(out_dir, src)
    return
  if hasattr(tokenizer_src, "save_pretrained"):
    tokenizer_src.save_pretrained(out_dir)
    return
  if not os.path.isdir(tokenizer_src):
    raise FileNotFoundError(f"tokenizer directory not found: {tokenizer_src}")
  for name in TOKENIZER_FILES:
    src = os.path.join(tokenizer_src, name)
    if os.path.isfile(src) and not os.path.exists(os.path.join(out_dir, name)):
      shutil.copy2(src, os.path.join(out_dir, name))


def has_tokenizer(path: str) -> bool:
  return any(os.path.isfile(os.path.join(path, n))
             for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


# ---- reading HF directories ----------------------------------------------------------------------
def _read_config_json(path: str) -> dict:
  f = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(f):
    raise FileNotFoundError(f"missing {CONFIG_FILE} in {path}")
  try:
    with open(f) as fh:
      return json.load(fh)
  except json.JSONDecodeError as e:
    raise ValueError(f"{f}: not valid JSON ({e})") from None


def _config_from_json(path: str, d: dict, **overrides) -> Qwen3Config:
  try:
    return Qwen3Config.from_hf_dict(d, **overrides)
  except (KeyError, TypeError) as e:
    raise ValueError(f"{os.path.join(path, CONFIG_FILE)}: missing or bad field {e}") from None
  except ValueError as e:
    raise ValueError(f"{os.path.join(path, CONFIG_FILE)}: {e}") from None


def detect_format(path: str) -> str:
  """'hf' or 'ours'; FileNotFoundError naming what is missing otherwise."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f"model directory not found: {path}")
  if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
    raise FileNotFoundError(f"missing {CONFIG_FILE} in {path}")
  if os.path.isdir(os.path.join(path, PARAMS_DIR)):
    return "ours"
  if any(os.path.isfile(os.path.join(path, f)) for f in (SINGLE_FILE, INDEX_FILE)):
    return "hf"
  raise FileNotFoundError(f"no weights in {path}: expected {SINGLE_FILE}, {INDEX_FILE} + shards, "
                          f"or an Orbax {PARAMS_DIR}/ directory")


def _hf_files(path: str) -> list[str]:
  index = os.path.join(path, INDEX_FILE)
  if os.path.isfile(index):
    try:
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise ValueError(f"{index}: not a safetensors index (bad JSON or no weight_map: {e})") from None
    files = sorted(set(weight_map.values()))
  else:
    files = [SINGLE_FILE]
  for f in files:
    if not os.path.isfile(os.path.join(path, f)):
      raise FileNotFoundError(f"missing weights file {f} in {path}")
  return files


def _read_header(file: str) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
  """name -> (dtype, shape) from a safetensors header; errors name the file."""
  from safetensors import safe_open
  out = {}
  try:
    with safe_open(file, framework="np") as f:
      for name in f.keys():
        sl = f.get_slice(name)
        st = sl.get_dtype()
        if st not in _ST_DTYPES:
          raise ValueError(f"{file}: tensor {name} has dtype {st}, supported: {sorted(_ST_DTYPES)}")
        out[name] = (_ST_DTYPES[st], tuple(sl.get_shape()))
  except ValueError:
    raise
  except Exception as e:  # SafetensorError: truncated file, bad header, ...
    raise ValueError(f"{file}: truncated or corrupt safetensors file ({e})") from None
  return out


def _read_tensor(file: str, name: str) -> np.ndarray:
  from safetensors import safe_open
  # A fresh map per tensor: closing it drops the file pages from our resident set.
  with safe_open(file, framework="np") as f:
    return f.get_tensor(name)


def _plan_hf(path: str, config: Qwen3Config):
  """Validates an HF directory's tensors against `config` from headers only.

  Returns [(file, HF name, our path, hook, dtype)] in HF order, plus the name of a redundant tied
  `lm_head.weight` to check (or None).
  """
  where: dict[str, tuple[str, np.dtype, tuple[int, ...]]] = {}
  for f in _hf_files(path):
    for name, (dt, shape) in _read_header(os.path.join(path, f)).items():
      where[name] = (f, dt, shape)
  plan, expected = [], set()
  for name, ours, hook, shape in _hf_order(config):
    expected.add(name)
    if name not in where:
      raise ValueError(f"{path}: tensor {name} is missing from the checkpoint")
    f, dt, got = where[name]
    if got != shape:
      raise ValueError(f"{path}: tensor {name} has shape {list(got)}, expected {list(shape)} "
                       f"from {CONFIG_FILE}")
    plan.append((f, name, ours, hook, dt))
  tied_head = None
  if config.tie_word_embeddings and "lm_head.weight" in where:
    # Some exporters store the tied head too; accepted when it is the same matrix (checked later).
    expected.add("lm_head.weight")
    if where["lm_head.weight"][2] != (config.vocab_size, config.hidden_size):
      raise ValueError(f"{path}: tensor lm_head.weight has shape {list(where['lm_head.weight'][2])}, "
                       f"expected {[config.vocab_size, config.hidden_size]} from {CONFIG_FILE}")
    tied_head = where["lm_head.weight"][0]
  extra = sorted(set(where) - expected, key=_natural_key)
  if extra:
    more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
    raise ValueError(f"{path}: unexpected tensor {extra[0]}{more} not used by the Qwen3 config")
  return plan, tied_head


def _load_hf(path: str, dtype=None, progress: bool = False) -> tuple[Qwen3Config, dict]:
  config = _config_from_json(path, _read_config_json(path))
  plan, tied_head = _plan_hf(path, config)
  flat = {}
  for f, name, ours, hook, _ in _progress(plan, progress, "read safetensors"):
    a = _read_tensor(os.path.join(path, f), name)
    if dtype is not None:
      a = a.astype(dtype, copy=False)
    flat[ours] = _apply(hook, a)
    del a
  if tied_head is not None:
    head = _read_tensor(os.path.join(path, tied_head), "lm_head.weight")
    if not np.array_equal(head.astype(flat["embed_tokens/embedding"].dtype),
                          flat["embed_tokens/embedding"]):
      raise ValueError(f"{path}: tie_word_embeddings is true but lm_head.weight differs from "
                       "model.embed_tokens.weight")
    del head
  pdt = np.dtype(flat["embed_tokens/embedding"].dtype)
  return config.replace(param_dtype=_DTYPE_NAMES[pdt]), unflatten(flat)


def _progress(it, on: bool, desc: str):
  if not on:
    return it
  from tqdm import tqdm
  return tqdm(it, desc=desc, unit="tensor")


# ---- our format (Orbax) --------------------------------------------------------------------------
def _checkpointer():
  import orbax.checkpoint as ocp
  return ocp.PyTreeCheckpointer()


def _save_checkpointer():
  """Saves host numpy arrays in place: Orbax's default deep-copies every host array first (2x the
  weights in memory) and compresses into more buffers; bf16 weights barely compress anyway."""
  import orbax.checkpoint as ocp
  import jax
  th = ocp.type_handlers
  registry = th.create_type_handler_registry(
      (np.ndarray, th.NumpyHandler(deepcopy_host_arrays=False)), (jax.Array, th.ArrayHandler()))
  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry,
                                                      use_compression=False))


def _orbax_meta(path: str) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
  pdir = os.path.join(path, PARAMS_DIR)
  try:
    md = _checkpointer().metadata(pdir)
    tree = md.item_metadata.tree
  except Exception as e:
    raise ValueError(f"{pdir}: not a readable Orbax checkpoint ({type(e).__name__}: {e})") from None
  return {p: (np.dtype(m.dtype), tuple(m.shape)) for p, m in flatten(dict(tree)).items()}


def _validate_ours(path: str, config: Qwen3Config, meta) -> None:
  want = expected_shapes(config)
  for p, shape in want.items():
    if p not in meta:
      raise ValueError(f"{path}: parameter {p} is missing from the checkpoint")
    if meta[p][1] != shape:
      raise ValueError(f"{path}: parameter {p} has shape {list(meta[p][1])}, expected {list(shape)} "
                       f"from {CONFIG_FILE}")
  extra = sorted(set(meta) - set(want), key=_natural_key)
  if extra:
    raise ValueError(f"{path}: unexpected parameter {extra[0]} not used by the Qwen3 config")


def _restore(path: str, paths: list[str] | None, dtype=None, shardings: dict | None = None) -> dict:
  """Restores the listed parameters (all when None) as numpy arrays (nested dict); with
  `shardings` ({path: Sharding}) as jax arrays read straight into those shardings (each process
  reads only its shards)."""
  import orbax.checkpoint as ocp
  pdir = os.path.join(path, PARAMS_DIR)
  args = ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)
  if paths is None:
    paths = list(_orbax_meta(path))
    item = None
  else:
    item = unflatten({p: 0 for p in paths})
  if shardings is not None:
    import jax
    restore_args = unflatten({p: ocp.ArrayRestoreArgs(restore_type=jax.Array, sharding=shardings[p], dtype=dtype)
                              for p in paths})
  else:
    restore_args = unflatten({p: args for p in paths})
  return _checkpointer().restore(pdir, args=ocp.args.PyTreeRestore(
      item=item, restore_args=restore_args, partial_restore=item is not None))


@contextlib.contextmanager
def _stderr_held():
  """Holds what is written to stderr (fd 2, native libraries included) and passes it on when the
  body succeeds. A truncated params file makes tensorstore's threads print the start of a
  traceback while the main thread's error becomes the one line the command line prints."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    ok = False
    try:
      yield
      ok = True
    finally:
      if not ok:  # the failed read's threads may still be writing: let them finish into `held`
        _wait_quiet(held)
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      if ok:
        held.seek(0)
        text = held.read()
        if text:
          os.write(2, text)


def _wait_quiet(f, quiet_s: float = 0.3, most_s: float = 3.0) -> None:
  """Returns once `f` has not grown for `quiet_s` (at most `most_s`)."""
  import time
  end, size, since = time.monotonic() + most_s, -1, time.monotonic()
  while time.monotonic() < end:
    now = os.fstat(f.fileno()).st_size
    if now != size:
      size, since = now, time.monotonic()
    elif time.monotonic() - since >= quiet_s:
      return
    time.sleep(0.05)


def _load_ours(path: str, dtype=None, shardings=None) -> tuple[Qwen3Config, dict]:
  config = _config_from_json(path, _read_config_json(path))
  meta = _orbax_meta(path)
  _validate_ours(path, config, meta)
  _check_params_sizes(path)
  with _stderr_held():
    params = _restore(path, None, dtype, None if shardings is None else flatten(shardings(config)))
  pdt = np.dtype(params["embed_tokens"]["embedding"].dtype)
  return config.replace(param_dtype=_DTYPE_NAMES[pdt]), params


def load_model_dir(path: str, dtype=None, progress: bool = False,
                   shardings: Callable[[Qwen3Config], dict] | None = None) -> tuple[Qwen3Config, dict]:
  """(config, params) from an HF directory or one of ours. Params are host numpy arrays.

  `dtype` (e.g. "float32", jnp.bfloat16) casts every tensor as it is read; by default each keeps
  the checkpoint's dtype and `config.param_dtype` records the embedding's. `shardings(config)` ->
  a tree of shardings (per-layer layout): our format is then restored as jax arrays straight into
  them (every process must call it; each reads only its shards); an HF directory is read on the
  host and placed.
  """
  fmt = detect_format(path)
  dtype = None if dtype is None else np.dtype(dtype)
  try:
    if fmt != "hf":
      return _load_ours(path, dtype, shardings)
    config, params = _load_hf(path, dtype, progress)
  except ValueError as e:  # a bad file (truncated, corrupt, mismatched): one line naming it
    msg = " ".join(str(e).split())
    raise InputError(msg if msg.startswith(path) else f"{path}: cannot load the model ({msg})") from e
  if shardings is not None:
    import jax
    params = jax.device_put(params, shardings(config))
  return config, params


def save_model_dir(path: str, config: Qwen3Config, params: dict, tokenizer_src=None,
                   overwrite: bool = False) -> str:
  """Writes our format: `params/` (Orbax) + `config.json` (HF form, "dgr2" block) + tokenizer.

  `params`: numpy or jax arrays; each keeps its dtype. With several processes every process calls
  it with the same (global, possibly sharded) arrays and the same path. Stacked layers (scanned
  training, `qwen3.stack_layers`) are written per layer, so every model dir has one layout.
  """
  import orbax.checkpoint as ocp
  params = qwen3.unstack_layers(params)
  config = config.replace(scan_layers=False)
  _check_params(path, config, params)
  # One process: host numpy leaves (jax arrays are fetched to host one by one; numpy ones are not
  # copied). Several: the global jax arrays as they are, every process writing its own shards.
  if not multihost.is_multi():
    params = unflatten({p: np.asarray(a) for p, a in flatten(params).items()})
  with _atomic_output(path, overwrite, finish=_write_params_sizes) as tmp:
    _save_checkpointer().save(os.path.join(tmp, PARAMS_DIR), args=ocp.args.PyTreeSave(params))
    _write_json(os.path.join(tmp, CONFIG_FILE), config.to_hf_dict())
    _write_tokenizer(tmp, tokenizer_src)
  return path


def _params_sizes(path: str) -> dict[str, int]:
  pdir = os.path.join(path, PARAMS_DIR)
  return {os.path.relpath(os.path.join(d, n), pdir): os.path.getsize(os.path.join(d, n))
          for d, _, names in os.walk(pdir) for n in names}


def _write_params_sizes(tmp: str) -> None:
  with open(os.path.join(tmp, PARAMS_SIZES_FILE), "w") as f:
    json.dump(dict(sorted(_params_sizes(tmp).items())), f, indent=1)
    f.write("\n")


def _check_params_sizes(path: str) -> None:
  """Every file under params/ has the size it was written with (model dirs from before the sizes
  file existed are not checked here; Orbax's own error then names the file)."""
  file = os.path.join(path, PARAMS_SIZES_FILE)
  if not os.path.exists(file):
    return
  try:
    with open(file) as f:
      want = json.load(f)
    assert isinstance(want, dict)
  except (ValueError, AssertionError):
    raise ValueError(f"{file}: not valid JSON ({{file: bytes}})") from None
  have = _params_sizes(path)
  for rel, size in want.items():
    where = os.path.join(path, PARAMS_DIR, rel)
    if rel not in have:
      raise ValueError(f"{path}: cannot load the model ({where} is missing)")
    if have[rel] != size:
      raise ValueError(f"{path}: cannot load the model ({where} has {have[rel]} bytes, "
                       f"{PARAMS_SIZES_FILE} says {size}: cut short or replaced)")


def _check_params(path: str, config: Qwen3Config, params: dict) -> None:
  meta = {p: (np.dtype(a.dtype), tuple(a.shape)) for p, a in flatten(params).items()}
  _validate_ours(path, config, meta)


# ---- writing HF directories ----------------------------------------------------------------------
def _plan_shards(rows, shard_bytes: int) -> list[list]:
  shards, cur, size = [], [], 0
  for r in rows:
    n = r[-1]
    if cur and size + n > shard_bytes:
      shards.append(cur)
      cur, size = [], 0
    cur.append(r)
    size += n
  if cur:
    shards.append(cur)
  return shards


def _write_safetensors(file: str, rows, get: Callable[[str], np.ndarray]) -> None:
  """Writes one safetensors file tensor by tensor. rows: (HF name, dtype, shape, nbytes)."""
  header, off = {}, 0
  for name, dt, shape, nbytes in rows:
    header[name] = {"dtype": _ST_NAMES[dt], "shape": list(shape), "data_offsets": [off, off + nbytes]}
    off += nbytes
  header["__metadata__"] = {"format": "pt"}
  hb = json.dumps(header, separators=(",", ":")).encode()
  hb += b" " * (-len(hb) % 8)  # the data section starts 8-byte aligned
  with open(file, "wb") as f:
    f.write(struct.pack("<Q", len(hb)))
    f.write(hb)
    for name, dt, shape, nbytes in rows:
      a = get(name)
      if a.dtype != dt or a.shape != tuple(shape):
        raise ValueError(f"tensor {name}: got {a.dtype}{list(a.shape)}, expected {dt}{list(shape)}")
      np.ascontiguousarray(a).tofile(f)
      del a


def _write_hf(out_dir: str, config: Qwen3Config, dtypes: dict[str, np.dtype],
              get_ours: Callable[[str], np.ndarray], shard_bytes: int, progress: bool) -> None:
  """Writes weights (+ index when sharded) and config.json into `out_dir`."""
  order = _hf_order(config)
  by_name = {name: (ours, hook) for name, ours, hook, _ in order}
  rows = [(name, dtypes[ours], shape, math.prod(shape) * dtypes[ours].itemsize)
          for name, ours, hook, shape in order]
  shards = _plan_shards(rows, shard_bytes)
  bar = _progress(range(len(rows)), progress, "write safetensors")
  bar_update = getattr(bar, "update", lambda n: None)

  def get(name):
    ours, hook = by_name[name]
    a = _apply(hook, get_ours(ours))
    bar_update(1)
    return a

  if len(shards) == 1:
    _write_safetensors(os.path.join(out_dir, SINGLE_FILE), shards[0], get)
  else:
    weight_map = {}
    for k, shard in enumerate(shards):
      fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
      _write_safetensors(os.path.join(out_dir, fname), shard, get)
      weight_map.update({r[0]: fname for r in shard})
    _write_json(os.path.join(out_dir, INDEX_FILE),
                {"metadata": {"total_size": sum(r[-1] for r in rows)}, "weight_map": weight_map})
  getattr(bar, "close", lambda: None)()
  d = config.to_hf_dict()
  d["torch_dtype"] = _DTYPE_NAMES[dtypes["embed_tokens/embedding"]]
  _write_json(os.path.join(out_dir, CONFIG_FILE), d)


def save_hf_dir(path: str, config: Qwen3Config, params: dict, tokenizer_src=None,
                shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                progress: bool = False) -> str:
  """Writes an HF directory (transformers loads it) from an in-memory parameter tree."""
  params = qwen3.unstack_layers(params)
  config = config.replace(scan_layers=False)
  _check_params(path, config, params)
  flat = flatten(params)
  dtypes = {p: np.dtype(a.dtype) for p, a in flat.items()}
  with _atomic_output(path, overwrite) as tmp:
    if multihost.is_writer():  # several processes: the arrays must be fetchable on process 0
      _write_hf(tmp, config, dtypes, lambda p: np.asarray(flat[p]), shard_bytes, progress)
    _write_tokenizer(tmp, tokenizer_src)
  return path


# ---- vocabulary extension ------------------------------------------------------------------------
def extend_vocab(config: Qwen3Config, params: dict, num_before: int,
                 num_after: int) -> tuple[Qwen3Config, dict]:
  """Initialises rows of token ids [num_before, num_after) to the mean of rows [0, num_before).

  `num_before`/`num_after` are the tokenizer lengths before/after adding tokens. The embedding (and
  the LM head when untied; a tied head is the embedding, so it grows once) grows to `num_after`
  rows when that exceeds `vocab_size`; ids already inside the matrix (the unused padding rows of
  Qwen checkpoints) are overwritten. Returns a new config and a new tree; other leaves are shared.
  """
  if not 0 < num_before <= num_after:
    raise ValueError(f"extend_vocab: need 0 < num_before ({num_before}) <= num_after ({num_after})")
  if num_before > config.vocab_size:
    raise ValueError(f"extend_vocab: tokenizer has {num_before} tokens but the model only "
                     f"{config.vocab_size} embedding rows")
  new_v = max(config.vocab_size, num_after)

  def grow(rows: np.ndarray) -> np.ndarray:  # [V, H] -> [new_v, H]
    mean = rows[:num_before].astype(np.float32).mean(axis=0).astype(rows.dtype)
    out = rows if new_v == rows.shape[0] else np.concatenate(
        [rows, np.empty((new_v - rows.shape[0], rows.shape[1]), rows.dtype)], axis=0)
    if out is rows:
      out = rows.copy()
    out[num_before:num_after] = mean
    return out

  params = dict(params)
  params["embed_tokens"] = {"embedding": grow(np.asarray(params["embed_tokens"]["embedding"]))}
  if not config.tie_word_embeddings:
    params["lm_head"] = {"kernel": np.ascontiguousarray(
        grow(np.asarray(params["lm_head"]["kernel"]).T).T)}
  return config.replace(vocab_size=new_v), params


# ---- whole-directory conversions (the CLI) ------------------------------------------------------
def _read_token_file(file: str) -> list[str]:
  if not os.path.isfile(file):
    raise FileNotFoundError(f"--add_tokens file not found: {file}")
  with open(file, encoding="utf-8") as f:
    toks = [line.rstrip("\n") for line in f]
  toks = [t for t in toks if t.strip()]
  if not toks:
    raise ValueError(f"{file}: no tokens (expected one token a line)")
  return toks


def convert_hf_to_ours(hf_dir: str, out_dir: str, *, add_tokens_file: str | None = None,
                       mask_token: str | None = None, block_size: int = 1,
                       attention: str | None = None, dtype=None, overwrite: bool = False,
                       progress: bool = True) -> Qwen3Config:
  """HF directory -> ours, optionally adding tokens and setting the block-diffusion fields."""
  out_abs = os.path.abspath(out_dir)
  if os.path.exists(out_abs) and not overwrite:
    raise FileExistsError(f"output directory already exists: {out_abs} (pass --overwrite)")
  if detect_format(hf_dir) != "hf":
    raise ValueError(f"{hf_dir} is not an HF checkpoint directory (it holds an Orbax {PARAMS_DIR}/)")
  config = _config_from_json(hf_dir, _read_config_json(hf_dir))
  _plan_hf(hf_dir, config)  # validate everything before the long part
  tokenizer = hf_dir if has_tokenizer(hf_dir) else None
  extra = _read_token_file(add_tokens_file) if add_tokens_file else []
  if extra or mask_token:
    if tokenizer is None:
      raise FileNotFoundError(f"no tokenizer files in {hf_dir}; --add_tokens/--mask_token need one")
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    before = len(tokenizer)
    if extra:
      tokenizer.add_tokens(extra)
    if mask_token:
      tokenizer.add_special_tokens({"mask_token": mask_token})
    after = len(tokenizer)
  config, params = _load_hf(hf_dir, None if dtype is None else np.dtype(dtype), progress)
  if extra or mask_token:
    config, params = extend_vocab(config, params, before, after)
    if mask_token:
      config = config.replace(mask_token_id=int(tokenizer.convert_tokens_to_ids(mask_token)))
  attention = attention or ("block_causal" if block_size > 1 else "causal")
  if block_size > 1 and config.mask_token_id is None:
    raise ValueError(f"--block_size={block_size} needs a mask token: pass --mask_token=<|mask|>")
  try:
    config = config.replace(block_size=block_size, attention=attention)
  except ValueError as e:
    raise ValueError(f"--block_size/--attention: {e}") from None
  # A modified tokenizer is saved; the source directory still supplies generation_config.json etc.
  sources = [s for s in (tokenizer, hf_dir) if s is not None]
  save_model_dir(out_dir, config, params, tokenizer_src=sources, overwrite=overwrite)
  return config


def convert_ours_to_hf(in_dir: str, out_dir: str, *, shard_bytes: int = DEFAULT_SHARD_BYTES,
                       overwrite: bool = False, progress: bool = True) -> Qwen3Config:
  """Ours -> HF directory, restoring and writing one array at a time."""
  out_abs = os.path.abspath(out_dir)
  if os.path.exists(out_abs) and not overwrite:
    raise FileExistsError(f"output directory already exists: {out_abs} (pass --overwrite)")
  if detect_format(in_dir) != "ours":
    raise ValueError(f"{in_dir} is not one of our checkpoint directories (no {PARAMS_DIR}/)")
  config = _config_from_json(in_dir, _read_config_json(in_dir))
  meta = _orbax_meta(in_dir)
  _validate_ours(in_dir, config, meta)
  dtypes = {p: dt for p, (dt, _) in meta.items()}
  config = config.replace(param_dtype=_DTYPE_NAMES[dtypes["embed_tokens/embedding"]])

  def get(p):
    return flatten(_restore(in_dir, [p]))[p]

  with _atomic_output(out_dir, overwrite) as tmp:
    if multihost.is_writer():
      _write_hf(tmp, config, dtypes, get, shard_bytes, progress)
    _write_tokenizer(tmp, in_dir)
  return config
