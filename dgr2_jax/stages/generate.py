"""Stage `generate`: decode the prompts of a JSONL file with any model directory.

  python -m dgr2_jax.main --config=configs/generate.py --config.model_dir=DIR \
      --config.input=prompts.jsonl --config.output=out.jsonl --config.decode.block_size=1

Reads `config.model_dir` (an HF directory or ours; `load_model_dir` detects which) and
`config.input`, one JSON object per line:
  {"prompt_ids": [int, ...]}             token ids as they are
  {"prompt": "text"}                     encoded with the model dir's tokenizer (no template)
  {"messages": [{"role", "content"}...]} the tokenizer's chat template + generation prompt
                                          (`config.enable_thinking` is passed to the template)
Writes `config.output`, one line per input line in the same order:
  {"output_ids", "text", "nfe", "commit_step", "logprob"} (per output token; EOS included).
The whole input is parsed and checked before any decoding, a bad line fails with its line
number, and the output is written to a temporary file renamed into place (never partial).
Decoding uses static shapes: `config.batch_size` rows (the last batch padded with a copy of a real
prompt, whose outputs are dropped) and `config.max_prompt_len` slots (0 => the longest prompt
rounded up to a multiple of 64). `decode.block_size > 1` on an AR checkpoint converts it on the
fly (same weights, block-causal attention); that needs a mask token (model config, else the
tokenizer's `<|mask|>`). `decode.mode='speculative'` drafts with `model_dir` and verifies with
`decode.verifier_dir` (an AR model with the same tokenizer): the output is the verifier's.
The DecodeConfig comes from `config.decode` as in every stage (`sampler.decode_config_from`).
Decoding runs on the decode mesh (`config.decode.mesh`, decode/mesh.py): each batch's rows over its
data axis, the model over its tensor axis (`decode.mesh.tensor=8`: an 8B model across 8 GPUs).
"""

from __future__ import annotations

import json
import os
import tempfile

import jax
import numpy as np
import tqdm

from dgr2_jax import checks
from dgr2_jax.decode import mesh as dmesh
from dgr2_jax.decode import runtime
from dgr2_jax.decode import sampler
from dgr2_jax.decode import speculative
from dgr2_jax.fileio import InputError
from dgr2_jax.model import checkpoint
from dgr2_jax.stages import contract
from dgr2_jax.task import tokenizer as tok_lib

PROMPT_ROUND = 64
MASK_TOKEN = "<|mask|>"
EOS_TOKEN = "<|im_end|>"


def read_prompts(path: str, tokenizer, enable_thinking: bool = True) -> list[list[int]]:
  """Token-id prompts of every line; ValueError naming `path:line` on the first bad one."""
  prompts = []
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        raise InputError(f"{path}:{n}: empty line (expected one JSON object per line)")
      where = f"{path}:{n}"
      try:
        d = json.loads(line)
      except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON ({e.msg})") from None
      if not isinstance(d, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(d).__name__}")
      kinds = [k for k in ("prompt_ids", "prompt", "messages") if k in d]
      if len(kinds) != 1:
        raise InputError(f"{where}: expected exactly one of prompt_ids, prompt, messages; "
                         f"got keys {sorted(d)}")
      kind, v = kinds[0], d[kinds[0]]
      if kind == "prompt_ids":
        if not isinstance(v, list) or not v or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
          raise InputError(f"{where}: prompt_ids must be a non-empty list of ints >= 0")
        ids = list(v)
      else:
        if tokenizer is None:
          raise InputError(f"{where}: a {kind!r} line needs a tokenizer in the model directory")
        if kind == "prompt":
          if not isinstance(v, str) or not v:
            raise InputError(f"{where}: prompt must be a non-empty string")
          ids = list(tokenizer.encode(v, add_special_tokens=False))
        else:
          if not isinstance(v, list) or not v or not all(
              isinstance(m, dict) and isinstance(m.get("role"), str)
              and isinstance(m.get("content"), str) for m in v):
            raise InputError(f"{where}: messages must be a non-empty list of "
                             "{\"role\": str, \"content\": str}")
          text = tokenizer.apply_chat_template(v, tokenize=False, add_generation_prompt=True,
                                               enable_thinking=enable_thinking)
          ids = list(tokenizer.encode(text, add_special_tokens=False))
        if not ids:
          raise InputError(f"{where}: the {kind} encodes to no tokens")
      prompts.append(ids)
  if not prompts:
    raise InputError(f"{path}: no prompts")
  return prompts


