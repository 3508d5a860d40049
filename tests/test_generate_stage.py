"""The generate stage (JSONL in -> JSONL out) and the convert stage on a tiny model.

References: transformers' greedy `generate` for AR decoding (block 1) of an HF directory, and the
plain-Python `decode.reference` for block-diffusion decoding of an AR checkpoint converted on the
fly; prompt ids of text/messages lines are re-derived here from the tokenizer.
"""

import importlib.util
import json
import os

import numpy as np
import pytest

from dgr2_jax import main as main_lib
from dgr2_jax.stages import common
from dgr2_jax.stages import convert as convert_stage
from dgr2_jax.stages import generate as generate_stage

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_NEW = 16


def load_config(name: str, arg: str = ""):
  path = os.path.join(REPO_ROOT, "configs", name)
  spec = importlib.util.spec_from_file_location(f"cfg_{name[:-3]}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  """HF dir (transformers save_pretrained + demo tokenizer), our dir of the same weights, and an
  HF dir without tokenizer (no mask token anywhere)."""
  torch = pytest.importorskip("torch")
  from transformers import Qwen3Config as HFConfig, Qwen3ForCausalLM
  from dgr2_jax.model import checkpoint
  from dgr2_jax.task import tokenizer as tok_lib
  root = tmp_path_factory.mktemp("gen")
  tok_dir = tok_lib.build_demo_tokenizer(
      ["red lipstick for dry lips", "a shampoo that smells nice", "rank the candidates"] * 5,
      ["<a_0>", "<a_1>", "<b_0>"], str(root / "tok"), vocab_size=300)
  tok = tok_lib.load_tokenizer(tok_dir)
  tids = tok_lib.token_ids(tok)
  torch.manual_seed(0)
  hf_cfg = HFConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                    tie_word_embeddings=False, eos_token_id=tids.eos_id, pad_token_id=tids.pad_id,
                    bos_token_id=None)
  model = Qwen3ForCausalLM(hf_cfg).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.mul_(6.0)  # peaked distributions: no near-ties between torch and XLA argmax
  model.save_pretrained(root / "hf_bare")
  model.save_pretrained(root / "hf")
  tok.save_pretrained(root / "hf")
  cfg, params = checkpoint.load_model_dir(str(root / "hf"))
  checkpoint.save_model_dir(str(root / "ours"), cfg, params, tokenizer_src=tok_dir)
  return dict(root=root, hf=str(root / "hf"), ours=str(root / "ours"),
              bare=str(root / "hf_bare"), tok=tok, tids=tids, model=model)


def write_lines(path, objs_or_text):
  with open(path, "w") as f:
    if isinstance(objs_or_text, str):
      f.write(objs_or_text)
    else:
      for o in objs_or_text:
        f.write(json.dumps(o) + "\n")
  return str(path)


MESSAGES = [{"role": "system", "content": "rank the candidates"},
            {"role": "user", "content": "red lipstick or shampoo?"}]


def inputs_and_ids(tok):
  """Five lines of all three kinds, and the prompt ids each must decode from."""
  text = "a shampoo that smells"
  chat = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                 enable_thinking=True)
  lines = [{"prompt_ids": [5, 6, 7, 8, 9, 10, 11]}, {"prompt": text}, {"messages": MESSAGES},
           {"prompt_ids": [12, 13, 14]}, {"prompt_ids": [20, 21, 22, 23, 24]}]
  ids = [[5, 6, 7, 8, 9, 10, 11], tok.encode(text, add_special_tokens=False),
         tok.encode(chat, add_special_tokens=False), [12, 13, 14], [20, 21, 22, 23, 24]]
  assert chat.endswith("<|im_start|>assistant\n") and len(ids[2]) > 10
  return lines, ids


def gen_config(model_dir, inp, out, **decode):
  c = load_config("generate.py")
  c.model_dir, c.input, c.output = model_dir, inp, out
  c.batch_size = 2  # 5 lines: the last batch is padded
  c.decode.update(dict(block_size=1, threshold=1.0, max_new_tokens=MAX_NEW, temperature=0.0))
  c.decode.update(decode)
  return c


def read_out(path):
  with open(path) as f:
    return [json.loads(l) for l in f]


def test_ar_generate_matches_transformers(dirs, tmp_path):
  import torch
  tok, eos = dirs["tok"], dirs["tids"].eos_id
  lines, ids = inputs_and_ids(tok)
  inp = write_lines(tmp_path / "in.jsonl", lines)
  out = str(tmp_path / "out.jsonl")
  assert main_lib.run(gen_config(dirs["hf"], inp, out), None) == out
  recs = read_out(out)
  assert len(recs) == len(lines)
  for i, (rec, prm) in enumerate(zip(recs, ids)):
    assert set(rec) == {"output_ids", "text", "nfe", "commit_step", "logprob"}
    with torch.no_grad():
      ref = dirs["model"].generate(torch.tensor([prm]), do_sample=False, max_new_tokens=MAX_NEW,
                                   eos_token_id=eos, pad_token_id=dirs["tids"].pad_id,
                                   attention_mask=torch.ones(1, len(prm), dtype=torch.long))
    theirs = ref[0, len(prm):].tolist()
    assert rec["output_ids"] == theirs, f"line {i + 1}"
    k = len(theirs)
    assert rec["text"] == tok.decode(theirs, skip_special_tokens=False)
    # AR: one commit per step; the first token comes from the prefill (no NFE counted for it).
    assert rec["commit_step"] == list(range(k))
    assert rec["nfe"] == k - 1
    assert len(rec["logprob"]) == k and all(lp <= 1e-6 for lp in rec["logprob"])
    with torch.no_grad():  # the recorded logprob of the first token is the prefill's
      lp0 = torch.log_softmax(dirs["model"](torch.tensor([prm])).logits[0, -1].double(), -1)
    assert rec["logprob"][0] == pytest.approx(float(lp0[theirs[0]]), abs=1e-3)


def test_block_diffusion_on_the_fly_matches_reference(dirs, tmp_path):
  from dgr2_jax.decode import reference, sampler
  from dgr2_jax.model import checkpoint
  tok = dirs["tok"]
  lines, ids = inputs_and_ids(tok)
  inp = write_lines(tmp_path / "in.jsonl", lines)
  out = str(tmp_path / "out.jsonl")
  cfg = gen_config(dirs["ours"], inp, out, block_size=4, threshold=0.6, max_new_tokens=MAX_NEW)
  main_lib.run(cfg, None)
  recs = read_out(out)
  mc, params = checkpoint.load_model_dir(dirs["ours"])
  assert mc.attention == "causal" and mc.mask_token_id is None  # an AR checkpoint
  dc = sampler.DecodeConfig(block_size=4, threshold=0.6, max_new_tokens=MAX_NEW,
                            eos_ids=(dirs["tids"].eos_id,), mask_token_id=dirs["tids"].mask_id,
                            pad_id=dirs["tids"].pad_id)
  # Step numbers are shared by the rows of a batch (lockstep blocks): reference per static batch
  # of 2, the last one padded with a copy of its prompt as the stage does.
  for s in range(0, len(ids), 2):
    chunk = ids[s:s + 2]
    ref = reference.reference_decode(mc, params, chunk + [chunk[-1]] * (2 - len(chunk)), dc)
    for j in range(len(chunk)):
      rec, k = recs[s + j], len(recs[s + j]["output_ids"])
      assert rec["output_ids"] == ref["output_ids"][j], f"line {s + j + 1}"
      assert rec["commit_step"] == ref["commit_step"][j][:k].tolist()
      assert rec["nfe"] == int(ref["nfe"][j])
  # Parallel commits happened somewhere (fewer steps than tokens), else the test proves little.
  assert any(len(set(r["commit_step"])) < len(r["commit_step"]) for r in recs)


@pytest.mark.parametrize("text,line,match", [
    ('{"prompt_ids": [1, 2]}\n{"prompt_ids": [1, 2\n', 2, "not valid JSON"),
    ('{"prompt_ids": [1, 2]}\n{"prompt_ids": [1]}\n{"text": "hi"}\n', 3, "exactly one of"),
    ('{"prompt_ids": [1, "a"]}\n', 1, "prompt_ids must be"),
    ('{"prompt_ids": [1]}\n\n{"prompt_ids": [1]}\n', 2, "empty line"),
    ('{"messages": [{"role": "user"}]}\n', 1, "messages must be"),
    ('[1, 2]\n', 1, "expected a JSON object"),
    ('{"prompt_ids": [1]}\n{"prompt_ids": [99999]}\n', 2, "outside the vocabulary"),
])
def test_malformed_line_names_line_and_leaves_no_output(dirs, tmp_path, text, line, match):
  inp = write_lines(tmp_path / "bad.jsonl", text)
  out = tmp_path / "out.jsonl"
  with pytest.raises(ValueError, match=rf"bad\.jsonl:{line}: .*{match}"):
    main_lib.run(gen_config(dirs["hf"], inp, str(out)), None)
  assert not out.exists()
  assert not [p for p in os.listdir(tmp_path) if p.startswith(".out.jsonl")]


def test_missing_mask_token_and_paths_fail_clearly(dirs, tmp_path):
  inp = write_lines(tmp_path / "in.jsonl", [{"prompt_ids": [1, 2, 3]}])
  out = tmp_path / "out.jsonl"
  with pytest.raises(ValueError, match="needs a mask token"):
    main_lib.run(gen_config(dirs["bare"], inp, str(out), block_size=4), None)
  with pytest.raises(ValueError, match="a 'prompt' line needs a tokenizer"):
    main_lib.run(gen_config(dirs["bare"], write_lines(tmp_path / "t.jsonl", [{"prompt": "x"}]),
                            str(out)), None)
  assert not out.exists()
  with pytest.raises(FileNotFoundError, match=r"config\.input"):
    main_lib.run(gen_config(dirs["hf"], str(tmp_path / "nope.jsonl"), str(out)), None)
  with pytest.raises(ValueError, match=r"config\.model_dir"):
    main_lib.run(gen_config("", inp, str(out)), None)
  with pytest.raises(ValueError, match=r"config\.decode\.max_new_tokens"):
    main_lib.run(gen_config(dirs["hf"], inp, str(out), block_size=3), None)
  assert generate_stage.prompt_slots([[1] * 65, [1]], 0) == 128
  with pytest.raises(ValueError, match=r"config\.max_prompt_len \(8\).*prompt 1"):
    generate_stage.prompt_slots([[1] * 9], 8)


def test_convert_stage_keeps_weights_and_sets_block_diffusion(dirs, tmp_path):
  from dgr2_jax.model import checkpoint
  workdir = str(tmp_path / "work")
  sft = os.path.join(workdir, "sft")
  with common.atomic_dir(sft, "sfthash") as tmp:  # a finished sft stage holding our model dir
    checkpoint.save_model_dir(os.path.join(tmp, "model"), *checkpoint.load_model_dir(dirs["ours"]),
                              tokenizer_src=dirs["ours"])
  config = load_config("demo.py", "no_teacher_rl")  # convert starts from the SFT model
  config.cft.block_size = 8
  out = convert_stage.run(config, workdir)
  assert out == os.path.join(workdir, "convert")
  src_cfg, src_params = checkpoint.load_model_dir(os.path.join(sft, "model"))
  cfg, params = checkpoint.load_model_dir(os.path.join(out, "model"))
  assert cfg == src_cfg.as_block_diffusion(8, dirs["tids"].mask_id)
  assert cfg.attention == "block_causal" and cfg.block_size == 8
  flat_a, flat_b = checkpoint.flatten(src_params), checkpoint.flatten(params)
  assert flat_a.keys() == flat_b.keys()
  for k in flat_a:
    np.testing.assert_array_equal(np.asarray(flat_a[k]), np.asarray(flat_b[k]), err_msg=k)
  # The source's config.json is untouched (never written through a hard link).
  assert checkpoint.load_model_dir(os.path.join(sft, "model"))[0].attention == "causal"
  # Fresh: no rewrite; a different block size re-converts.
  mtime = os.path.getmtime(os.path.join(out, "DONE.json"))
  convert_stage.run(config, workdir)
  assert os.path.getmtime(os.path.join(out, "DONE.json")) == mtime
  config.cft.block_size = 4
  convert_stage.run(config, workdir)
  assert checkpoint.load_model_dir(os.path.join(out, "model"))[0].block_size == 4


def test_convert_needs_the_teacher_model(tmp_path):
  with pytest.raises(FileNotFoundError, match="run the 'teacher_rl' stage before 'convert'"):
    convert_stage.run(load_config("demo.py"), str(tmp_path))
  with pytest.raises(FileNotFoundError, match="run the 'sft' stage before 'convert'"):
    convert_stage.run(load_config("demo.py", "no_teacher_rl"), str(tmp_path))
