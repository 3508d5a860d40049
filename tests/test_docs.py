"""The user documentation holds: every relative link and image of README.md and docs/*.md resolves
(anchors included), docs/configuration.md is what tools/config_docs.py writes today, and every
command block of the README runs as written, long runs at smoke size (the mapping below says which
command stands for which, and why), under the interpreter running the tests whatever PATH holds."""

import os
import re
import shlex
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO_ROOT, "docs")


def doc_files():
  return [os.path.join(REPO_ROOT, "README.md")] + sorted(
      os.path.join(DOCS, n) for n in os.listdir(DOCS) if n.endswith(".md"))


def slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
  s = re.sub(r"[`*_]", "", heading.strip().lower())
  s = re.sub(r"[^\w\- ]", "", s)
  return s.replace(" ", "-")


def anchors(path: str) -> set:
  with open(path) as f:
    text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
  return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_and_image_resolves():
  bad = []
  for path in doc_files():
    with open(path) as f:
      text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    for target in LINK.findall(text):
      if re.match(r"^[a-z]+:", target):  # http(s), mailto: not ours to check offline
        continue
      file, _, anchor = target.partition("#")
      full = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
      where = f"{os.path.relpath(path, REPO_ROOT)} -> {target}"
      if not os.path.exists(full):
        bad.append(where)
      elif anchor and full.endswith(".md") and anchor not in anchors(full):
        bad.append(f"{where} (no heading with that anchor)")
  assert not bad, "broken links:\n" + "\n".join(bad)


def test_readme_shape():
  with open(os.path.join(REPO_ROOT, "README.md")) as f:
    lines = f.read().splitlines()
  assert len(lines) <= 200
  head = "\n".join(lines[:30])
  assert "pip install -e . && python -m dgr2_jax.main --config=configs/demo.py" in head
  assert 'pip install -e ".[test,sids,serve]" && python -m pytest -q -x -n 2 --dist loadgroup tests' in head
  for path in doc_files():  # user docs speak to users: no work-item numbers
    with open(path) as f:
      text = f.read()
    assert not re.search(r"\bissues? \d+", text, flags=re.I), path


def test_configuration_page_is_fresh_and_complete():
  sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
  try:
    import config_docs
  finally:
    sys.path.pop(0)
  text, undocumented = config_docs.render()
  assert not undocumented, f"fields without a comment where they are set: {undocumented}"
  with open(config_docs.OUT) as f:
    assert f.read() == text, "docs/configuration.md is stale: run python tools/config_docs.py"
  import ml_collections  # every field of the tree is on the page
  sys.path.insert(0, REPO_ROOT)
  base = config_docs.load_module("base")
  for path, _ in config_docs.flatten(base.get_config()):
    assert f"| `{path}` |" in text, path
  assert isinstance(base.get_config(), ml_collections.ConfigDict)


# ---- the README's command blocks -------------------------------------------------------------------
def readme_commands() -> list[str]:
  """Every command of the README's ```bash blocks: continuation lines joined, comments dropped,
  `a && b` split in two."""
  with open(os.path.join(REPO_ROOT, "README.md")) as f:
    blocks = re.findall(r"```bash\n(.*?)```", f.read(), flags=re.S)
  out = []
  for block in blocks:
    joined = re.sub(r"\\\n\s*", "", block)
    for line in joined.splitlines():
      line = line.split(" #")[0].strip() if not line.lstrip().startswith("#") else ""
      out.extend(" ".join(c.split()) for c in line.split("&&") if c.strip())
  return out


