"""Several processes compute what one process computes (Tier 1: the training core).

A tiny Qwen3 on a mesh of data 2 x fsdp 2 (so the parameters really span the processes), trained by
the shared loop through `tests/mp_train_worker.py`, launched with `launch/local_multi_process.sh`
(tests/multiprocess_harness.py): 2 processes x 2 CPU devices against 1 process x 4 devices give the
same per-step losses and final parameters (1e-5); a run killed after step 2 and started again ends
where the uninterrupted run ends; the model directory written by both processes reads back equal;
a resume under another process count is refused with one line naming both counts.
"""

import os
import sys

import numpy as np
import pytest

import multiprocess_harness as mph

WORKER = [sys.executable, "tests/mp_train_worker.py"]


def params(npz) -> dict:
  return {k: npz[k] for k in npz.files if k.startswith("param/")}


def assert_close(a: dict, b: dict, tol: float):
  assert sorted(a) == sorted(b)
  worst = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
  assert worst <= tol, f"parameters differ by {worst}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """{name: npz} of the 1 x 4 run, the 2 x 2 run, and the 2 x 2 run killed at step 3 then resumed
  (plus the killed run's workdir and its process output)."""
  d = tmp_path_factory.mktemp("mp")
  out = {}
  for name, n, k in (("1x4", 1, 4), ("2x2", 2, 2)):
    mph.check(mph.launch(n, k, WORKER + [f"--workdir={d / name}", f"--out={d / name}.npz"]))
    out[name] = np.load(f"{d / name}.npz")
  killed = mph.launch(2, 2, WORKER + [f"--workdir={d / 'resumed'}", "--kill_at=3"])
  out["killed"] = killed
  # The killed run left steps 1-2 committed; copy the workdir before resuming it (the refusal test
  # needs a checkpoint written by 2 processes that is not final).
  import shutil
  shutil.copytree(d / "resumed", d / "killed_copy")
  mph.check(mph.launch(2, 2, WORKER + [f"--workdir={d / 'resumed'}", f"--out={d / 'resumed'}.npz"]))
  out["resumed"] = np.load(f"{d / 'resumed'}.npz")
  out["killed_dir"] = d / "killed_copy"
  return out


def test_two_processes_equal_one(runs):
  one, two = runs["1x4"], runs["2x2"]
  assert int(one["processes"]) == 1 and int(two["processes"]) == 2
  assert bool(two["spans"]), "fsdp=2 over 2 processes: some parameter must span both"
  assert len(one["loss"]) == len(two["loss"]) == 4
  np.testing.assert_allclose(two["loss"], one["loss"], atol=1e-5, rtol=0)
  assert not np.allclose(one["loss"][0], one["loss"][-1]), "the model must move (lr too small?)"
  assert_close(params(two), params(one), 1e-5)


def test_kill_and_resume_is_exact(runs):
  assert runs["killed"].returncode == 3, runs["killed"].stderr[-3000:]
  ckpts = sorted(os.listdir(runs["killed_dir"] / "train" / "checkpoints"))
  assert ckpts[-1] == "2", ckpts
  res, full = runs["resumed"], runs["2x2"]
  np.testing.assert_allclose(res["loss"], full["loss"], atol=1e-6, rtol=0)
  assert_close(params(res), params(full), 1e-6)


def test_model_dir_round_trip(runs):
  for name in ("1x4", "2x2"):
    assert float(runs[name]["roundtrip"]) == 0.0, name
  assert bool(runs["2x2"]["loaded_spans"]), "2 processes: the model dir is read into shardings spanning both"


def test_resume_under_another_process_count_refused(runs):
  res = mph.launch(1, 4, WORKER + [f"--workdir={runs['killed_dir']}"])
  assert res.returncode != 0
  lines = [l for l in (res.stdout + res.stderr).splitlines() if "was written by 2 process(es)" in l]
  assert lines, res.stderr[-3000:]
  assert "this run has 1" in lines[-1] and "checkpoints/2" in lines[-1], lines[-1]


def test_launch_variables():
  from dgr2_jax import multihost
  kw = multihost.launch_kwargs
  assert kw({}) is None
  # A lone python inside a multi-task SLURM allocation (no srun step of several tasks): one process.
  assert kw({"SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"}) is None
  assert kw({"SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "1"}) is None
  assert kw({"SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8"}) == {}
  assert kw({"TPU_WORKER_HOSTNAMES": "a"}) is None and kw({"TPU_WORKER_HOSTNAMES": "a,b"}) == {}
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
  assert kw(env) == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
  assert kw({**env, "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}) is None
  with pytest.raises(ValueError, match="JAX_PROCESS_ID"):
    kw({k: v for k, v in env.items() if k != "JAX_PROCESS_ID"})
  with pytest.raises(ValueError, match="0 <= id < count"):
    kw({**env, "JAX_PROCESS_ID": "4"})


def test_launcher_runs_nothing_from_path(foreign_path):
  """With a `python` and `python3` first on PATH that fail (a venv's tests, no venv activated), the
  harness and launch/local_multi_process.sh still find a free port and start both processes under
  the interpreter running the tests."""
  code = ("import os, dgr2_jax; a = os.environ['JAX_COORDINATOR_ADDRESS']; "
          "assert a.rsplit(':', 1)[1].isdigit(), a")
  mph.check(mph.launch(2, 1, [sys.executable, "-c", code], env={"PATH": foreign_path}, timeout=120))


def test_batch_sizes_checked():
  import ml_collections
  from dgr2_jax.train import mesh as mesh_lib
  m = ml_collections.ConfigDict({"data": -1, "fsdp": 2, "tensor": 1})
  mesh_lib.check_batch_size(8, m, 4, 2)
  with pytest.raises(ValueError, match=r"^train.batch_size \(6\) must be divisible by the process count \(4\)$"):
    mesh_lib.check_batch_size(6, m, 8, 4)
  with pytest.raises(ValueError, match=r"train.mesh data x fsdp \(2 x 2 = 4 on 4 devices\)"):
    mesh_lib.check_batch_size(6, m, 4, 2)
  with pytest.raises(ValueError, match=r"train.grad_accum_steps \(4\)"):
    mesh_lib.check_batch_size(8, m, 8, 1, grad_accum_steps=2)


def test_data_order_independent_of_process_count():
  from dgr2_jax.task import pipeline
  arrays = {"x": np.arange(30)}
  one = [next(it)["x"] for it in [pipeline.make_iterator(arrays, 8, seed=3)] for _ in range(6)]
  for count in (2, 4):
    its = [pipeline.make_iterator(arrays, 8, seed=3, process=(i, count)) for i in range(count)]
    for step in range(6):
      parts = [next(it)["x"] for it in its]
      assert all(len(p) == 8 // count for p in parts)
      np.testing.assert_array_equal(np.concatenate(parts), one[step])
  with pytest.raises(ValueError, match=r"^prompts_per_step \(8\) must be divisible by the process count \(3\)$"):
    pipeline.make_iterator(arrays, 8, seed=3, process=(0, 3), field="prompts_per_step")
