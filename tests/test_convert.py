"""Checkpoint conversion: HF <-> ours round trips, vocabulary extension, the CLI, bad inputs.

Round trips are checked bitwise with `torch.equal` on every tensor transformers loads back; bad
inputs must fail with a one-line error naming the problem and leave nothing in the output parent.
"""

import json
import os
import shutil
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from dgr2_jax.model import checkpoint, qwen3

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO_ROOT, "tools", "convert_hf_to_flax.py")
TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
TOKENIZER_WORDS = 88  # + <unk>, <eos> = 90 tokenizer entries < 97 embedding rows, as in Qwen3


def make_tokenizer(out_dir: str) -> None:
  import tokenizers
  from tokenizers import models, pre_tokenizers
  vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(TOKENIZER_WORDS)}}
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                              eos_token="<eos>")
  fast.save_pretrained(out_dir)


def make_hf_dir(out_dir: str, tied: bool, dtype=torch.float32, max_shard_size=None,
                legacy_config=False, tokenizer=True) -> transformers.Qwen3ForCausalLM:
  torch.manual_seed(0)
  model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
      **TINY, tie_word_embeddings=tied)).eval()
  with torch.no_grad():  # HF initialises norms to 1; randomise so a swapped tensor shows.
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(torch.randn(p.shape) * 0.3)
  model = model.to(dtype)
  kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
  model.save_pretrained(out_dir, **kw)
  if legacy_config:  # The form real Qwen3 config.json files use (rope_theta + rope_scaling).
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
      d = json.load(f)
    rp = d.pop("rope_parameters")
    d.update(rope_theta=rp["rope_theta"], rope_scaling=None, torch_dtype=d.pop("dtype", None))
    with open(path, "w") as f:
      json.dump(d, f)
  if tokenizer:
    make_tokenizer(out_dir)
  return model


def state_dict_numpy(model):
  return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def assert_same_tensors(a: torch.nn.Module, b: torch.nn.Module):
  sa, sb = a.state_dict(), b.state_dict()
  assert sorted(sa) == sorted(sb)
  for k in sa:
    assert sa[k].dtype == sb[k].dtype, k
    assert torch.equal(sa[k], sb[k]), k


def leftovers(parent: str) -> list[str]:
  return [n for n in os.listdir(parent) if ".tmp-" in n]