# README command -> what the test runs for it ({tmp}: a fresh folder; {hf}: a tiny HF checkpoint;
# {data}: a folder standing for the Beauty data), as (command, exit status) where it is not 0, or
# None with the reason it is not run here.
# The commands run in order, in one folder, so later ones find what earlier ones wrote.
PIPE = "python -m dgr2_jax.main"
SMOKE = {
    "pip install -e .": None,  # the environment running the tests is installed; .ci/run does it fresh
    'pip install -e ".[test,sids,serve]"': None,
    'pip install -e ".[sids]"': None,
    "python -m pytest -q -x -n 2 --dist loadgroup tests": None,  # this suite
    # The whole demo: .ci/run runs it at smoke size in a fresh virtualenv; here its config and plan.
    f"{PIPE} --config=configs/demo.py --workdir=/tmp/dgr2_demo":
        f"{PIPE} --config=configs/demo.py --workdir={{tmp}}/demo --config.dry_run=True",
    # ~2 h on real data: the same preset, validated and planned.
    f"{PIPE} --config=configs/beauty_cpu.py --config.data.dir=/data/amazon_beauty --workdir=/scratch/beauty_cpu":
        f"{PIPE} --config=configs/beauty_cpu.py --config.data.dir={{data}} --workdir={{tmp}}/bcpu "
        "--config.dry_run=True",
    # The SIDs of a fresh workdir (runs `data` first): for real, at the demo's smoke size.
    f"{PIPE} --config=configs/beauty_qwen3_8b.py --config.stage=sids --config.data.dir=/data/amazon_beauty "
    "--workdir=/scratch/b8":
        f"{PIPE} --config=configs/demo.py:smoke --config.stage=sids --workdir={{tmp}}/b8",
    # Conversion in, with the SID tokens just written and the mask token: for real, a tiny checkpoint.
    "python tools/convert_hf_to_flax.py --hf_dir=/models/Qwen3-8B --flax_dir=/models/qwen3-8b-sids "
    "--add_tokens=/scratch/b8/sids/tokens.txt --mask_token='<|mask|>'":
        "python tools/convert_hf_to_flax.py --hf_dir={hf} --flax_dir={tmp}/ours "
        "--add_tokens={tmp}/b8/sids/tokens.txt --mask_token='<|mask|>'",
    f"{PIPE} --config=configs/beauty_qwen3_8b.py --config.dry_run=True":
        f"{PIPE} --config=configs/beauty_qwen3_8b.py --config.dry_run=True",  # as written
    # The launch script as written, planning (for 8 devices, whatever this machine has) instead of training.
    "bash launch/single_gpu.sh configs/beauty_qwen3_8b.py /scratch/b8 --config.data.dir=/data/amazon_beauty "
    "--config.model.init_from=/models/qwen3-8b-sids":
        "bash launch/single_gpu.sh configs/beauty_qwen3_8b.py {tmp}/b8 --config.data.dir={data} "
        "--config.model.init_from={tmp}/ours --config.hardware.num_devices=8 --config.dry_run=True",
    # Conversion out: for real, the tiny checkpoint converted above stands for the trained model.
    "python tools/convert_hf_to_flax.py --reverse --flax_dir=/scratch/b8/rl/model --hf_dir=/models/dgr2-8b-hf":
        "python tools/convert_hf_to_flax.py --reverse --flax_dir={tmp}/ours --hf_dir={tmp}/hf_out",
    # generate: for real on that directory, block-diffusion decoding, 32 new tokens instead of 128.
    f"{PIPE} --config=configs/generate.py --config.model_dir=/models/dgr2-8b-hf --config.input=prompts.jsonl "
    "--config.output=out.jsonl --config.decode.block_size=32 --config.decode.threshold=0.9 "
    "--config.decode.max_new_tokens=128":
        f"{PIPE} --config=configs/generate.py --config.model_dir={{tmp}}/hf_out --config.input={{tmp}}/prompts.jsonl "
        "--config.output={tmp}/out.jsonl --config.decode.block_size=32 --config.decode.threshold=0.9 "
        "--config.decode.max_new_tokens=32",
    f"{PIPE} --config=configs/demo.py:no_cft,block8 --workdir=/tmp/dgr2_ablation":
        f"{PIPE} --config=configs/demo.py:no_cft,block8 --workdir={{tmp}}/abl --config.dry_run=True",
    f"{PIPE} --config=configs/demo.py --config.stage=eval --config.eval.model_dir=/tmp/dgr2_demo/cft/model "
    "--workdir=/tmp/dgr2_demo":
        f"{PIPE} --config=configs/demo.py --config.stage=eval --config.eval.model_dir={{tmp}}/ours "
        "--workdir={tmp}/demo --config.dry_run=True",
    # Several processes: the launcher as written, every process planning instead of training
    # (tests/test_multiprocess_pipeline.py runs it through the whole smoke pipeline).
    "bash launch/local_multi_process.sh 2 2 python -m dgr2_jax.main --config=configs/demo.py:smoke "
    "--workdir=/tmp/dgr2_mp":
        "bash launch/local_multi_process.sh 2 2 python -m dgr2_jax.main --config=configs/demo.py:smoke "
        "--workdir={tmp}/mp --config.dry_run=True",
    'pip install -e ".[serve]"': None,  # the test environment has the server's packages (.ci/run)
    # The server needs a finished workdir: its flags parse here; tests/test_serve.py starts it on a
    # smoke workdir and sends it these requests over HTTP.
    "python -m dgr2_jax.serve --config=configs/demo.py --workdir=/tmp/dgr2_demo --port=8000":
        ("python -m dgr2_jax.serve --helpshort", 1),
    "curl -s localhost:8000/v1/rerank -d '{\"history\": [3, 17, 42], \"candidates\": [5, 8, 13, 21, 34, 55, "
    "89, 2, 7, 11]}'": None,
    # Needs a finished demo workdir (minutes): its flags parse (absl's --helpshort exits with 1).
    "python benchmarks/recipe_figures.py --config=configs/demo.py --workdir=/tmp/dgr2_demo":
        ("python benchmarks/recipe_figures.py --config=configs/demo.py --workdir={tmp}/demo --helpshort", 1),
}


