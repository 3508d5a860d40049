"""The tiny demo tokenizer and the special-token ids every task module needs.

No hub access at run time, so CPU demos use a small byte-level BPE trained on the item texts,
the rationale templates and the JSON punctuation of the answer format. It is byte-level so that
decoding is lossless (the answer parser reads decoded text), and it is saved as a plain HF
tokenizer directory that `transformers.AutoTokenizer.from_pretrained` loads, with a Qwen3-style
chat template (`<|im_start|>role\\n...<|im_end|>\\n`, honouring `enable_thinking`).

Special/added tokens (single ids): `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (EOS),
`<|mask|>` (the diffusion mask), `<think>`, `</think>`, and every SID token (`<a_0>`, ...).
The same task code runs unchanged on a real Qwen3 tokenizer directory (its own template).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Sequence

from dgr2_jax.fileio import InputError

PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
THINK = "<think>"
END_THINK = "</think>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END, MASK)
THINK_TOKENS = (THINK, END_THINK)

# Qwen3-style template: same role framing as Qwen3; with `enable_thinking=False` the generation
# prompt pre-fills an empty think block (as Qwen3 does). Only what re-ranking prompts need.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


@dataclasses.dataclass(frozen=True)
class TokenIds:
  """Ids of the tokens the pipeline, decoder and parser need."""
  pad_id: int
  eos_id: int
  im_start_id: int
  mask_id: int | None
  think_id: int
  end_think_id: int


def tokenizer_dir(config, workdir: str) -> str:
  """The tokenizer in use: `config.task.tokenizer` or the demo one the traces stage built."""
  return config.task.tokenizer or os.path.join(workdir, "traces", "tokenizer")


def build_demo_tokenizer(texts: Iterable[str], sid_tokens: Sequence[str], out_dir: str,
                         vocab_size: int = 2048) -> str:
  """Trains a small byte-level BPE on `texts`, adds special + SID tokens, saves to `out_dir`.

  Returns `out_dir`. Deterministic for the same inputs (the BPE trainer is single-pass).
  """
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  import transformers

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=2, show_progress=False,
      special_tokens=list(SPECIAL_TOKENS) + list(THINK_TOKENS),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(list(texts), trainer=trainer)
  # SID tokens are ordinary added tokens (as `<think>` is in Qwen3): never split, not special.
  tok.add_tokens([tokenizers.AddedToken(t, normalized=False, special=False)
                  for t in THINK_TOKENS])
  tok.add_tokens([tokenizers.AddedToken(t, normalized=False, special=False)
                  for t in sid_tokens])
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, pad_token=PAD, eos_token=IM_END, mask_token=MASK,
      additional_special_tokens=[IM_START], model_max_length=32768)
  fast.chat_template = CHAT_TEMPLATE
  os.makedirs(out_dir, exist_ok=True)
  fast.save_pretrained(out_dir)
  return out_dir


def demo_corpus(items: Sequence[dict]) -> list[str]:
  """Texts the demo BPE is trained on: item metadata, prompt/rationale templates, JSON."""
  from dgr2_jax.task import prompts, rationale
  # BPE merges need a pair seen twice (min_frequency=2), and merges are taken most frequent
  # first until the vocabulary is full: fixed texts go in twice, and once per 100 items beyond
  # that, so each template word becomes one token with a real catalogue too (12k Beauty items'
  # names otherwise fill the vocabulary and split "goes" into 'g' 'oes').
  reps = max(2, len(items) // 100)
  out = reps * (list(prompts.template_texts()) + list(rationale.template_texts()))
  out.append('{"ranking": ["", ""]}')
  out += reps * ['{"ranking": [' + ", ".join(str(k) for k in range(1, 21)) + "]}"]
  for it in items:
    out.append(it.get("title") or "")
    out.append(" > ".join(it.get("categories") or []))
    if it.get("brand"):
      out.append(str(it["brand"]))
    # Mid-line form (after a SID, as in every prompt variant): byte-level BPE keeps the leading
    # space, so ' Saffron' is a different word from 'Saffron'.
    out.append(" " + prompts.brand_leaf(it))
    if it.get("price") is not None:
      out.append(f"${it['price']:.2f}")
  return out


def load_tokenizer(path: str):
  """AutoTokenizer from a local directory (never the hub)."""
  import transformers
  if not os.path.isdir(path):
    raise FileNotFoundError(f"tokenizer directory not found: {path}")
  for name in ("tokenizer.json", "tokenizer_config.json"):  # a truncated file: name it, not a traceback
    file = os.path.join(path, name)
    if os.path.isfile(file):
      try:
        with open(file, encoding="utf-8") as f:
          json.load(f)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{file}: not valid JSON ({e}); truncated? copy the tokenizer again") from None
  try:
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
  except (OSError, ValueError, KeyError, TypeError) as e:
    msg = " ".join(str(e).split())[:300]
    raise InputError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {msg})") from None


def token_ids(tokenizer) -> TokenIds:
  """Resolves the ids of the pad/EOS/mask/think tokens; errors name the missing token."""
  vocab = tokenizer.get_vocab()

  def need(t):
    if t not in vocab:
      raise ValueError(f"tokenizer lacks required token {t!r}")
    return vocab[t]

  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else need(PAD)
  return TokenIds(pad_id=int(pad), eos_id=need(IM_END), im_start_id=need(IM_START),
                  mask_id=vocab.get(MASK), think_id=need(THINK), end_think_id=need(END_THINK))
