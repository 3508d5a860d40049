"""The decode mesh (decode/mesh.py) on simulated CPU devices: tensor-parallel decoding over 2, 4
and 8 devices equals one device token for token (AR, threshold, speculative), data-parallel
decoding (the generate and eval stages) gives each device its own rows with outputs equal to one
device, and sampled rollouts on a training mesh (data x fsdp x tensor) equal one device's. With the
compilers of `pip install -e ".[aot]"`, the decoders compiled for 2 H100s and a TPU v5e slice hold
no all-gather of a vocabulary-sized array in a decode loop.

The simulated-device checks run in a subprocess: XLA_FLAGS must set the CPU device count before jax
initialises.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from dgr2_jax.decode import mesh as dmesh

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import jax, numpy as np
from dgr2_jax.model import qwen3
from dgr2_jax.model.config import Qwen3Config
from dgr2_jax.decode import mesh as dmesh, sampler, speculative
from dgr2_jax.stages import generate as generate_stage
assert jax.device_count() == 8, jax.devices()
# 8 query heads split over tensor <= 8; 4 kv heads: the k/v projections and the cache are
# replicated at tensor=8 (their dimension does not divide), split at 2 and 4.
cfg = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=8, rope_theta=10000.0,
                  mask_token_id=63, eos_token_id=5, pad_token_id=0)
params = qwen3.init_params(cfg, jax.random.PRNGKey(1))
params = jax.device_get(jax.tree_util.tree_map(lambda x: x * 8 if x.ndim == 2 else x, params))
r = np.random.RandomState(0)
prompts = [r.randint(6, 60, size=n).tolist() for n in (5, 9, 3)]
dc = lambda bs, tau: sampler.decode_config_for(cfg, block_size=bs, threshold=tau, max_new_tokens=8, eos_ids=(5,))
KEYS = ("tokens", "commit_step", "nfe", "eos_pos")
res = {}

def same(a, b):
  return all(np.array_equal(a[k], b[k]) for k in KEYS) and np.allclose(a["logprob"], b["logprob"], atol=1e-5)

ref = {"ar": sampler.generate(cfg, params, prompts, dc(1, 1.0)),
       "threshold": sampler.generate(cfg, params, prompts, dc(4, 0.7)),
       "speculative": speculative.generate(cfg, params, cfg, params, prompts, dc(4, 0.7))}
res["ref_tokens"] = {k: v["output_ids"] for k, v in ref.items()}
for t in (2, 4, 8):
  mesh = dmesh.make_mesh(1, t)
  p = dmesh.put_params(mesh, params)
  q = p["layers_0"]["self_attn"]["q_proj"]["kernel"]
  res[f"q_shards_t{t}"] = len({s.device for s in q.addressable_shards}), q.addressable_shards[0].data.shape[1]
  res[f"vocab_shard_t{t}"] = p["embed_tokens"]["embedding"].addressable_shards[0].data.shape[0]
  outs = {"ar": sampler.generate(cfg, p, prompts, dc(1, 1.0), mesh=mesh),
          "threshold": sampler.generate(cfg, p, prompts, dc(4, 0.7), mesh=mesh),
          "speculative": speculative.generate(cfg, p, cfg, p, prompts, dc(4, 0.7), mesh=mesh)}
  res[f"equal_t{t}"] = {k: same(outs[k], ref[k]) for k in ref}
# One row: an AR step looks up a single embedding row (qwen3.embed_rows' one-row path).
mesh = dmesh.make_mesh(1, 8)
res["one_row_equal"] = same(sampler.generate(cfg, dmesh.put_params(mesh, params), prompts[:1], dc(1, 1.0), mesh=mesh),
                            sampler.generate(cfg, params, prompts[:1], dc(1, 1.0)))

# The tree the stages place (decode/runtime.py load_on_device: prepared on the host, fused q/k/v
# and gate/up split over tensor by the same rules) decodes as the trained layout on one device.
from dgr2_jax.decode import runtime
prepared = runtime.prepare_on_host(cfg, params)
for t in (2, 8):
  mesh = dmesh.make_mesh(1, t)
  p = dmesh.put_params(mesh, prepared)
  res[f"qkv_shard_t{t}"] = p["layers_0"]["self_attn"]["qkv_proj"]["kernel"].addressable_shards[0].data.shape[1]
  outs = {"threshold": sampler.generate(cfg, p, prompts, dc(4, 0.7), mesh=mesh),
          "speculative": speculative.generate(cfg, p, cfg, p, prompts, dc(4, 0.7), mesh=mesh)}
  res[f"prepared_equal_t{t}"] = {k: same(outs[k], ref[k]) for k in outs}

# Data-parallel: the generate stage's batch loop on data=4 (3 rows padded to 4), recording the
# rows each device receives.
placed = []
put_rows = dmesh.put_rows
def recording(mesh, *arrays):
  out, n = put_rows(mesh, *arrays)
  placed.append(out[0])
  return out, n
dmesh.put_rows = recording
mesh = dmesh.make_mesh(4, 1)
want = generate_stage.generate_all(cfg, params, prompts, dc(4, 0.7), 3, 16, seed=3, progress=False)
got = generate_stage.generate_all(cfg, params, prompts, dc(4, 0.7), 3, 16, seed=3, progress=False, mesh=mesh)
# Token for token; log-probs to f32 rounding (XLA blocks a 1-row matmul differently from a 3-row one).
res["dp_equal"] = len(got) == len(want) == 3 and all(
    g["output_ids"] == w["output_ids"] and g["commit_step"] == w["commit_step"] and g["nfe"] == w["nfe"]
    and np.allclose(g["logprob"], w["logprob"], atol=1e-5) for g, w in zip(got, want))
shards = placed[0].addressable_shards
res["dp_devices"] = sorted(s.device.id for s in shards)
res["dp_rows"] = sorted(s.index[0].start for s in shards), [s.data.shape[0] for s in shards]
res["dp_rows_match"] = all(np.array_equal(np.asarray(s.data), np.asarray(placed[0])[s.index]) for s in shards)
p4 = dmesh.put_params(mesh, params)
out = speculative.generate(cfg, p4, cfg, p4, prompts, dc(4, 0.7), mesh=mesh)
res["dp_speculative_equal"] = same(out, ref["speculative"]) and out["tokens"].shape[0] == 3

# Rollouts (OPD / RL) decode on the training mesh: data 2 x fsdp 2 x tensor 2, sampled.
from dgr2_jax.train import config as tcl, mesh as train_mesh, rollouts
tmesh = train_mesh.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
rules = tuple(tcl.train_config().logical_axis_rules)
tparams = jax.device_put(params, train_mesh.param_shardings(params, tmesh, rules))
toks, lens = sampler.left_pad(prompts + [prompts[0]], 16, 0)
dcs = sampler.decode_config_for(cfg, block_size=4, threshold=0.7, max_new_tokens=8, eos_ids=(5,), temperature=1.0)
a = rollouts.sample(cfg, params, toks, lens, dcs, jax.random.PRNGKey(7), group_size=2)
b = rollouts.sample(cfg, tparams, toks, lens, dcs, jax.random.PRNGKey(7), group_size=2,
                    batch_sharding=train_mesh.batch_sharding(tmesh, rules, 8))
res["rollouts_equal"] = same(a, b) and len({tuple(x) for x in a["output_ids"]}) > 4
print("RESULT " + json.dumps(res))
"""