def _special_ids(model_config, tokenizer, block_size: int, model_dir: str) -> dict:
  vocab = tokenizer.get_vocab() if tokenizer is not None else {}
  eos = tuple(model_config.eos_ids) or ((vocab[EOS_TOKEN],) if EOS_TOKEN in vocab else ())
  mask = model_config.mask_token_id
  if mask is None and MASK_TOKEN in vocab:
    mask = vocab[MASK_TOKEN]
  if block_size > 1 and mask is None:
    raise InputError(f"decode.block_size={block_size} needs a mask token, and {model_dir} has "
                     f"none (no dgr2.mask_token_id in config.json, no {MASK_TOKEN} in its "
                     "tokenizer); use decode.block_size=1 or convert with --mask_token")
  if mask is not None and not 0 <= mask < model_config.vocab_size:
    raise InputError(f"{model_dir}: mask token id {mask} is outside the vocabulary "
                     f"({model_config.vocab_size})")
  pad = model_config.pad_token_id
  if pad is None:
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
  return dict(eos_ids=eos, mask_token_id=mask, pad_id=int(pad))


def prompt_slots(prompts, max_prompt_len: int) -> int:
  longest = max(len(p) for p in prompts)
  if max_prompt_len:
    if longest > max_prompt_len:
      i = max(range(len(prompts)), key=lambda k: len(prompts[k]))
      raise ValueError(f"config.max_prompt_len ({max_prompt_len}) is shorter than prompt {i + 1} "
                       f"({longest} tokens)")
    return max_prompt_len
  return -(-longest // PROMPT_ROUND) * PROMPT_ROUND


def generate_all(model_config, params, prompts, dcfg, batch_size: int, max_prompt_len: int,
                 seed: int = 0, progress: bool = True, generate_fn=None, mesh=None) -> list[dict]:
  """Decodes `prompts` in static batches; one record per prompt, in order. `generate_fn`:
  `sampler.generate` on `mesh` (default) or the speculative one (`runtime.speculative_generate`,
  given the same mesh). `mesh` (decode/mesh.py; None = the default device): each batch's rows
  over its data axis, the model over its tensor axis."""
  generate_fn = generate_fn or runtime.threshold_generate(mesh)
  params = dmesh.put_params(mesh, params) if mesh is not None else jax.device_put(params)
  rng = jax.random.PRNGKey(seed)
  recs = []
  it = range(0, len(prompts), batch_size)
  for s in (tqdm.tqdm(it, desc="generate") if progress else it):
    chunk = prompts[s:s + batch_size]
    n_real = len(chunk)
    chunk = chunk + [chunk[-1]] * (batch_size - n_real)
    rng, sub = jax.random.split(rng)
    res = generate_fn(model_config, params, chunk, dcfg, sub, max_prompt_len=max_prompt_len)
    for i in range(n_real):
      ids = [int(t) for t in res["output_ids"][i]]
      k = len(ids)
      recs.append({"output_ids": ids, "nfe": int(res["nfe"][i]),
                   "commit_step": np.asarray(res["commit_step"][i][:k]).astype(int).tolist(),
                   "logprob": [float(x) for x in np.asarray(res["logprob"][i][:k])]})
  return recs


def write_jsonl_atomic(path: str, records) -> None:
  d = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", dir=d)
  try:
    with os.fdopen(fd, "w") as f:
      for r in records:
        f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def run(config, workdir: str | None = None) -> str:
  """Reads config.input, writes config.output; returns the output path."""
  del workdir  # explicit paths only
  if not config.model_dir:
    raise ValueError("config.model_dir is required for config.stage='generate'")
  if not config.input or not os.path.isfile(config.input):
    raise FileNotFoundError(f"config.input: input file {config.input!r} does not exist")
  if not config.output:
    raise ValueError("config.output is required for config.stage='generate'")
  checkpoint.detect_format(config.model_dir)  # fails early, before reading the prompts
  mesh = dmesh.from_config(config)             # so does a decode.mesh that does not fit the devices
  tokenizer = None
  if checkpoint.has_tokenizer(config.model_dir):
    tokenizer = tok_lib.load_tokenizer(config.model_dir)
  prompts = read_prompts(config.input, tokenizer, bool(config.get("enable_thinking", True)))
  wd = runtime.weight_dtype(config)
  # on the devices as the decoder reads them (runtime.load_on_device: prepared on the host, placed once)
  model_config, params = runtime.load_on_device(config.model_dir, None, None, mesh, wd)
  for n, p in enumerate(prompts, 1):
    bad = [t for t in p if t >= model_config.vocab_size]
    if bad:
      raise InputError(f"{config.input}:{n}: token id {bad[0]} is outside the vocabulary "
                       f"({model_config.vocab_size})")
  d = config.decode
  dcfg = sampler.decode_config_from(d, **_special_ids(model_config, tokenizer, int(d.block_size), config.model_dir))
  slots = prompt_slots(prompts, int(config.get("max_prompt_len", 0)))
  generate_fn = None
  if d.get("mode", "threshold") == "speculative":
    if not d.get("verifier_dir", ""):
      raise ValueError("config.decode.verifier_dir is required with decode.mode='speculative' (the AR model "
                       "that verifies the drafts of config.model_dir)")
    models = {}   # the verifier is read once, for the pair check and for decoding
    vcfg = runtime.load_on_device(d.verifier_dir, None, models, mesh, wd)[0]
    speculative.check_pair(model_config, vcfg, dcfg.mask_token_id)
    generate_fn = runtime.speculative_generate(d.verifier_dir, None, models, mesh, wd)
  recs = generate_all(model_config, params, prompts, dcfg, int(config.batch_size), slots,
                      int(config.get("seed", 0)), generate_fn=generate_fn, mesh=mesh)
  for r in recs:
    r["text"] = (tokenizer.decode(r["output_ids"], skip_special_tokens=False)
                 if tokenizer is not None else None)
  write_jsonl_atomic(config.output, [{k: r[k] for k in ("output_ids", "text", "nfe",
                                                          "commit_step", "logprob")}
                                     for r in recs])
  print(f"generate: {len(recs)} outputs -> {config.output}", flush=True)
  return config.output


# Explicit paths, no workdir: no freshness, nothing in the pipeline.
STAGE = contract.Stage(name="generate", build=run, workdir=False)


def validate(config, runs: set) -> None:
  """Checks the generate preset's fields (configs/generate.py) when the generate stage runs."""
  c = config
  if "generate" not in runs:
    return
  for f in ("model_dir", "input", "output"):
    if not c.get(f):
      checks.fail(f, "is required for config.stage='generate'")
  checks.model_dir("model_dir", c.model_dir)
  checks.is_file("input", c.input, "input file")
  if os.path.isdir(c.output):
    checks.fail("output", f"{c.output!r} is a directory; give the JSONL file to write")
  checks.is_dir("output", os.path.dirname(os.path.abspath(c.output)), "output folder")
  if not checks.is_int(c.batch_size, 1):
    checks.fail("batch_size", f"must be an int >= 1, got {c.batch_size!r}")
  if not checks.is_int(c.max_prompt_len, 0):
    checks.fail("max_prompt_len", f"must be an int >= 0 (0 = automatic), got {c.max_prompt_len!r}")
