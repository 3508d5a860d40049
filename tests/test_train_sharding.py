"""Sharded train step on 8 simulated CPU devices == the single-device step (loss and params).

Runs in a subprocess: XLA_FLAGS must set the CPU device count before jax initialises.
"""

import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np, ml_collections
from dgr2_jax.model import qwen3
from dgr2_jax.model.config import Qwen3Config
from dgr2_jax.train import config as tcl, loop, losses, mesh as mesh_lib, optim, synthetic
assert jax.device_count() == 8, jax.devices()
cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
tc = tcl.train_config()
tc.optimizer.warmup_steps = 1; tc.optimizer.peak_lr = 1e-2; tc.optimizer.weight_decay = 0.1
rules = tuple(tc.logical_axis_rules)
opt, sched = optim.make_optimizer(tc.optimizer, 10)
params = jax.device_get(jax.jit(lambda r: qwen3.init_params(cfg, r))(jax.random.PRNGKey(0)))
it = synthetic.SyntheticSFTIterator(8, 5, 9, cfg.vocab_size, seed=11)
batches = [it.batch(i) for i in range(3)]
loss_fn = lambda p, b, r: losses.sft_loss(cfg, p, b, reasoning_weight=0.5, answer_weight=1.5)
spec = lambda s: [list(x) if isinstance(x, tuple) else x for x in s]
out = {}
for name, shape, ndev in [("1x1x1", (1, 1, 1), 1), ("8x1x1", (8, 1, 1), 8), ("2x4x1", (2, 4, 1), 8),
                          ("2x2x2", (2, 2, 2), 8)]:
  mesh = mesh_lib.make_mesh(dict(zip(mesh_lib.AXES, shape)), jax.devices()[:ndev])
  shapes, sh = loop.state_shardings(params, opt, mesh, rules)
  state = loop.init_state(params, opt, sh, 0, jnp.float32)
  b_sh = mesh_lib.batch_sharding(mesh, rules, 8)
  step = jax.jit(loop.make_train_step(loss_fn, opt, sched, 1), in_shardings=(sh, b_sh),
                 out_shardings=(sh, None), donate_argnums=(0,))
  losses_ = []
  for b in batches:
    state, m = step(state, mesh_lib.shard_batch(b, b_sh, 8))
    losses_.append(float(m["loss"]))
  p = state["params"]
  mu = state["opt_state"][1][0].mu  # adamw's ScaleByAdamState inside the masked/chain state
  out[name] = {
      "loss": losses_,
      "params": {jax.tree_util.keystr(k): np.asarray(v).tolist()
                 for k, v in jax.tree_util.tree_leaves_with_path(jax.device_get(p))},
      "spec_q": spec(p["layers_0"]["self_attn"]["q_proj"]["kernel"].sharding.spec),
      "spec_embed": spec(p["embed_tokens"]["embedding"].sharding.spec),
      "spec_mu_q": spec(mu["layers_0"]["self_attn"]["q_proj"]["kernel"].sharding.spec),
      "n_shards_q": len({d.id for d in p["layers_0"]["self_attn"]["q_proj"]["kernel"].sharding.device_set}),
  }
# The divisibility rule: 'embed' of size 6 cannot split over fsdp=4 -> replicated.
mesh = mesh_lib.make_mesh(dict(data=2, fsdp=4, tensor=1), jax.devices())
out["spec_indivisible"] = spec(mesh_lib.logical_to_spec(("embed", "mlp"), (6, 64), mesh, rules))
out["spec_batch_2x2x2"] = spec(mesh_lib.batch_sharding(mesh_lib.make_mesh(dict(data=2, fsdp=2, tensor=2)), rules,
                                                      8).spec)
print("RESULT" + json.dumps(out))
"""

_OUT = None


def _run():
  global _OUT
  if _OUT is None:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
    proc = subprocess.run([sys.executable, "-c", _CHILD, REPO_ROOT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _OUT = json.loads(proc.stdout.split("RESULT", 1)[1])
  return _OUT


def test_sharded_steps_equal_single_device():
  import numpy as np  # pylint: disable=import-outside-toplevel
  out = _run()
  ref = out["1x1x1"]
  for name in ("8x1x1", "2x4x1", "2x2x2"):
    np.testing.assert_allclose(out[name]["loss"], ref["loss"], rtol=1e-5, err_msg=name)
    assert out[name]["params"].keys() == ref["params"].keys()
    for k, v in ref["params"].items():
      np.testing.assert_allclose(np.asarray(out[name]["params"][k]), np.asarray(v), atol=1e-5,
                                 err_msg=f"{name} {k}")
  assert ref["loss"][0] != ref["loss"][-1]  # params were updated between steps


def test_params_and_opt_state_are_actually_sharded():
  out = _run()
  assert out["2x2x2"]["spec_q"] == ["fsdp", "tensor"]
  assert out["2x2x2"]["spec_mu_q"] == out["2x2x2"]["spec_q"]
  assert out["2x2x2"]["n_shards_q"] == 8
  assert out["2x4x1"]["spec_embed"] == [None, "fsdp"]  # [vocab, embed]: embed over fsdp=4
  assert out["8x1x1"]["spec_q"] == [None, None]  # pure data parallel: params replicated
  assert out["spec_indivisible"] == [None, None]  # 6 % 4 != 0 -> replicated
  assert out["spec_batch_2x2x2"] == [["data", "fsdp"]]