def test_every_readme_command_is_mapped():
  commands = readme_commands()
  assert commands, "no ```bash blocks found in README.md"
  unmapped = [c for c in commands if c not in SMOKE]
  assert not unmapped, "README commands with no smoke form in tests/test_docs.py:\n" + "\n".join(unmapped)
  stale = [c for c in SMOKE if c not in commands]
  assert not stale, "smoke forms of commands the README no longer has:\n" + "\n".join(stale)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
  """A tiny Qwen3 as a Hugging Face directory with the demo tokenizer (no torch needed)."""
  import jax
  from dgr2_jax.model import checkpoint, qwen3
  from dgr2_jax.model.config import Qwen3Config
  from dgr2_jax.task import tokenizer as tok_lib
  root = tmp_path_factory.mktemp("docs_hf")
  tok_dir = tok_lib.build_demo_tokenizer(["red lipstick for dry lips", "rank the candidates"] * 5, [],
                                         str(root / "tok"), vocab_size=300)
  tok = tok_lib.load_tokenizer(tok_dir)
  cfg = Qwen3Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=False)
  params = jax.device_get(qwen3.init_params(cfg, jax.random.PRNGKey(0)))
  return checkpoint.save_hf_dir(str(root / "hf"), cfg, params, tokenizer_src=tok_dir)


def readme_argv(cmd: str) -> list[str]:
  """A command's argv under the interpreter running the tests, whatever PATH holds first (a venv's
  tests run with no venv activated): each `python`/`python3` word, the command's own or the one a
  launcher is given, is sys.executable, and a leading `pip` is `sys.executable -m pip`."""
  words = [sys.executable if w in ("python", "python3") else w for w in shlex.split(cmd)]
  return [sys.executable, "-m", "pip", *words[1:]] if words[0] in ("pip", "pip3") else words


def test_readme_commands_run(tmp_path, tiny_hf, foreign_path):
  """Every README command as mapped above, with a `python` on PATH that fails (the launch scripts
  take their interpreter from PYTHON)."""
  (tmp_path / "data").mkdir()
  (tmp_path / "prompts.jsonl").write_text('{"prompt": "rank the candidates"}\n')
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHON=sys.executable, PATH=foreign_path)
  for readme_cmd in readme_commands():
    cmd, status = SMOKE[readme_cmd] if isinstance(SMOKE[readme_cmd], tuple) else (SMOKE[readme_cmd], 0)
    if cmd is None:
      continue
    cmd = cmd.replace("{tmp}", str(tmp_path)).replace("{hf}", tiny_hf).replace("{data}", str(tmp_path / "data"))
    r = subprocess.run(readme_argv(cmd), cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == status, f"{readme_cmd}\n  ran as: {cmd}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
  assert (tmp_path / "b8" / "sids" / "tokens.txt").exists()   # the SIDs, with `data` built first
  assert (tmp_path / "b8" / "data").exists()
  assert (tmp_path / "hf_out" / "config.json").exists()       # converted in and out
  assert (tmp_path / "out.jsonl").read_text().count("\n") == 1  # one answer per prompt