# ---- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,tied,shard_in,shard_out", [
    (torch.float32, False, False, True),
    (torch.bfloat16, True, True, False),
])
def test_round_trip_bitwise(tmp_path, dtype, tied, shard_in, shard_out):
  hf_in, ours, hf_out = (str(tmp_path / n) for n in ("hf_in", "ours", "hf_out"))
  model = make_hf_dir(hf_in, tied, dtype, max_shard_size="40KB" if shard_in else None,
                      legacy_config=not shard_in)
  assert os.path.exists(os.path.join(hf_in, checkpoint.INDEX_FILE)) == shard_in

  config = checkpoint.convert_hf_to_ours(hf_in, ours, progress=False)
  assert config.param_dtype == {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
  assert os.path.isdir(os.path.join(ours, checkpoint.PARAMS_DIR))
  assert os.path.isfile(os.path.join(ours, "tokenizer.json"))
  assert json.load(open(os.path.join(ours, "config.json")))["dgr2"] == {
      "block_size": 1, "mask_token_id": None, "attention": "causal"}

  # Our directory holds the HF tensors (transposed kernels), in the checkpoint's dtype.
  config2, params = checkpoint.load_model_dir(ours)
  assert config2 == config
  sd = state_dict_numpy(model)
  for path, leaf in checkpoint.flatten(params).items():
    name, hook = checkpoint.ours_to_hf(path)
    assert leaf.dtype == np.dtype(config.param_dtype), path
    want = sd[name].T if hook else sd[name]
    np.testing.assert_array_equal(leaf.astype(np.float32), want, err_msg=path)

  checkpoint.convert_ours_to_hf(ours, hf_out, shard_bytes=30_000 if shard_out else 10**9,
                                progress=False)
  assert os.path.exists(os.path.join(hf_out, checkpoint.INDEX_FILE)) == shard_out
  if shard_out:
    index = json.load(open(os.path.join(hf_out, checkpoint.INDEX_FILE)))
    assert len(set(index["weight_map"].values())) > 1
  back = transformers.AutoModelForCausalLM.from_pretrained(hf_out, local_files_only=True)
  assert back.dtype == dtype
  assert_same_tensors(model, back)
  tok = transformers.AutoTokenizer.from_pretrained(hf_out, local_files_only=True)
  assert len(tok) == TOKENIZER_WORDS + 2

  # The in-memory writer agrees with the streaming one, and an HF dir loads like ours.
  checkpoint.save_hf_dir(str(tmp_path / "hf_mem"), config, params)
  config3, params3 = checkpoint.load_model_dir(str(tmp_path / "hf_mem"))
  assert config3 == config
  for path, leaf in checkpoint.flatten(params3).items():
    np.testing.assert_array_equal(leaf, checkpoint.flatten(params)[path], err_msg=path)


def test_load_model_dir_casts(tmp_path):
  hf_in = str(tmp_path / "hf")
  make_hf_dir(hf_in, tied=False, dtype=torch.bfloat16, tokenizer=False)
  config, params = checkpoint.load_model_dir(hf_in, dtype="float32")
  assert config.param_dtype == "float32"
  assert {np.dtype(a.dtype) for a in checkpoint.flatten(params).values()} == {np.dtype(np.float32)}
  ours = str(tmp_path / "ours")
  checkpoint.save_model_dir(ours, config, params)
  config2, params2 = checkpoint.load_model_dir(ours, dtype="bfloat16")
  assert config2.param_dtype == "bfloat16"
  for path, leaf in checkpoint.flatten(params2).items():
    assert leaf.dtype == np.dtype("bfloat16"), path
    # f32 copies of bf16 weights cast back exactly.
    np.testing.assert_array_equal(leaf.astype(np.float32), checkpoint.flatten(params)[path])


# ---- vocabulary extension + CLI -----------------------------------------------------------------
def run_tool(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
  return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, env=env,
                        timeout=300)


@pytest.mark.parametrize("tied", [True, False])
def test_extend_vocab_rows_are_mean(tied):
  config = qwen3.Qwen3Config(**{k: v for k, v in TINY.items() if k != "rope_parameters"},
                             tie_word_embeddings=tied)
  params = checkpoint.unflatten({p: np.random.RandomState(0).randn(*s).astype(np.float32)
                                 for p, s in checkpoint.expected_shapes(config).items()})
  new_cfg, new = checkpoint.extend_vocab(config, params, 90, 101)
  assert new_cfg.vocab_size == 101
  emb, old = new["embed_tokens"]["embedding"], params["embed_tokens"]["embedding"]
  assert emb.shape == (101, 32)
  np.testing.assert_array_equal(emb[:90], old[:90])
  np.testing.assert_allclose(emb[90:], np.broadcast_to(old[:90].mean(0), (11, 32)), rtol=1e-6)
  assert ("lm_head" in new) == (not tied)
  if not tied:
    head = new["lm_head"]["kernel"]
    assert head.shape == (32, 101)
    np.testing.assert_allclose(head[:, 95], params["lm_head"]["kernel"][:, :90].mean(1), rtol=1e-6)
  assert qwen3.count_params(new) == qwen3.count_params(qwen3.param_shapes(new_cfg))


def test_cli_add_tokens_mask_token_and_reverse(tmp_path):
  hf_in, ours, hf_out = (str(tmp_path / n) for n in ("hf_in", "ours", "hf_out"))
  model = make_hf_dir(hf_in, tied=True)
  tokens = tmp_path / "tokens.txt"
  new = [f"<a_{i}>" for i in range(8)] + ["<b_0>", "<b_1>"]
  tokens.write_text("\n".join(new) + "\n")
  r = run_tool(f"--hf_dir={hf_in}", f"--flax_dir={ours}", f"--add_tokens={tokens}",
               "--mask_token=<|mask|>", "--block_size=4")
  assert r.returncode == 0, r.stderr[-2000:]

  d = json.load(open(os.path.join(ours, "config.json")))
  # 90 tokenizer entries + 10 tokens + mask = 101 > 97 rows: the tied matrix grows once, to 101.
  assert d["vocab_size"] == 101
  assert d["dgr2"] == {"block_size": 4, "mask_token_id": 100, "attention": "block_causal"}
  tok = transformers.AutoTokenizer.from_pretrained(ours, local_files_only=True)
  assert tok.mask_token == "<|mask|>" and tok.mask_token_id == 100
  assert tok.convert_tokens_to_ids(new) == list(range(90, 100))
  assert tok.encode("w3 <a_2><b_1> <|mask|>") == [5, 92, 99, 100]

  config, params = checkpoint.load_model_dir(ours)
  assert (config.vocab_size, config.mask_token_id, config.block_size) == (101, 100, 4)
  assert "lm_head" not in params
  emb = params["embed_tokens"]["embedding"]
  old = model.model.embed_tokens.weight.detach().numpy()
  np.testing.assert_array_equal(emb[:90], old[:90])
  np.testing.assert_allclose(emb[90:], np.broadcast_to(old[:90].mean(0), (11, 32)), rtol=1e-6)

  r = run_tool("--reverse", f"--flax_dir={ours}", f"--hf_dir={hf_out}", "--shard_bytes=20000")
  assert r.returncode == 0, r.stderr[-2000:]
  back = transformers.AutoModelForCausalLM.from_pretrained(hf_out, local_files_only=True)
  assert back.config.vocab_size == 101 and back.config.tie_word_embeddings
  np.testing.assert_array_equal(back.model.embed_tokens.weight.detach().numpy(), emb)
  assert transformers.AutoTokenizer.from_pretrained(hf_out, local_files_only=True).mask_token_id == 100

  # Bad input through the CLI: exit 1, one line on stderr naming the problem, nothing written.
  r = run_tool(f"--hf_dir={hf_in}", f"--flax_dir={ours}")
  assert r.returncode == 1
  assert r.stderr.strip().splitlines()[-1] == (
      f"error: output directory already exists: {ours} (pass --overwrite)")
  assert leftovers(str(tmp_path)) == []


# ---- bad inputs ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_hf(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("good") / "hf")
  make_hf_dir(d, tied=False, tokenizer=False)
  return d


def _rewrite(src: str, dst: str, edit_tensors=None, edit_config=None):
  shutil.copytree(src, dst)
  if edit_tensors:
    f = os.path.join(dst, checkpoint.SINGLE_FILE)
    tensors = safetensors.numpy.load_file(f)
    edit_tensors(tensors)
    safetensors.numpy.save_file(tensors, f, metadata={"format": "pt"})
  if edit_config:
    f = os.path.join(dst, "config.json")
    d = json.load(open(f))
    edit_config(d)
    json.dump(d, open(f, "w"))


def _truncate(dst):
  f = os.path.join(dst, checkpoint.SINGLE_FILE)
  size = os.path.getsize(f)
  with open(f, "r+b") as fh:
    fh.truncate(size - 100)


BAD = {
    "missing_dir": (lambda src, dst: None, FileNotFoundError, r"model directory not found: .*bad_in"),
    "missing_config": (lambda src, dst: (shutil.copytree(src, dst),
                                         os.remove(os.path.join(dst, "config.json"))),
                       FileNotFoundError, r"missing config\.json in .*bad_in"),
    "missing_weights": (lambda src, dst: (shutil.copytree(src, dst),
                                          os.remove(os.path.join(dst, checkpoint.SINGLE_FILE))),
                        FileNotFoundError, r"no weights in .*bad_in: expected model\.safetensors"),
    "model_type": (lambda src, dst: _rewrite(src, dst, edit_config=lambda d: d.update(model_type="llama")),
                   ValueError, r"config\.json: model_type is 'llama', only 'qwen3' is supported"),
    "wrong_shape": (lambda src, dst: _rewrite(src, dst, edit_tensors=lambda t: t.update({
        "model.layers.1.mlp.up_proj.weight": np.zeros((47, 32), np.float32)})),
                    ValueError, r"tensor model\.layers\.1\.mlp\.up_proj\.weight has shape \[47, 32\], "
                                r"expected \[48, 32\]"),
    "missing_tensor": (lambda src, dst: _rewrite(src, dst, edit_tensors=lambda t: t.pop(
        "model.layers.0.self_attn.k_norm.weight")),
                       ValueError, r"tensor model\.layers\.0\.self_attn\.k_norm\.weight is missing"),
    "leftover_tensor": (lambda src, dst: _rewrite(src, dst, edit_tensors=lambda t: t.update({
        "model.layers.2.mlp.up_proj.weight": np.zeros((48, 32), np.float32)})),
                        ValueError, r"unexpected tensor model\.layers\.2\.mlp\.up_proj\.weight"),
    "truncated": (lambda src, dst: (shutil.copytree(src, dst), _truncate(dst)),
                  ValueError, r"model\.safetensors: truncated or corrupt safetensors file"),
    "missing_shard": (lambda src, dst: (shutil.copytree(src, dst), _write_index(dst)),
                      FileNotFoundError, r"missing weights file model-00002-of-00002\.safetensors"),
}


def _write_index(dst):
  json.dump({"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}},
            open(os.path.join(dst, checkpoint.INDEX_FILE), "w"))
  os.remove(os.path.join(dst, checkpoint.SINGLE_FILE))


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line_error_nothing_written(good_hf, tmp_path, case):
  make, exc, pattern = BAD[case]
  bad = str(tmp_path / "bad_in")
  make(good_hf, bad)
  out_parent = tmp_path / "out"
  out_parent.mkdir()
  with pytest.raises(exc, match=pattern) as e:
    checkpoint.convert_hf_to_ours(bad, str(out_parent / "ours"), progress=False)
  assert "\n" not in str(e.value)
  assert os.listdir(out_parent) == []


def test_existing_output_untouched_unless_overwrite(good_hf, tmp_path):
  out = tmp_path / "ours"
  out.mkdir()
  (out / "keep.txt").write_text("x")
  with pytest.raises(FileExistsError, match=r"output directory already exists: .*ours"):
    checkpoint.convert_hf_to_ours(good_hf, str(out), progress=False)
  assert os.listdir(out) == ["keep.txt"] and leftovers(str(tmp_path)) == []
  checkpoint.convert_hf_to_ours(good_hf, str(out), overwrite=True, progress=False)
  assert "keep.txt" not in os.listdir(out) and leftovers(str(tmp_path)) == []


def test_bad_ours_dir_reverse(good_hf, tmp_path):
  ours = str(tmp_path / "ours")
  checkpoint.convert_hf_to_ours(good_hf, ours, progress=False)
  cfg = os.path.join(ours, "config.json")
  d = json.load(open(cfg))
  d["intermediate_size"] = 64
  json.dump(d, open(cfg, "w"))
  with pytest.raises(ValueError, match=r"parameter layers_0/mlp/down_proj/kernel has shape "
                                       r"\[48, 32\], expected \[64, 32\]"):
    checkpoint.convert_ours_to_hf(ours, str(tmp_path / "hf_out"), progress=False)
  assert not os.path.exists(tmp_path / "hf_out") and leftovers(str(tmp_path)) == []