# The eval stage end to end on 4 devices (synthetic task data, a tiny random model in place of the
# model directory): decode.mesh.data=4 against data=1, recording the rows each device receives.
_EVAL_CHILD = r"""
import json, os, sys, tempfile
sys.path.insert(0, sys.argv[1])
import jax, ml_collections, numpy as np
from dgr2_jax.decode import mesh as dmesh
from dgr2_jax.model import checkpoint, qwen3
from dgr2_jax.model.config import Qwen3Config
from dgr2_jax.stages import eval as eval_stage, traces as traces_stage
from dgr2_jax.task import config as task_config, synthetic
from dgr2_jax.task import tokenizer as tok_lib
assert jax.device_count() == 4, jax.devices()
data = synthetic.make(n_items=80, n_users=40, seed=1)
traces_stage.load_task_data = lambda workdir: data
traces_stage.load_items_sids = lambda workdir: (data["items"], data["sids"])
work = tempfile.mkdtemp()
c = ml_collections.ConfigDict()
c.seed = 0
c.task = task_config.task_config()
c.task.update(demo_vocab_size=1024, prompt_len=640, response_len=256, insert_target="random_position")
c.eval = task_config.eval_config()
c.decode = ml_collections.ConfigDict(dict(block_size=4, threshold=0.7, temperature=0.0, top_k=0, top_p=1.0,
                                          max_new_tokens=8, mesh=dict(data=1, tensor=1)))
traces_stage.run(c, work)
tok = tok_lib.load_tokenizer(traces_stage.tokenizer_dir(c, work))
tids = tok_lib.token_ids(tok)
cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, mask_token_id=tids.mask_id,
                  eos_token_id=tids.eos_id, pad_token_id=tids.pad_id)
params = jax.device_get(jax.tree_util.tree_map(lambda x: x * 8 if x.ndim == 2 else x,
                                               qwen3.init_params(cfg, jax.random.PRNGKey(1))))
checkpoint.load_model_dir = lambda path, *a, **k: (cfg, params)
model_dir = os.path.join(work, "model"); os.makedirs(model_dir)
placed = []
put_rows = dmesh.put_rows
def recording(mesh, *arrays):
  out, n = put_rows(mesh, *arrays)
  placed.append(out[0])
  return out, n
dmesh.put_rows = recording
preds = {}
for name, data_size in (("one", 1), ("dp4", 4)):
  with c.unlocked():
    c.eval.update(model_dir=model_dir, batch_size=3, max_examples=6, name=name)
    c.decode.mesh.data = data_size
  out = eval_stage.run(c, work)
  preds[name] = [json.loads(l) for l in open(os.path.join(out, "predictions.jsonl"))]
res = {"n": len(preds["one"]), "batches": len(placed),
       "equal": preds["one"] == preds["dp4"],
       "outputs": [r["output"] for r in preds["one"]]}
shards = placed[0].addressable_shards
res["devices"] = sorted(s.device.id for s in shards)
res["rows"] = sorted(s.index[0].start for s in shards), [s.data.shape[0] for s in shards]
res["rows_match"] = all(np.array_equal(np.asarray(s.data), np.asarray(placed[0])[s.index]) for s in shards)
import shutil; shutil.rmtree(work)
print("RESULT " + json.dumps(res))
"""


