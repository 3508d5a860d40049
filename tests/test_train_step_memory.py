"""What holds a training step's memory down, and the benchmark that measures it.

* OPD's frozen teacher in the compute dtype (`opd.frozen_teacher`) gives the same loss and grads,
  bit for bit, as its f32 master weights.
* The 'cudnn' multi-stream route (XLA's kernel on CPU) puts the replay segments in groups of at
  most one per block: equal to one call over all segments, and XLA plans less memory for it.
* The dry run's `step_bytes` is the plan's training step, and `benchmarks/train_step.py` writes
  one row per (loss, remat policy) with XLA's plan, the dry run's plan and the dtypes it ran in.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgr2_jax.model import attention, qwen3, streams
from dgr2_jax.model.config import Qwen3Config
from dgr2_jax.train import dry_run, opd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import train_step  # noqa: E402


def test_frozen_teacher_in_compute_dtype_is_exact():
  # logits in chunks of 24 positions, as Qwen3's vocabulary would have them (the teacher's too)
  mc = Qwen3Config(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                   dtype="bfloat16", param_dtype="float32", attention_impl="xla", mask_token_id=1023,
                   logits_chunk=24)
  b, p, r, bs = 2, 8, 32, 16
  _, batch, _, _ = train_step.make_case("opd", mc, b, p, r)
  batch = dict(batch, seg_tokens=batch["seg_tokens"][:, : r // bs * 2, :bs])
  batch["pred_seg"] = np.tile((np.arange(r) // bs * 2 + np.arange(r) % 2)[None], (b, 1)).astype(np.int32)
  init = jax.jit(lambda key: qwen3.init_params(mc, key))
  student, teacher = init(jax.random.PRNGKey(0)), init(jax.random.PRNGKey(1))
  frozen = opd.frozen_teacher(mc, teacher)
  assert {x.dtype for x in jax.tree_util.tree_leaves(frozen)} == {jnp.dtype(jnp.bfloat16)}
  loss = lambda s, t: opd.opd_loss(mc.as_block_diffusion(bs, 1023), s, batch, None, t, block_size=bs,
                                   teacher_cache="none", teacher_config=mc)[0]
  grad = jax.jit(jax.value_and_grad(loss))
  (l32, g32), (l16, g16) = grad(student, teacher), grad(student, frozen)
  assert float(l32) > 0
  np.testing.assert_array_equal(np.asarray(l16), np.asarray(l32))
  for a, c in zip(jax.tree_util.tree_leaves(g16), jax.tree_util.tree_leaves(g32)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_segment_groups():
  assert attention._segment_groups(192, 48) == 4   # OPD's 4 canvases per block: 4 calls of 48
  assert attention._segment_groups(48, 48) == 1    # CFT: one call, as before
  assert attention._segment_groups(6, 4) == 2 and attention._segment_groups(7, 4) == 7


def _stream_case(cap):
  b, p, r, bs, k, g, d = 2, 16, 64, 8, 2, 2, 16
  nb = r // bs
  seg_block = np.repeat(np.arange(nb), cap)
  n = p + r + len(seg_block) * bs
  spec = streams.stream_ranges(np.array([16, 9]), p, r, bs, seg_block)
  rs = np.random.RandomState(0)
  q = jnp.asarray(rs.randn(b, n, k, g, d), jnp.float32)
  kv = [jnp.asarray(rs.randn(b, n, k, d), jnp.float32) for _ in range(2)]
  w = jnp.asarray(rs.randn(b, n, k, g, d), jnp.float32)
  return spec, (q, *kv), w


def test_cudnn_streams_groups_equal_one_call_and_plan_less_memory(monkeypatch):
  monkeypatch.setattr(attention, "DPA_IMPLEMENTATION", None)  # XLA's kernel on CPU, the same calls
  spec, qkv, w = _stream_case(cap=4)                            # 32 segments over 8 blocks
  f = lambda q, k, v: jnp.sum(attention.attend(q, k, v, spec, "cudnn") * w)
  grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
  val, g = grad(*qkv)
  temp = grad.lower(*qkv).compile().memory_analysis().temp_size_in_bytes
  monkeypatch.setattr(attention, "_segment_groups", lambda s, most: 1)
  grad1 = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
  val1, g1 = grad1(*qkv)
  temp1 = grad1.lower(*qkv).compile().memory_analysis().temp_size_in_bytes
  np.testing.assert_allclose(np.asarray(val), np.asarray(val1), rtol=1e-5)
  for a, c in zip(g, g1):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=1e-5)
  assert temp < 0.6 * temp1, (temp, temp1)  # the segments' copies of the context: a quarter alive


def test_step_bytes_is_the_plans_training_step():
  c = train_step.plan_config(train_step.parse_args(["--preset=0p6b_like"]))
  mc = train_step.model_config(train_step.PRESETS["0p6b_like"], "bfloat16", "nothing_saveable", "auto", True)
  row = dry_run.step_bytes(c, mc, "opd", 1)
  n = qwen3.count_params(qwen3.param_shapes(mc))
  assert row["params"] == 4 * n and row["frozen_teacher"] == 2 * n  # f32 master weights, bf16 teacher
  assert row["train_step"] == (row["params"] + row["optimizer"] + row["gradients"] + row["accumulator"]
                               + row["frozen_teacher"] + row["total"])
  assert row["sequence"] == 512 + 1536 + 1536 // 32 * train_step.CANVASES * 32 and row["rows_per_device"] == 8
  assert dry_run.step_bytes(c, mc, "cft", 1)["frozen_teacher"] == 0
  c.opd.teacher_cache = "full"  # a teacher that fills a cache stays as loaded (f32)
  assert dry_run.step_bytes(c, mc, "opd", 1)["frozen_teacher"] == 4 * n


def test_benchmark_rows_per_remat_policy(tmp_path):
  out = tmp_path / "rows.json"
  rows = train_step.main(["--losses=sft", "--remat_policies=none,nothing_saveable", "--batch=2", "--prompt=16",
                          "--response=32", "--steps=1", "--warmup=0", "--isolate=false", f"--json_out={out}"])
  data = json.loads(out.read_text())
  assert data["rows"] == json.loads(json.dumps(rows)) and data["jax_version"] == jax.__version__
  assert [r["remat_policy"] for r in rows] == ["none", "nothing_saveable"]
  for r in rows:
    assert r["step_ms"] > 0 and np.isfinite(r["final_loss"]) and r["device"] and r["git_commit"]
    assert r["master_dtypes"] == r["opt_state_dtypes"] == ["float32"] and r["compute_dtype"] == "float32"  # tiny
    assert r["xla_planned_gib"] > 0 and r["plan_gib"] > 0 and r["peak_source"] == "planned"
    assert r["peak_gib"] == r["xla_planned_gib"] and r["plan_over_peak"] == r["plan_gib"] / r["peak_gib"]
    assert set(r["dot_operand_dtypes"]) == {"f32"}
  with pytest.raises(SystemExit):
    train_step.parse_args(["--remat_policies=everything"])


def test_benchmark_isolated_row_and_help(tmp_path, capsys):
  with pytest.raises(SystemExit):
    train_step.parse_args(["--help"])
  out = capsys.readouterr().out
  assert "--remat_policies" in out and "1p7b_like" in out and "--json_out" in out
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = lambda *a: subprocess.run([sys.executable, "benchmarks/train_step.py", *a], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=300)
  r = run("--losses=opd", "--batch=2", "--prompt=16", "--response=32", "--compile_only", "--isolate=true",
          "--remat_policies=dots_saveable", "--dtype=bfloat16", f"--json_out={tmp_path / 'rows.json'}")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "| opd | True | dots_saveable | 2 | 48 |" in r.stdout
  row = json.loads((tmp_path / "rows.json").read_text())["rows"][0]
  assert row["master_dtypes"] == row["opt_state_dtypes"] == ["float32"] and row["teacher_dtypes"] == ["bfloat16"]
  assert row["dot_operand_dtypes"]["bf16"] > 0 and row["compute_dtype"] == "bfloat16"
