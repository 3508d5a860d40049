"""The command line answers every mistake in one line, without a traceback: exit status 2 for a
mistake on the command line itself (a field, a value, a path), 1 for an input file that cannot be
read. Each case runs `python -m dgr2_jax.main` as a user would."""

import os
import shutil
import subprocess
import sys

import pytest

from dgr2_jax import main as main_lib
from dgr2_jax.stages import common

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "dgr2_jax.main", *args], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


def assert_one_line(r, status: int, *needles):
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert r.returncode == status, (r.returncode, r.stderr)
  assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
  assert lines[0].startswith("dgr2_jax.main: "), lines
  for n in needles:
    assert n in lines[0], (n, lines[0])


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
  """A tiny model directory of ours (with the demo tokenizer), one with a truncated tokenizer.json,
  one with a truncated parameter file, and a prompts file."""
  import jax
  from dgr2_jax.model import checkpoint, qwen3
  from dgr2_jax.model.config import Qwen3Config
  from dgr2_jax.task import tokenizer as tok_lib
  root = tmp_path_factory.mktemp("cli")
  tok_dir = tok_lib.build_demo_tokenizer(["red lipstick for dry lips", "rank the candidates"] * 5,
                                         ["<a_0>"], str(root / "tok"), vocab_size=300)
  cfg = Qwen3Config(vocab_size=len(tok_lib.load_tokenizer(tok_dir)), hidden_size=16, intermediate_size=32,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
  params = jax.device_get(qwen3.init_params(cfg, jax.random.PRNGKey(0)))
  good = str(root / "good")
  checkpoint.save_model_dir(good, cfg, params, tokenizer_src=tok_dir)
  bad_tok, bad_params = str(root / "bad_tok"), str(root / "bad_params")
  shutil.copytree(good, bad_tok)
  shutil.copytree(good, bad_params)
  assert os.path.exists(os.path.join(good, checkpoint.PARAMS_SIZES_FILE))
  with open(os.path.join(bad_tok, "tokenizer.json"), "r+") as f:
    f.truncate(len(f.read()) // 2)
  # The largest file of the Orbax/OCDBT checkpoint holds the arrays: cut it short.
  files = [os.path.join(d, n) for d, _, ns in os.walk(os.path.join(bad_params, "params")) for n in ns]
  biggest = max(files, key=os.path.getsize)
  with open(biggest, "r+b") as f:
    f.truncate(os.path.getsize(biggest) // 3)
  # A model dir written before the sizes file existed: the cut reaches Orbax/tensorstore itself.
  bad_params_unsized = str(root / "bad_params_unsized")
  shutil.copytree(bad_params, bad_params_unsized)
  os.remove(os.path.join(bad_params_unsized, checkpoint.PARAMS_SIZES_FILE))
  prompts = root / "prompts.jsonl"
  prompts.write_text('{"prompt_ids": [3, 4, 5]}\n')
  bad_prompts = root / "bad_prompts.jsonl"
  bad_prompts.write_text('{"prompt_ids": [3, 4, 5]}\n{"prompt_ids": [3, 4\n')
  return dict(root=str(root), good=good, bad_tok=bad_tok, bad_params=bad_params,
              bad_params_unsized=bad_params_unsized,
              prompts=str(prompts), bad_prompts=str(bad_prompts))


# (arguments, exit status, what the line must say). `{tmp}` is a fresh directory.
USAGE_CASES = [
    (["--config=configs/demo.py", "--config.decode.treshold=0.5"], 2,
     ["--config.decode.treshold: no such config field 'treshold'", 'Did you mean "threshold"']),
    (["--config=configs/demo.py", "--config.nosuch.field=1"], 2,
     ["--config.nosuch.field: no such config field 'nosuch'"]),
    (["--config=configs/demo.py:no_such_variant"], 2,
     ["--config=configs/demo.py:no_such_variant: unknown config preset 'no_such_variant'", "no_cft"]),
    (["--config=configs/nope.py"], 2, ["no such config file 'configs/nope.py'"]),
    (["--config=configs"], 2, ["'configs' is not a Python config file"]),
    (["--config.stage=eval"], 2, ["--config is required"]),
    (["--config=configs/demo.py", "--config.decode.threshold=abc"], 2,
     ["--config.decode.threshold=abc", "could not convert"]),
    (["--config=configs/demo.py", "--config.decode.threshold=1.5"], 2,
     ["config.decode.threshold: must be in (0, 1], got 1.5"]),
    (["--config=configs/demo.py", "--nosuchflag"], 2, ["nosuchflag"]),
    (["--config=configs/demo.py", "stray"], 2, ["unexpected arguments ['stray']"]),
    (["--config=configs/demo.py"], 2, ["--workdir is required"]),
    (["--config=configs/demo.py", "--workdir={tmp}/file"], 2, ["--workdir:", "is a file"]),
    (["--config=configs/beauty_cpu.py"], 2, ["config.data.dir: is required"]),
    (["--config=configs/demo.py", "--config.stage=eval", "--config.eval.model_dir={tmp}"], 2,
     ["config.eval.model_dir:", "has no config.json"]),
    (["--config=configs/generate.py"], 2, ["config.model_dir: is required"]),
    (["--config=configs/beauty_qwen3_8b.py", "--config.dry_run=True", "--config.hardware.num_devices=3"], 2,
     ["train.mesh:", "does not divide 3 devices"]),
]


@pytest.mark.parametrize("args,status,needles", USAGE_CASES, ids=lambda v: None)
def test_usage_mistakes_are_one_line(tmp_path, args, status, needles):
  (tmp_path / "file").write_text("x")
  # Every case gets a workdir except those about the workdir itself and generate (which needs none).
  own = any(a.startswith("--workdir") for a in args) or "--workdir is required" in needles
  workdir = [] if own or args[0] == "--config=configs/generate.py" else [f"--workdir={tmp_path}/work"]
  r = cli(*[a.replace("{tmp}", str(tmp_path)) for a in args], *workdir)
  assert_one_line(r, status, *needles)
  assert not (tmp_path / "work").exists()  # nothing was done


# Every path field of the config, each wrong way, checked by validation before any work (the
# subprocess cases above show a validation error reaches the user as one line, status 2).
PATH_CASES = [
    ("beauty_cpu.py", {"data.dir": "{tmp}/absent"}, FileNotFoundError,
     "config.data.dir: data folder .*absent' does not exist"),
    ("beauty_cpu.py", {"data.dir": "{tmp}/file"}, FileNotFoundError, "config.data.dir: .* is a file, not a directory"),
    # A stage alone in a fresh workdir runs `data` first: data.dir is checked before anything runs.
    ("beauty_cpu.py", {"stage": "sids"}, ValueError, "config.data.dir: is required"),
    ("demo.py", {"stage": "sids", "sids.encoder": "npy"}, ValueError, "config.sids.embeddings_npy: is required"),
    ("demo.py", {"stage": "sids", "sids.encoder": "npy", "sids.embeddings_npy": "{tmp}"}, FileNotFoundError,
     "config.sids.embeddings_npy: .* is a directory, not a file"),
    ("demo.py", {"stage": "retriever", "retriever.source": "file", "retriever.candidates_file": "{tmp}/a.jsonl"},
     FileNotFoundError, "config.retriever.candidates_file: candidates file .* does not exist"),
    ("demo.py", {"stage": "traces", "task.traces_path": "{tmp}"}, FileNotFoundError,
     "config.task.traces_path: .* is a directory, not a file"),
    ("demo.py", {"stage": "traces", "task.tokenizer": "{tmp}/file"}, FileNotFoundError,
     "config.task.tokenizer: .* is a file, not a directory"),
    ("demo.py", {"stage": "sft", "model.init_from": "{tmp}"}, FileNotFoundError,
     "config.model.init_from: .* has no config.json"),
    ("demo.py", {"stage": "cft", "cft.init_from": "{tmp}/absent"}, FileNotFoundError,
     "config.cft.init_from: model directory"),
    ("demo.py", {"stage": "opd", "opd.teacher_dir": "{tmp}/file"}, FileNotFoundError,
     "config.opd.teacher_dir: .* is a file"),
    ("demo.py", {"stage": "rl", "rl.init_from": "{tmp}"}, FileNotFoundError,
     "config.rl.init_from: .* has no config.json"),
    ("demo.py", {"stage": "teacher_rl", "teacher_rl.init_from": "{tmp}/absent"}, FileNotFoundError,
     "config.teacher_rl.init_from: model directory"),
    ("demo.py", {"eval.output_dir": "{tmp}/file"}, ValueError, "config.eval.output_dir: .* is a file"),
    ("demo.py", {"decode.mode": "speculative", "decode.verifier_dir": "{tmp}/absent"}, FileNotFoundError,
     "config.decode.verifier_dir: verifier model directory"),
    ("demo.py", {"stage": "bench", "bench.model_dir": "{tmp}"}, FileNotFoundError,
     "config.bench.model_dir: .* has no config.json"),
    ("demo.py", {"stage": "bench", "bench.ar_model_dir": "{tmp}/absent"}, FileNotFoundError,
     "config.bench.ar_model_dir:"),
    ("generate.py", {"model_dir": "{tmp}", "input": "{tmp}/in.jsonl", "output": "{tmp}/out.jsonl"}, FileNotFoundError,
     "config.model_dir: .* has no config.json"),
    ("generate.py", {"model_dir": "{model}", "input": "{tmp}", "output": "{tmp}/out.jsonl"}, FileNotFoundError,
     "config.input: input file .* is a directory"),
    ("generate.py", {"model_dir": "{model}", "input": "{tmp}/file", "output": "{tmp}"}, ValueError,
     "config.output: .* is a directory; give the JSONL file"),
    ("generate.py", {"model_dir": "{model}", "input": "{tmp}/file", "output": "{tmp}/absent/o.jsonl"},
     FileNotFoundError, "config.output: output folder .*absent' does not exist"),
]


@pytest.mark.parametrize("preset,overrides,exc,match", PATH_CASES)
def test_every_path_field_is_checked(tmp_path, monkeypatch, preset, overrides, exc, match):
  monkeypatch.setattr(main_lib, "stage_fn", lambda name: pytest.fail(f"{overrides} passed validation"))
  (tmp_path / "file").write_text("x")
  model = tmp_path / "model"
  model.mkdir()
  (model / "config.json").write_text("{}")
  c = load_preset(preset)
  for k, v in overrides.items():
    node = c
    *path, last = k.split(".")
    for q in path:
      node = node[q]
    node[last] = v.replace("{tmp}", str(tmp_path)).replace("{model}", str(model))
  with pytest.raises(exc, match=match):
    main_lib.run(c, None if preset == "generate.py" else str(tmp_path / "work"))
  assert not (tmp_path / "work").exists()


def load_preset(name: str, arg: str = ""):
  import importlib.util
  spec = importlib.util.spec_from_file_location(f"cfg_{name[:-3]}", os.path.join(REPO_ROOT, "configs", name))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def generate_args(model_dir, prompts, out):
  return ["--config=configs/generate.py", f"--config.model_dir={model_dir}", f"--config.input={prompts}",
          f"--config.output={out}", "--config.decode.block_size=1", "--config.decode.threshold=1.0",
          "--config.decode.max_new_tokens=4"]


@pytest.mark.parametrize("which,needles", [
    ("bad_tok", ["bad_tok/tokenizer.json: not valid JSON"]),
    ("bad_params", ["bad_params: cannot load the model", "bytes", "params_sizes.json says"]),
    ("bad_params_unsized", ["bad_params_unsized: cannot load the model", "params"]),
    ("bad_prompts", ["bad_prompts.jsonl:2: not valid JSON"]),
])
def test_unreadable_input_files_are_one_line(model_dirs, tmp_path, which, needles):
  d = model_dirs
  model = d["good"] if which == "bad_prompts" else d[which]
  prompts = d["bad_prompts"] if which == "bad_prompts" else d["prompts"]
  out = tmp_path / "out.jsonl"
  r = cli(*generate_args(model, prompts, out))
  assert_one_line(r, 1, *needles)
  assert not out.exists()


def test_a_stage_alone_runs_the_stages_it_needs_first(tmp_path, monkeypatch):
  """`--config.stage=sids` in a fresh workdir builds `data` first; a built stage is not rerun; eval
  and bench (and a model stage given its starting model) need only the data stages."""
  ran = []

  def fake(name):
    def run(config, workdir):
      ran.append(name)
      with common.atomic_dir(common.stage_dir(workdir, name), f"h-{name}"):
        pass
    return run

  monkeypatch.setattr(main_lib, "stage_fn", fake)
  c = load_preset("demo.py")
  c.stage = "sids"
  main_lib.run(c, str(tmp_path / "w"))
  assert ran == ["data", "sids"]
  ran.clear()
  c.stage = "traces"
  main_lib.run(c, str(tmp_path / "w"))  # data is built: not rerun (sids reruns itself when stale)
  assert ran == ["retriever", "traces"]
  ran.clear()
  c.stage = "cft"
  main_lib.run(c, str(tmp_path / "w"))
  assert ran == ["sft", "teacher_rl", "convert", "cft"]
  from dgr2_jax.stages import pipeline
  c2 = load_preset("demo.py", "no_cft")
  c2.stage = "bench"
  assert pipeline.missing_prerequisites(c2, str(tmp_path / "fresh"), "bench") == [
      "data", "sids", "retriever", "traces"]
  assert pipeline.missing_prerequisites(c2, str(tmp_path / "fresh"), "retriever") == ["data"]
  c2.stage = "opd"
  c2.opd.init_from = str(tmp_path)
  assert pipeline.missing_prerequisites(c2, str(tmp_path / "w"), "opd") == []
  assert pipeline.missing_prerequisites(c2, str(tmp_path / "w"), "pipeline") == []


def test_cache_keys_name_workdir_paths_relative_to_it(tmp_path):
  # A copied or moved workdir keeps its stages fresh: a path inside it keys the same from both
  # places; a path outside it, or another path inside it, keys differently.
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  key = lambda wd, p: common.config_hash({"init_from": p, "x": 1}, [p], workdir=wd)
  assert key(a, os.path.join(a, "cft", "model")) == key(b, os.path.join(b, "cft", "model"))
  assert key(a, os.path.join(a, "cft", "model")) != key(a, os.path.join(a, "sft", "model"))
  assert key(a, "/elsewhere/model") != key(b, os.path.join(b, "elsewhere", "model"))
  sibling = [a + "x/model"]   # shares the workdir's prefix, but is outside it: kept as it is
  assert common.config_hash(sibling, workdir=a) == common.config_hash(sibling)
  assert common.config_hash([a + "/m"], workdir=a) != common.config_hash([a + "/m"])
  assert common.config_hash({"p": "rel/path"}) == common.config_hash({"p": "rel/path"}, workdir=a)
