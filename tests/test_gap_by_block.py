"""benchmarks/gap_by_block.py: an AR response continued after its own first tokens is the response
itself (the swap changes who writes, nothing else); another writer's head is kept and continued by
the writer's own decoding of prompt + head."""

import dataclasses
import os
import sys

import jax
import numpy as np
import pytest

from dgr2_jax.decode import sampler
from dgr2_jax.model import qwen3

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import gap_by_block  # noqa: E402

PROMPTS = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [21, 22, 23], [30, 31, 32, 33]]
R, EOS = 16, 5


def _writer(cfg, params, bs, tau):
  dc = sampler.DecodeConfig(block_size=bs, threshold=tau, temperature=0.0, max_new_tokens=R, eos_ids=(EOS,),
                            mask_token_id=63, pad_id=0)
  return gap_by_block.Writer(cfg if bs == 1 else cfg.as_block_diffusion(bs, 63), params, dc)


def _through_eos(row):
  row = [int(t) for t in row]
  return tuple(row[:row.index(EOS) + 1] if EOS in row else row)


@pytest.mark.parametrize("b", [4, 8])
def test_an_ar_response_continued_after_its_own_head_is_itself(tiny_lm, b):
  cfg, params = tiny_lm
  w = _writer(cfg, params, 1, 1.0)
  toks, lens = sampler.left_pad(PROMPTS, 9, 0)
  own = gap_by_block.respond(w, toks, lens)
  again = gap_by_block.continue_after(w, toks, lens, own[:, :b])
  rows = [i for i in range(len(PROMPTS)) if EOS not in own[i, :b]]
  assert len(rows) >= 2   # the check is not vacuous
  for i in rows:
    assert _through_eos(again[i]) == _through_eos(own[i]), i


def test_the_cells_of_one_ar_model_are_its_own_response(tiny_lm):
  cfg, params = tiny_lm
  w = _writer(cfg, params, 1, 1.0)
  toks, lens = sampler.left_pad(PROMPTS, 9, 0)
  prompts = {"prompt_ids": toks, "prompt_len": lens}
  cells = gap_by_block.split_gap(w, w, prompts, 4, lambda t: [_through_eos(r) for r in t])
  assert set(cells) == {"teacher/teacher", "student/student", "teacher/student", "student/teacher",
                        "student/student (re-read)"}
  for v in cells.values():
    assert v == cells["teacher/teacher"]


def test_another_models_head_is_kept_and_continued(tiny_lm):
  cfg, params = tiny_lm
  other = jax.tree_util.tree_map(lambda x: x * 8 if x.ndim == 2 else x, qwen3.init_params(cfg, jax.random.PRNGKey(2)))
  a, b = _writer(cfg, params, 1, 1.0), _writer(cfg, other, 4, 0.5)
  toks, lens = sampler.left_pad(PROMPTS, 9, 0)
  head = gap_by_block.respond(a, toks, lens)[:, :4]
  out = gap_by_block.continue_after(b, toks, lens, head)
  np.testing.assert_array_equal(out[:, :4], head)
  # The continuation is b's own decoding of prompt + head, nothing of a's beyond the head.
  full = [list(p) + list(h) for p, h in zip(PROMPTS, head)]
  ids, ls = sampler.left_pad(full, 13, 0)
  short = dataclasses.replace(b, decode=dataclasses.replace(b.decode, max_new_tokens=R - 4))
  tail = gap_by_block.respond(short, ids, ls)
  np.testing.assert_array_equal(out[:, 4:], tail)


def test_a_head_off_the_block_grid_is_refused(tiny_lm):
  cfg, params = tiny_lm
  w = _writer(cfg, params, 4, 0.5)
  toks, lens = sampler.left_pad(PROMPTS, 9, 0)
  with pytest.raises(ValueError, match="multiple of the block size"):
    gap_by_block.continue_after(w, toks, lens, np.zeros((len(PROMPTS), 6), np.int32))


def test_the_tables_go_between_the_docs_markers_and_a_missing_pair_is_one_line(tmp_path):
  row = {"recall@1": 0.3, "valid_rate": 0.99, "vs_teacher": -0.01, "vs_teacher_ci95": [-0.02, 0.0],
         "first_pick_as_teacher": 0.96}
  record = {"command": "python benchmarks/gap_by_block.py --workdir=WORKDIR", "commit": "abc1234", "name": "demo",
            "machine": {"cpu_model": "X", "cpu_isa": "avx2"}, "cores": 2, "split": "valid", "n": 10,
            "reasoning_tokens": 32, "stages": {"cft": {"teacher/teacher": row, "student/student": row}}}
  doc = tmp_path / "doc.md"
  doc.write_text("before\n<!-- gap-by-block-table:demo -->\nold\n<!-- /gap-by-block-table:demo -->\nafter\n")
  gap_by_block.write_docs(record, str(doc), "r.json")
  text = doc.read_text()
  assert text.startswith("before\n") and text.endswith("<!-- /gap-by-block-table:demo -->\nafter\n")
  assert "old" not in text and "Commit `abc1234`" in text and "JSON: `r.json`" in text
  assert "| student/student | 0.3000 | -0.0100 [-0.0200, +0.0000] | 0.990 | 0.960 |" in text
  doc.write_text("no markers\n")
  with pytest.raises(SystemExit, match="gap-by-block-table:demo"):
    gap_by_block.write_docs(record, str(doc), "r.json")