def _run_child(code: str, devices: int) -> dict:
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
             PYTHONPATH=REPO_ROOT)
  proc = subprocess.run([sys.executable, "-c", code, REPO_ROOT], env=env, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])


def test_eval_data_parallel_over_four_devices():
  res = _run_child(_EVAL_CHILD, 4)
  assert res["n"] == 6 and res["batches"] == 2 and len(set(res["outputs"])) > 1
  assert res["equal"]                                      # predictions.jsonl equal to one device's
  assert res["devices"] == [0, 1, 2, 3]                    # each device its own row of the batch
  assert res["rows"] == [[0, 1, 2, 3], [1, 1, 1, 1]] and res["rows_match"]


def test_decode_mesh_equals_one_device():
  res = _run_child(_CHILD, 8)
  for t in (2, 4, 8):
    assert res[f"equal_t{t}"] == {"ar": True, "threshold": True, "speculative": True}, (t, res)
    assert res[f"q_shards_t{t}"] == [t, 64 // t]           # heads really split over tensor
  assert res["one_row_equal"]                              # AR at batch 1, tensor=8
  for t in (2, 8):   # the prepared tree: fused q/k/v columns split over tensor too
    assert res[f"prepared_equal_t{t}"] == {"threshold": True, "speculative": True}, (t, res)
    assert res[f"qkv_shard_t{t}"] == 128 // t
    assert res[f"vocab_shard_t{t}"] == 64 // t             # embedding / LM head over the vocabulary
  # The decodes are not degenerate: rows differ and commit real tokens.
  toks = res["ref_tokens"]["threshold"]
  assert len({tuple(t) for t in toks}) == 3 and all(len(t) > 1 for t in toks)
  assert res["dp_equal"] and res["dp_speculative_equal"]
  assert res["dp_devices"] == [0, 1, 2, 3]                 # four devices, one shard each
  assert res["dp_rows"] == [[0, 1, 2, 3], [1, 1, 1, 1]] and res["dp_rows_match"]
  assert res["rollouts_equal"]                             # sampled rollouts on a data x fsdp x tensor mesh


@pytest.mark.parametrize("section,devices,want", [
    ({}, 8, (8, 1)), ({"data": 1, "tensor": 8}, 8, (1, 8)), ({"data": 0, "tensor": 2}, 8, (4, 2)),
    ({"data": 2, "tensor": -1}, 8, (2, 4)), ({"data": 1, "tensor": 2}, 8, (1, 2))])
def test_mesh_shape(section, devices, want):
  assert dmesh.mesh_shape(section, devices) == want


@pytest.mark.parametrize("section,field", [
    ({"data": -1, "tensor": -1}, "decode.mesh: at most one"), ({"tensor": 3}, "decode.mesh.tensor=3 does not divide"),
    ({"data": 4, "tensor": 4}, "needs 16 devices"), ({"tensor": "2"}, "decode.mesh.tensor must be an int"),
    ({"data": -2}, "decode.mesh.data must be an int")])
def test_mesh_shape_errors(section, field):
  with pytest.raises(ValueError, match=field.replace(".", r"\.")) as e:
    dmesh.mesh_shape(section, 8)
  assert "\n" not in str(e.value)


# Qwen3-8B's shape (36 layers, bf16) lowered with tensor=8 from shapes only: nothing allocated.
_LOWER_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from dgr2_jax.decode import mesh as dmesh, sampler
from dgr2_jax.model import qwen3
from dgr2_jax.model.config import Qwen3Config
cfg = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, dtype="bfloat16",
                  param_dtype="bfloat16", mask_token_id=151669, eos_token_id=151645, pad_token_id=151643)
