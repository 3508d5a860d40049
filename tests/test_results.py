"""dgr2_jax/results.py: what a results file records of the machine that made it."""

import json
import os

from dgr2_jax import results


def test_cpu_info_names_the_widest_isa_and_only_the_cpu_flags(tmp_path, monkeypatch):
  """The CPU model, the widest vector ISA it has (of results.ISA_FLAGS, widest first) and the
  `--xla_cpu_*` flags: the GPU flags the project adds to XLA_FLAGS itself are left out."""
  fake = tmp_path / "cpuinfo"
  fake.write_text("processor\t: 0\nmodel name\t: Some CPU 9000\nflags\t\t: fpu sse4_2 avx fma avx2 aes\n\n"
                  "processor\t: 1\nmodel name\t: Some CPU 9000\nflags\t\t: fpu sse4_2 avx fma avx2 aes\n")
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_graph_min_graph_size=1 --xla_cpu_max_isa=AVX2 --xla_cpu_use_xnnpack=false")
  info = results.cpu_info(str(fake))
  assert info == {"cpu_model": "Some CPU 9000", "cpu_isa": "avx2", "cpu_flags": ["avx2", "fma", "avx", "sse4_2"],
                  "xla_flags": "--xla_cpu_max_isa=AVX2 --xla_cpu_use_xnnpack=false"}
  fake.write_text("model name\t: Old\nflags\t\t: fpu sse2\n")
  monkeypatch.delenv("XLA_FLAGS")
  assert results.cpu_info(str(fake)) == {"cpu_model": "Old", "cpu_isa": "unknown", "cpu_flags": [], "xla_flags": ""}


def test_config_stem_names_the_config_file_without_its_variants():
  assert results.config_stem(["--workdir=/w", "--config=configs/beauty_cpu.py:smoke"]) == "beauty_cpu"
  assert results.config_stem(["--config=/x/demo.py"]) == "demo"
  assert results.config_stem([], default="other") == "other"


def test_record_head_names_the_command_without_this_machines_paths(monkeypatch):
  """A benchmark record's command keeps every flag but this machine's workdir and data directory."""
  monkeypatch.setenv("GIT_COMMIT", "abc1234")
  head = results.record_head("benchmarks/x.py", ["--config=configs/beauty_cpu.py",
                                                 "--config.data.dir=/srv/data/amazon_beauty/",
                                                 "--workdir=/tmp/w", "--rows=64,128"])
  assert head["command"] == ("python benchmarks/x.py --config=configs/beauty_cpu.py "
                             "--config.data.dir=PATH/amazon_beauty --workdir=WORKDIR --rows=64,128")
  assert head["commit"] == "abc1234" and head["name"] == "beauty_cpu"
  assert head["cores"] == os.cpu_count() and "cpu_model" in head["machine"]


class _Flag:
  def __init__(self, value):
    self.value = value


def test_benchmark_main_measures_or_renders_a_recorded_json(tmp_path):
  """Without --render: measured, printed, written to --out and into --docs; with it: the doc
  rewritten from the JSON and nothing measured."""
  measured, docs = [], []
  out = tmp_path / "rec.json"

  def measure():
    measured.append(1)
    return {"x": 1}

  def write_docs(record, doc, json_path):
    docs.append((record, doc, json_path))

  results.benchmark_main({"render": _Flag(""), "out": _Flag(str(out)), "docs": _Flag("d.md")}, measure,
                         lambda r: f"x={r['x']}", write_docs)
  assert measured == [1] and json.loads(out.read_text()) == {"x": 1}
  assert docs == [({"x": 1}, "d.md", str(out))]
  results.benchmark_main({"render": _Flag(str(out)), "out": _Flag(""), "docs": _Flag("e.md")}, measure,
                         lambda r: "", write_docs)
  assert measured == [1] and docs[-1] == ({"x": 1}, "e.md", str(out))
