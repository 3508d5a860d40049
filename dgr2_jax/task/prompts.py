"""Prompt rendering for the re-ranking task, always through the tokenizer's own chat template.

A prompt is a system message (expert re-ranker role + structured output specification) and a user
message (the purchase history and the retriever's candidates, each item as SID + metadata).
Variants: `compact` (SID + short title + leaf category; short prompts for CPU runs) and `full`
(SID + full title + category path + brand + price for history and candidates, plus a longer
instruction; towards the paper's ~2200-token prompts with a real Qwen3 tokenizer), and `minimal`
(no system message, one `SID brand leaf` line per history item and `#k SID brand leaf` per
candidate: ~110 demo-BPE tokens for 2 history items and 10 candidates, for tiny CPU models that
must learn the format from a few thousand examples).

Prompts that are too long for the static prompt length drop history items from the OLDEST side
(`render_prompt_ids`), never candidates.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from dgr2_jax.task import copurchase

VARIANTS = ("compact", "full", "minimal")

SYSTEM_COMPACT = (
    "You are an expert re-ranker for a shopping recommender. Given a user's purchase history "
    "and candidate items, reason briefly about the user's interests, then rank all candidates.\n"
    "Output: <think>your reasoning</think> then JSON {\"ranking\": [SID, ...]} listing every "
    "candidate SID exactly once, best first.")

SYSTEM_FULL = (
    "You are an expert re-ranker for an e-commerce recommendation system. Each item is identified "
    "by a semantic identifier (SID) made of four tokens such as <a_1><b_2><c_3><d_0>; items with "
    "similar SID prefixes are semantically related. You receive a user's purchase history, in "
    "time order with the most recent purchase last, and a list of candidate items proposed by a "
    "retrieval model, in the retriever's order. Your task is to predict which candidate the user "
    "will purchase next and to re-rank all candidates accordingly.\n\n"
    "Reason step by step before answering. Ground every statement in the item information given: "
    "compare the candidates with the history by category path, brand and price range, weigh "
    "recent purchases more than old ones, and consider complementary as well as repeat needs. "
    "Refer to items by their SIDs exactly as written.\n\n"
    "Output format (strict):\n"
    "1. Write your reasoning inside <think> and </think>.\n"
    "2. Immediately after </think>, output a single JSON object with one key, \"ranking\", whose "
    "value is a list of candidate SID strings, most likely next purchase first.\n"
    "3. The ranking must be a permutation of the candidate list: every candidate SID exactly once, "
    "no duplicates, no omissions, and no SIDs that are not candidates.\n"
    "4. Output nothing after the JSON object.\n"
    "Example: <think>...</think>{\"ranking\": [\"<a_1><b_2><c_3><d_0>\", ...]}")


def short_title(title: str | None, max_words: int = 6) -> str:
  words = (title or "").split()
  return " ".join(words[:max_words]) + (" ..." if len(words) > max_words else "")


def _category(item: dict, full: bool) -> str:
  cats = [c for c in (item.get("categories") or []) if c]
  if not cats:
    return "unknown"
  # The top level ('Beauty') is shared by every item; it carries no signal.
  cats = cats[1:] if len(cats) > 1 else cats
  return " > ".join(cats) if full else cats[-1]


def brand(item: dict) -> str | None:
  """The item's brand; None when missing or Beauty's placeholder 'Unknown'."""
  b = item.get("brand")
  return None if not b or b == "Unknown" else str(b)


def brand_leaf(item: dict) -> str:
  """`<brand> <leaf category>`: the words of a `minimal` item line (and of the terse rationale)."""
  return f"{brand(item) or 'unknown'} {_category(item, False)}"


# Relation of a candidate to the most recent purchase, strongest first; each is visible in every
# prompt variant (brand and leaf category of the candidate, the last purchase and the history).
RELATIONS = ("Same brand", "Same type", "Brand seen", "Top pick")


def relation(cand: dict, history: Sequence[dict]) -> str:
  """The first of RELATIONS that holds between `cand` and the history (its last item)."""
  if history:
    last, cb = history[-1], brand(cand)
    if cb is not None and cb == brand(last):
      return RELATIONS[0]
    if _category(cand, False) == _category(last, False):
      return RELATIONS[1]
    if cb is not None and any(brand(h) == cb for h in history):
      return RELATIONS[2]
  return RELATIONS[3]


def item_line(item: dict, sid: str, variant: str, short_words: int = 6) -> str:
  if variant == "minimal":
    return f"{sid} {brand_leaf(item)}"
  if variant == "compact":
    return f"{sid} {short_title(item.get('title'), short_words)} ({_category(item, False)})"
  parts = [f"{sid}", f"title: {item.get('title') or 'unknown'}",
           f"category: {_category(item, True)}"]
  if item.get("brand") and item["brand"] != "Unknown":
    parts.append(f"brand: {item['brand']}")
  if item.get("price") is not None:
    parts.append(f"price: ${float(item['price']):.2f}")
  return " | ".join(parts)


def relation_mark(cand: dict, history: Sequence[dict], next_tier: str | None = None,
                  brand_relations: bool = True) -> str:
  """` (same brand)`, ` (often bought next, same brand)` etc. after a candidate line
  (`task.mark_relations`, `task.mark_copurchase`); '' when nothing holds."""
  rel = relation(cand, history) if brand_relations else RELATIONS[-1]
  marks = [m.lower() for m in (next_tier, rel if rel != RELATIONS[-1] else None) if m]
  return f" ({', '.join(marks)})" if marks else ""


def build_messages(history: Sequence[int], candidates: Sequence[int], items: Sequence[dict],
                   sids: Sequence[str], variant: str = "compact",
                   short_words: int = 6, mark_relations: bool = False,
                   bought_next: Sequence[int] | None = None) -> list[dict]:
  """Chat messages (system + user) for one example; history is oldest first. `mark_relations`
  (minimal variant): each candidate line ends with its relation to the last purchase, e.g.
  `#3 <sid> Acme Brush (same brand)`, the evidence the brief rationale acts on, spelled out: a
  3-layer model does not learn to match multi-token brand names across the prompt on its own.
  `bought_next` (minimal variant; per candidate, task/copurchase.py): its tier leads the mark,
  e.g. `(often bought next, same brand)`."""
  if variant not in VARIANTS:
    raise ValueError(f"task.prompt_variant must be one of {VARIANTS}, got {variant!r}")
  if variant == "minimal":
    hist = "\n".join(item_line(items[i], sids[i], variant) for i in history)
    hist_items = [items[i] for i in history]
    tiers = ([copurchase.tier(n) for n in bought_next] if bought_next is not None
             else [None] * len(candidates))
    marked = mark_relations or bought_next is not None
    mark = lambda k, i: (relation_mark(items[i], hist_items, tiers[k], mark_relations)
                         if marked else "")
    cand = "\n".join(f"#{k + 1} {item_line(items[i], sids[i], variant)}{mark(k, i)}"
                     for k, i in enumerate(candidates))
    return [{"role": "user", "content": f"History:\n{hist or '(none)'}\nCandidates:\n{cand}"}]
  hist = "\n".join(f"{k + 1}. {item_line(items[i], sids[i], variant, short_words)}"
                   for k, i in enumerate(history))
  cand = "\n".join(f"{k + 1}. {item_line(items[i], sids[i], variant, short_words)}"
                   for k, i in enumerate(candidates))
  if variant == "compact":
    system = SYSTEM_COMPACT
    user = f"History (oldest first):\n{hist or '(none)'}\nCandidates:\n{cand}"
  else:
    system = SYSTEM_FULL
    user = (f"Purchase history ({len(history)} items, oldest first, most recent last):\n"
            f"{hist or '(no earlier purchases)'}\n\n"
            f"Candidates from the retriever ({len(candidates)} items, retriever order):\n{cand}\n\n"
            "Re-rank all candidates. Reason inside <think></think>, then output the JSON ranking.")
  return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def render_prompt_text(tokenizer, messages: list[dict], enable_thinking: bool = True) -> str:
  """The tokenizer's chat template with the generation prompt (`<|im_start|>assistant\\n`).

  `enable_thinking=True` (Qwen3's default) leaves the think block to the response, which then
  begins with `<think>`; templates that ignore the flag are unaffected.
  """
  return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=enable_thinking)


def encode(tokenizer, text: str) -> list[int]:
  return list(tokenizer.encode(text, add_special_tokens=False))


def choice_after_id(tokenizer) -> int:
  """The token id of ' #', which precedes each candidate number the reasoning names (where the
  first pick is decided: CFT's and OPD's `choice_weight`), or -1 when this tokenizer splits it."""
  ids = encode(tokenizer, " #")
  return int(ids[0]) if len(ids) == 1 else -1


@dataclasses.dataclass(frozen=True)
class PromptStyle:
  """How a prompt is written (the `task` section's prompt settings; `build_messages`)."""
  variant: str = "compact"         # task.prompt_variant
  short_words: int = 6             # task.short_title_words
  mark_relations: bool = False     # task.mark_relations
  enable_thinking: bool = True     # task.enable_thinking (`render_prompt_text`)


def render_prompt_ids(tokenizer, history: Sequence[int], candidates: Sequence[int],
                      items: Sequence[dict], sids: Sequence[str], *, style: PromptStyle = PromptStyle(),
                      max_history: int = 20, max_len: int | None = None,
                      bought_next: Sequence[int] | None = None) -> tuple[list[int], int]:
  """Prompt token ids, dropping the oldest history items until it fits `max_len`.

  Returns (ids, n_history_dropped) where the count includes the `max_history` cap. Raises
  ValueError when even an empty history does not fit.
  """
  history = list(history)
  dropped = max(0, len(history) - max_history) if max_history > 0 else 0
  history = history[dropped:]
  while True:
    msgs = build_messages(history, candidates, items, sids, style.variant, style.short_words,
                          style.mark_relations, bought_next)
    ids = encode(tokenizer, render_prompt_text(tokenizer, msgs, style.enable_thinking))
    if max_len is None or len(ids) <= max_len:
      return ids, dropped
    if not history:
      raise ValueError(f"prompt with no history is {len(ids)} tokens > task.prompt_len={max_len}")
    # Drop several at once when far over budget (long histories), one at a time near the edge.
    step = max(1, min(len(history), (len(ids) - max_len) // 40))
    history = history[step:]
    dropped += step


def template_texts() -> list[str]:
  """Fixed prompt texts (for training the demo BPE)."""
  return [SYSTEM_COMPACT, SYSTEM_FULL, "History (oldest first):", "History:", "Candidates:",
          " ".join(f"#{k}" for k in range(1, 21)),
          "Purchase history", "Candidates from the retriever", "title: category: brand: price:",
          " (same brand) (same type) (brand seen)",
          " (often bought next) (bought next twice) (bought next once) (often bought next, same brand)"]