mesh = dmesh.make_mesh(1, 8)
shapes = qwen3.param_shapes(cfg)
params = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                                dmesh.param_shardings(mesh, shapes))
per_dev = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
              for x in jax.tree_util.tree_leaves(params))
total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
rows = dmesh.sharding(mesh, ("batch", None), (1, 2200))
_, fn = sampler.decoder_for(cfg, sampler.decode_config_for(cfg, block_size=1, threshold=1.0, max_new_tokens=64), mesh)
s = lambda d: jax.ShapeDtypeStruct((), d)
text = fn.lower(params, jax.ShapeDtypeStruct((1, 2200), jnp.int32, sharding=rows),
                jax.ShapeDtypeStruct((1,), jnp.int32, sharding=dmesh.sharding(mesh, ("batch",), (1,))),
                s(jnp.float32), s(jnp.float32), s(jnp.int32), s(jnp.float32),
                jax.ShapeDtypeStruct((2,), jnp.uint32), s(jnp.int32)).as_text()
main = text[text.index("func.func public @main"):]
main = main[:main.index("\n")]                      # the entry's signature: one sharding per argument
split = main.count('sdy.sharding<@mesh, [{"tensor"}, {}]>') + main.count('sdy.sharding<@mesh, [{}, {"tensor"}]>')
print("RESULT " + json.dumps({"per_dev": per_dev, "total": total, "sharded_args": split}))
"""


def test_qwen3_8b_lowers_with_tensor_8():
  res = _run_child(_LOWER_CHILD, 8)
  # Every matrix is split 8 ways (only the norms' scales are replicated): ~1/8 of 16.4 GB each.
  assert res["total"] / 8 <= res["per_dev"] < res["total"] / 8 * 1.001
  # 7 matrices per layer + the embedding and LM head enter the program split over the 8 devices.
  assert res["sharded_args"] == 7 * 36 + 2


# The program a GPU compiles (a compile-only target: dgr2_jax/aot/targets.py): Qwen3's vocabulary at
# a tiny width, the tables split over the vocabulary on tensor. A decode loop body that all-gathers a
# vocabulary-sized array moves the whole table every step (Qwen3-8B's input embedding: 1.2 GB); the
# lookup must run vocabulary-parallel (a masked local gather and an all-reduce of the rows). Needs
# the compilers of `pip install -e ".[aot]"`; skips without them.
@pytest.mark.parametrize("target,tensor", [("h100x2", 2), ("v5e-4", 4)])
def test_no_vocabulary_gather_in_tensor_parallel_decode_loops(target, tensor):
  import jax
  import jax.numpy as jnp
  from dgr2_jax.aot import hlo, targets
  from dgr2_jax.decode import sampler
  from dgr2_jax.model import qwen3
  from dgr2_jax.model.config import Qwen3Config
  backend = targets.resolve(target).backend
  if not targets.available(backend):
    pytest.skip(f"no {backend.upper()} compiler here: {targets.AOT_EXTRA} installs it")
  sd = jax.ShapeDtypeStruct
  vocab = 151936
  for tied, block in ((False, 1), (True, 1), (False, 4)):   # AR (untied, tied input embedding), diffusion
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=16, tie_word_embeddings=tied,
                      dtype="bfloat16", param_dtype="bfloat16", mask_token_id=vocab - 1, eos_token_id=0,
                      pad_token_id=0)
    with targets.compile_for(target):
      mesh = dmesh.make_mesh(1, tensor)
      shapes = qwen3.param_shapes(cfg)
      params = jax.tree_util.tree_map(lambda x, s: sd(x.shape, x.dtype, sharding=s), shapes,
                                      dmesh.param_shardings(mesh, shapes))
      dc = sampler.decode_config_for(cfg, block_size=block, threshold=0.9 if block > 1 else 1.0, max_new_tokens=16)
      prog = hlo.compile_program(sampler.decoder_for(cfg, dc, mesh)[1], params,
                                 sd((1, 64), jnp.int32, sharding=dmesh.sharding(mesh, ("batch", None), (1, 64))),
                                 sd((1,), jnp.int32, sharding=dmesh.sharding(mesh, ("batch",), (1,))),
                                 sd((), jnp.float32), sd((), jnp.float32), sd((), jnp.int32), sd((), jnp.float32),
                                 sd((2,), jnp.uint32), sd((), jnp.int32), name=f"block {block}, tied {tied}")
    assert prog.platform == backend and prog.devices == tensor and prog.loops()
    looped = [c for c in prog.collectives if c.in_loop]
    gathers = [(c.shape, c.bytes) for c in looped if c.op == "all-gather" and str(vocab) in re.findall(r"\d+", c.shape)]
    assert not gathers, (prog.name, gathers)
    # The rows a step looks up are summed over the vocabulary shards: a few KB, not the table.
    assert any(c.op == "all-reduce" for c in looped) and max(c.bytes for c in looped) < 2**20, (prog.name, looped)
