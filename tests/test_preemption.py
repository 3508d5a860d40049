"""Preemption-safe training (dgr2_jax/train/preemption.py): SIGTERM in the middle of a training stage
saves the step in flight on every process, the process exits with status 75, and running the same
command again ends with the parameters of an uninterrupted run, bit for bit, recomputing no step.
A second SIGTERM while that save is written changes nothing. The time cadence saves by the clock.

The runs are tests/mp_preempt_worker.py's tiny SFT and RL stages (RL: dynamic sampling and a
keep_best validation curve, whose kept point must survive the resume too): in this process for one
process (the worker's hook sends this process SIGTERM at step 3), and through
launch/local_multi_process.sh for two, one run signalled from outside (the whole process group, as
a scheduler signals every task), one by process 1 alone.
"""

import json
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import mp_preempt_worker as toy
import multiprocess_harness as mph
from dgr2_jax.train import checkpoint as ckpt_lib
from dgr2_jax.train import preemption

WORKER = [sys.executable, "tests/mp_preempt_worker.py"]
GRACE_S = 60   # from the signal to the exit of every process (CPU, a machine shared with others)


def _steps(workdir) -> list[int]:
  """The steps in metrics.jsonl (one record per step): the steps the run computed."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line)["step"] for line in f if line.endswith("\n") and line.strip()]


def _checkpoints(workdir) -> list[str]:
  return sorted(os.listdir(os.path.join(workdir, "checkpoints")))


def _assert_equal(got: dict, want: dict):
  assert sorted(got) == sorted(want) and len(want) > 5
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("stage, again", [("sft", True), ("rl", False)])
def test_one_process(tmp_path, stage, again):
  """SIGTERM in step 3 (and with `again` once more while step 3's save is written): step 3 is saved,
  the run stops with status 75 and the handler is gone; the rerun computes steps 4-6 only and ends
  where an uninterrupted run ends (RL: the same curve and kept point)."""
  steps, run = toy.STEPS[stage], str(tmp_path / "run")
  base = toy.RUNS[stage](str(tmp_path / "base"), steps)
  before, computed = signal.getsignal(signal.SIGTERM), []
  with pytest.raises(preemption.Preempted) as e:
    toy.RUNS[stage](run, steps, toy.signal_hook(3, again=again, computed=computed))
  assert e.value.code == preemption.EXIT_STATUS == 75 and e.value.step == 3
  assert signal.getsignal(signal.SIGTERM) == before   # installed for the training only
  assert computed == _steps(run) == [1, 2, 3]
  assert _checkpoints(run) == ["3"]   # the step in flight; no temporary directory left
  state, _, extra = ckpt_lib.restore(ckpt_lib.make_manager(run, 2), 3)
  assert int(state["step"]) == 3 and ("validation" in extra) == (stage == "rl")
  computed.clear()
  resumed = toy.RUNS[stage](run, steps, toy.signal_hook(0, computed=computed))
  assert computed == [4, 5, 6]   # recomputed: none
  _assert_equal(toy.flat_params(resumed), toy.flat_params(base))
  if stage == "rl":
    assert resumed["valid_curve"] == base["valid_curve"] and resumed["best_step"] == base["best_step"]


def test_time_cadence(tmp_path, monkeypatch):
  """checkpoint_every_minutes 1 with 25 s a step (a moved clock): saves at steps 3 and 6 (and the
  last), beside checkpoint_every 100; 0 saves the last step only."""
  now = [0.0]
  monkeypatch.setattr(preemption, "_now", lambda: now[0])

  def tick(step):
    del step
    now[0] += 25.0
  toy.sft(str(tmp_path / "timed"), 7, tick, checkpoint_every_minutes=1.0, keep_checkpoints=5)
  assert _checkpoints(tmp_path / "timed") == ["3", "6", "7"]
  toy.sft(str(tmp_path / "off"), 7, tick, keep_checkpoints=5)
  assert _checkpoints(tmp_path / "off") == ["7"]


def _preempted_then_resumed(tmp_path, stage: str, steps: int, flags: list[str], on_start=None):
  """Launch 1 (2 processes): the preempted run, exit 75 within GRACE_S of the signal, its last
  computed step saved. Launch 2: the same command resumes it, then trains a baseline uninterrupted.
  -> (the saved step, launch 2's npz)."""
  run, base, out = tmp_path / "run", tmp_path / "base", tmp_path / "out.npz"
  cmd = WORKER + [f"--stage={stage}", f"--workdir={run}", f"--steps={steps}"]
  first = mph.launch(2, 1, cmd + flags, on_start=on_start, timeout=400)
  sent = getattr(on_start, "sent", None) or float(open(f"{run}.signalled").read())
  assert first.returncode == 75, f"exit {first.returncode}\n{first.stdout[-3000:]}\n{first.stderr[-5000:]}"
  assert time.time() - sent < GRACE_S
  saved = int(_checkpoints(run)[-1])
  assert _steps(run)[-1] == saved and 2 <= saved < steps, (_steps(run), _checkpoints(run))
  assert f"step {saved} is saved" in first.stdout
  mph.check(mph.launch(2, 1, cmd + [f"--baseline={base}", f"--out={out}"], timeout=400))
  res = np.load(out)
  assert int(res["processes"]) == 2
  assert res["computed"].tolist() == list(range(saved + 1, steps + 1))   # recomputed: none
  _assert_equal({k[6:]: res[k] for k in res.files if k.startswith("param/")},
                {k[5:]: res[k] for k in res.files if k.startswith("base/")})
  return saved, res


def test_two_processes_sft_signalled_from_outside(tmp_path):
  """SIGTERM to the launcher's process group once step 2 is logged (every process gets it, and the
  launcher passes one more on): both processes save the same step and exit 75."""
  run = tmp_path / "run"

  def signal_at_step_2(p):
    def watch():
      while p.poll() is None and len(_steps(run)) < 2:
        time.sleep(0.05)
      signal_at_step_2.sent = time.time()
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
    threading.Thread(target=watch, daemon=True).start()
  _preempted_then_resumed(tmp_path, "sft", 8, ["--sleep=0.5"], on_start=signal_at_step_2)


def test_two_processes_rl_signal_on_one_and_again_during_the_save(tmp_path):
  """Process 1 alone gets SIGTERM in step 2, and again while the preemption step is being saved:
  JAX's preemption sync tells process 0, both save the same step and exit 75; the resumed run keeps
  the uninterrupted run's validation curve and point."""
  _, res = _preempted_then_resumed(tmp_path, "rl", 8, ["--sleep=0.5", "--signal_at=2", "--signal_process=1",
                                                       "--again"])
  np.testing.assert_array_equal(res["curve"], res["base_curve"])
  assert int(res["best_step"]) == int(res["base_best_step"])
