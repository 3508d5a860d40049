"""tools/ladder_table.py: the docs' ladders are what the recorded runs give (README command 1:
benchmarks/results/demo_ladder.json; the real-Beauty preset: beauty_ladder.json), and the generator
on a small fixture: a record made from a workdir's results, the intervals, the naive row's fallback
note, the paper's columns, the markers."""

import json
import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
import ladder_table  # noqa: E402


@pytest.mark.parametrize("name", sorted(ladder_table.LADDERS))
def test_the_docs_tables_are_what_the_recorded_runs_give(name, capsys):
  ladder = ladder_table.LADDERS[name]
  assert os.path.exists(ladder.record), f"{ladder.record} missing"
  assert ladder_table.main(["--check"]) == 0, capsys.readouterr().out
  with open(ladder.record) as f:
    rec = json.load(f)
  methods = [r["method"] for r in rec["rows"]]
  assert methods[0] == "pre_rank" and "ar" in methods and "cft_opd_rl" in methods and "rule_policy" in methods
  assert len(rec["commit"]) >= 7 and rec["command"] == ladder.command
  for doc in ladder_table.DOCS:
    with open(os.path.join(REPO_ROOT, doc)) as f:
      assert ladder.markers[0] in f.read(), f"{doc} has no {name} table"


def _fake_workdir(tmp_path):
  run = {"config_hash": "abc", "machine": {"cpu_count": 2}}
  rows = [dict(method="pre_rank", n=1024, valid_rate=1.0, mean_nfe=0.0, run=run, **{"recall@1": 0.25}),
          dict(method="rule_policy", n=1024, **{"recall@1": 0.3}, delta_floor=0.05,
               delta_floor_ci95=[0.03, 0.07], delta_teacher=0.01, delta_teacher_ci95=[-0.01, 0.02]),
          dict(method="ar", n=1024, valid_rate=1.0, mean_nfe=55.1, run=run, delta_floor=0.04,
               delta_floor_ci95=[0.02, 0.06], **{"recall@1": 0.29}),
          dict(method="naive", n=1024, valid_rate=0.0, fallback_rate=1.0, mean_nfe=15.0, run=run,
               delta_floor=0.0, delta_floor_ci95=[0.0, 0.0], delta_teacher=-0.04,
               delta_teacher_ci95=[-0.06, -0.02], **{"recall@1": 0.25})]
  os.makedirs(tmp_path / "results")
  (tmp_path / "results" / "accuracy.json").write_text(json.dumps(rows))
  (tmp_path / "results" / "stage_times.json").write_text(json.dumps(
      {"seconds": {"sft": 0.0, "eval": 30.0}, "built": {"sft": 300.0, "eval": 30.0}}))
  return str(tmp_path)


def test_a_record_renders_every_row_with_its_intervals(tmp_path):
  rec = ladder_table.record_run(_fake_workdir(tmp_path), "abc1234")
  assert rec["wall_s"] == 330.0 and rec["cores"] == 2 and rec["commit"] == "abc1234"
  table = ladder_table.render(rec)
  assert "commit abc1234" in table and "5 min 30 s of stages" in table and "n = 1,024" in table
  lines = [ln for ln in table.splitlines() if ln.startswith("| ")]
  assert len(lines) == 1 + 4  # header + rows
  assert "| rule: the trace policy on the prompt's marks | 0.3000 | +0.0500 [+0.0300, +0.0700] | " \
         "+0.0100 [-0.0100, +0.0200] | - | - |" in lines
  assert "0.2500 (all fall back)" in lines[4] and "| 15.0 |" in lines[4]
  assert "| **AR, GR2 teacher (SFT + RL, `ar`)** | 0.2900 | +0.0400 [+0.0200, +0.0600] | - | 1.000 | 55.1 |" in lines
  # The Beauty ladder adds the override diagnostics and the paper's Q1 numbers for the rows it has.
  beauty = ladder_table.LADDERS["beauty"]
  rec["rows"][2].update(override_rate=0.3, override_precision=0.28, policy_agreement=0.97)
  blines = [ln for ln in ladder_table.render(rec, beauty).splitlines() if ln.startswith("| ")]
  assert blines[0].endswith("| override rate / precision | policy agreement | paper: recall@1 | paper: valid |")
  assert blines[3].endswith("| 55.1 | 0.300 / 0.280 | 0.970 | 0.2960 | - |")
  assert blines[4].endswith("| - | - | 0.2811 | 0.001 |")   # naive: the paper's valid rate
  assert "Real Beauty ladder" in ladder_table.render(rec, beauty)


def test_the_table_goes_between_the_markers_only():
  begin, end = ladder_table.LADDERS["demo"].markers
  text = f"intro\n{begin}\nold table\n{end}\nafter\n"
  assert ladder_table.rewrite(text, "NEW") == f"intro\n{begin}\nNEW\n{end}\nafter\n"
  with pytest.raises(SystemExit, match="markers"):
    ladder_table.rewrite("no markers here", "NEW")
