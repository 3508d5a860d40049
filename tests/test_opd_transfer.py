"""benchmarks/opd_transfer.py: the curve is plain Adam on the train batch alone, measured on both
batches at the steps it names (a plain-Python loop as the reference)."""

import os
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import opd_transfer  # noqa: E402


def test_curve_is_adam_on_the_train_batch_alone():
  def loss_fn(p, b, rng, frozen):
    del rng
    assert frozen == "teacher"
    return jnp.sum((p["w"] - b["target"]) ** 2), {"choice_kl": jnp.sum(p["w"] - b["target"])}
  d = types.SimpleNamespace(params={"w": jnp.zeros(3)}, loss_fn=loss_fn, frozen="teacher")
  train, held = {"target": jnp.array([1.0, 2.0, 3.0])}, {"target": jnp.array([1.0, -2.0, 0.0])}
  out = opd_transfer.curve(d, train, held, lr=0.1, steps=7, every=3)
  assert [r["step"] for r in out] == [0, 3, 6, 7]
  # Reference: Adam (b1 0.9, b2 0.999, eps 1e-8) by hand, on the train target only.
  w, m, v, ref = np.zeros(3), np.zeros(3), np.zeros(3), {}
  for s in range(8):
    ref[s] = (((w - [1, 2, 3]) ** 2).sum(), ((w - [1, -2, 0]) ** 2).sum())
    g = 2 * (w - np.array([1.0, 2.0, 3.0]))
    m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
    w = w - 0.1 * (m / (1 - 0.9 ** (s + 1))) / (np.sqrt(v / (1 - 0.999 ** (s + 1))) + 1e-8)
  for r in out:
    np.testing.assert_allclose([r["train_loss"], r["heldout_loss"]], ref[r["step"]], rtol=1e-5)
    assert set(r) == {"step", "train_loss", "heldout_loss", "train_choice_kl", "heldout_choice_kl"}
  assert out[-1]["train_loss"] < out[0]["train_loss"]   # the train batch is fitted


def test_render_writes_the_marked_table(tmp_path):
  record = {"name": "demo", "commit": "abc1234", "command": "python benchmarks/opd_transfer.py --workdir=WORKDIR",
            "machine": {"cpu_model": "X", "cpu_isa": "avx2"}, "cores": 2, "lr": 1e-4, "divergence": "forward",
            "choice_weight": 10.0, "heldout_rows": 64,
            "curves": {"64": [{"step": 0, "train_loss": 0.2, "heldout_loss": 0.1},
                              {"step": 5, "train_loss": 0.1, "heldout_loss": 0.09},
                              {"step": 10, "train_loss": 0.05, "heldout_loss": 0.11}]}}
  doc = tmp_path / "r.md"
  doc.write_text("a\n<!-- opd-transfer-table:demo -->\nold\n<!-- /opd-transfer-table:demo -->\nb\n")
  opd_transfer.write_docs(record, str(doc), "x.json")
  text = doc.read_text()
  assert "\nold\n" not in text and "Commit `abc1234`" in text
  assert "| 64 | 0.2000 -> 0.0500 (-75%) | 0.1000 | 0.0900 (5) | 0.1100 | -10.0% |" in text
  doc.write_text("no markers\n")
  with pytest.raises(SystemExit, match="opd-transfer-table:demo"):
    opd_transfer.write_docs(record, str(doc), "x.json")
