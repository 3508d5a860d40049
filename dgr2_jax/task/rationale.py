"""Built-in rationale generator: deterministic reasoning grounded in item metadata.

For one example it compares each candidate with the history by category path (shared prefix
below the top level), brand, and price band, and writes sentences that name the SIDs involved.
The ranking puts one candidate first and keeps the retriever's order for the rest:
- `knows_target=True` (training traces): the held-out target goes first;
- `knows_target=False`: the candidate with the best metadata score goes first (ties: retriever
  order), i.e. a rationale that does not peek at the label; in the 'terse' style the score is
  the relation to the most recent purchase (the first candidate, in retriever order, with the
  strongest of `RELATIONS`), so the choice is a function of what the minimal prompt shows.
Styles (`STYLES`): 'full' (sentences, below) and 'terse' (for tiny CPU models: three short
sentences, `Recent <sid> <brand> <leaf>. <relation> #<k> <sid>. So #<k> goes first, the others
keep their order.`, where the relation of the chosen candidate to the most recent purchase is
one of `RELATIONS` and k its 1-based position, as numbered by the 'minimal' prompt). Why this
shape: naming the recent brand and leaf right before the choice is a chain of thought a 3-layer
model can follow, and choosing by a number puts the whole decision in one token; the SID is then
a copy of prompt line #k (choosing the SID token by token lets greedy decoding splice the codes
of two likely candidates into an item that is not a candidate). The closing sentence states the
plan of the answer and makes the reasoning ~28 demo-BPE tokens, so that a short answer starts
in the block after the one holding the choice, as in the paper's regime (~130 reasoning tokens,
the ranking written after whole blocks of reasoning): the answer block is then decoded with the
choice already in the KV cache, instead of in parallel with it.
'brief' is 'terse' without the SIDs (`Recent <brand> <leaf>. <relation> #<k>. So #<k> goes
first, the others keep their order.`): with real brand and category names the terse sentences run
to ~45 tokens and push the choice into the block the answer starts in; without the SIDs the
reasoning (~25 tokens) ends in the first block of 32, so the answer block is denoised with the
choice already committed; counted with `count_fn`, it is kept within `target_tokens` by cutting the
recent item's words from the end. A caller (the trace policy, task/policy.py) may fix the first
candidate and the relation the sentence names.
Length ('full'): sentences about the other candidates (retriever order), then about earlier history
items, are added while they bring the token count closer to `target_tokens`, counted with
`count_fn` (the tokenizer in use); so the mean length tracks the knob.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from dgr2_jax.task import prompts

STYLES = ("full", "terse", "brief")
# Relation of a candidate to the most recent purchase, strongest first (task/prompts.py, where the
# prompt may spell it out).
RELATIONS = prompts.RELATIONS
relation = prompts.relation
_BANDS = ((10.0, "under $10"), (25.0, "$10-25"), (50.0, "$25-50"), (float("inf"), "over $50"))


def price_band(price) -> str | None:
  if price is None:
    return None
  for hi, name in _BANDS:
    if float(price) < hi:
      return name
  return None


def _cats(item: dict) -> list[str]:
  c = [x for x in (item.get("categories") or []) if x]
  return c[1:] if len(c) > 1 else c


def _leaf(item: dict) -> str:
  c = _cats(item)
  return c[-1] if c else "item"


def _common_prefix(a: list[str], b: list[str]) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def _match(cand: dict, history: Sequence[dict]):
  """(depth, hist_index_of_best, brand_hits, band_match) of a candidate against the history."""
  cc = _cats(cand)
  best, best_j = 0, -1
  for j, h in enumerate(history):
    d = _common_prefix(cc, _cats(h))
    if d >= best and d > 0:  # later (more recent) wins ties
      best, best_j = d, j
  b = prompts.brand(cand)
  brand_hits = [j for j, h in enumerate(history) if b is not None and prompts.brand(h) == b]
  bands = [price_band(h.get("price")) for h in history if h.get("price") is not None]
  major = max(set(bands), key=bands.count) if bands else None
  band_ok = major is not None and price_band(cand.get("price")) == major
  return best, best_j, brand_hits, band_ok


def score(cand: dict, history: Sequence[dict]) -> float:
  depth, _, brand_hits, band_ok = _match(cand, history)
  return 2.0 * depth + 1.5 * bool(brand_hits) + 0.5 * band_ok


def _profile(history: Sequence[dict], hist_sids: Sequence[str]) -> str:
  if not history:
    return "The user has no earlier purchases, so the candidates are judged on their own."
  tops = [(_cats(h) or ["other"])[0] for h in history]
  top = max(dict.fromkeys(tops), key=tops.count)
  brands = [b for b in map(prompts.brand, history) if b]
  bands = [price_band(h.get("price")) for h in history if h.get("price") is not None]
  s = f"The history has {len(history)} items, mostly {top} ({tops.count(top)} of {len(history)})"
  if brands:
    s += ", brands " + ", ".join(list(dict.fromkeys(brands))[:3])
  if bands:
    s += f", usually priced {max(dict.fromkeys(bands), key=bands.count)}"
  return s + f". The most recent purchase is {hist_sids[-1]} ({_leaf(history[-1])})."


def _reason_first(cand, sid, history, hist_sids) -> str:
  depth, j, brand_hits, band_ok = _match(cand, history)
  parts = []
  if depth > 0:
    path = " > ".join(_cats(cand)[:depth])
    parts.append(f"shares the category path {path} with {hist_sids[j]}")
  if brand_hits:
    parts.append(f"has the brand {prompts.brand(cand)} bought before as "
                 f"{hist_sids[brand_hits[-1]]}")
  if band_ok:
    parts.append("fits the usual price range")
  if not parts:
    last = _leaf(history[-1]) if history else "earlier"
    return (f"Candidate {sid} ({_leaf(cand)}) is a complementary need next to the recent "
            f"{last} purchase, a natural next step in the routine.")
  return f"Candidate {sid} ({_leaf(cand)}) " + ", ".join(parts) + ", so it is the best match."


def _other(cand, sid, history, hist_sids) -> str:
  depth, j, brand_hits, _ = _match(cand, history)
  if depth >= 2:
    return f"{sid} ({_leaf(cand)}) is close to {hist_sids[j]} but less specific to the recent need."
  if brand_hits:
    return f"{sid} ({_leaf(cand)}) repeats the brand {prompts.brand(cand)} but in another category."
  if depth == 1:
    return f"{sid} ({_leaf(cand)}) only shares the broad area {_cats(cand)[0]}."
  return f"{sid} ({_leaf(cand)}) has little overlap with the history."


def terse(history: Sequence[dict], hist_sids: Sequence[str], cand: dict, sid: str, pos: int,
          rel: str | None = None) -> str:
  """`Recent <sid> <brand> <leaf>. <relation> #<k> <sid>. So #<k> goes first, ...` (see the
  module docstring)."""
  head = f"Recent {hist_sids[-1]} {prompts.brand_leaf(history[-1])}. " if history else ""
  return head + (f"{rel or relation(cand, history)} #{pos + 1} {sid}. "
                 f"So #{pos + 1} goes first, the others keep their order.")


def brief(history: Sequence[dict], pos: int, rel: str, recent: str | None = None) -> str:
  """`Recent <brand> <leaf>. <relation> #<k>. So #<k> goes first, ...` (module docstring);
  `recent` replaces `<brand> <leaf>`."""
  if recent is None and history:
    recent = prompts.brand_leaf(history[-1])
  head = f"Recent {recent}. " if history else ""
  return head + f"{rel} #{pos + 1}. So #{pos + 1} goes first, the others keep their order."


@dataclasses.dataclass(frozen=True)
class Pick:
  """A caller's choice of the first candidate (e.g. the trace policy's, task/policy.py)."""
  first: int                          # 0-based candidate position
  relation_text: str | None = None    # the relation the terse/brief sentence names (None: the candidate's)


def generate(history: Sequence[dict], hist_sids: Sequence[str], candidates: Sequence[dict],
             cand_sids: Sequence[str], target_pos: int | None = None, *, knows_target: bool = True,
             target_tokens: int = 130, count_fn: Callable[[str], int] | None = None,
             style: str = "full", pick: Pick | None = None) -> tuple[str, list[int]]:
  """Returns (reasoning text, ranking as 0-based candidate positions). `pick` overrides
  `knows_target`."""
  if style not in STYLES:
    raise ValueError(f"task.rationale_style must be one of {STYLES}, got {style!r}")
  count = count_fn or (lambda s: max(1, round(len(s.split()) * 1.3)))
  n = len(candidates)
  first, relation_text = (pick.first, pick.relation_text) if pick is not None else (None, None)
  if first is not None:
    if not 0 <= first < n:
      raise ValueError(f"first={first} is not a candidate position (0..{n - 1})")
  elif knows_target:
    if target_pos is None or not 0 <= target_pos < n:
      raise ValueError(f"knows_target=True needs a target among the candidates, got {target_pos}")
    first = target_pos
  elif style in ("terse", "brief"):
    first = min(range(n), key=lambda k: (RELATIONS.index(relation(candidates[k], history)), k))
  else:
    scores = [score(c, history) for c in candidates]
    first = max(range(n), key=lambda k: (scores[k], -k))
  ranking = [first] + [k for k in range(n) if k != first]
  rel = relation_text or relation(candidates[first], history)
  if style == "brief":
    # At most `target_tokens` (when counted): the recent item's words are cut from the end, so a
    # long brand or leaf name never pushes the choice past the block the reasoning must end in.
    text, words = brief(history, first, rel), prompts.brand_leaf(history[-1]).split() if history else []
    while count_fn is not None and len(words) > 1 and count(text) > target_tokens:
      words = words[:-1]
      text = brief(history, first, rel, " ".join(words))
    return text, ranking
  if style == "terse":
    return terse(history, hist_sids, candidates[first], cand_sids[first], first, rel), ranking
  head = [_profile(history, hist_sids),
          _reason_first(candidates[first], cand_sids[first], history, hist_sids)]
  tail = (f"So {cand_sids[first]} goes first and the other candidates keep the retriever's order."
          if first else f"So {cand_sids[first]} stays first and the retriever's order is kept.")
  extra = [_other(candidates[k], cand_sids[k], history, hist_sids) for k in ranking[1:]]
  extra += [f"Earlier, {hist_sids[j]} ({_leaf(history[j])}) shows a lasting interest."
            for j in range(len(history) - 2, -1, -1)]
  # Sentences are counted with a leading space: byte-level BPE never merges across it, so the
  # sum equals the count of the joined text.
  total = sum(count(" " + s) for s in head + [tail])
  if total > target_tokens and history:  # over budget already: the one-line profile
    short = f"The most recent purchase is {hist_sids[-1]} ({_leaf(history[-1])})."
    total += count(" " + short) - count(" " + head[0])
    head[0] = short
  body = list(head)
  for s in extra:
    c = count(" " + s)
    if abs(total + c - target_tokens) >= abs(total - target_tokens):
      break
    body.append(s)
    total += c
  return " ".join(body + [tail]), ranking


def template_texts() -> list[str]:
  """Fixed rationale phrases (for training the demo BPE)."""
  return ["Recent " + " ".join(RELATIONS),
          "The history has items, mostly , brands , usually priced "
          "The most recent purchase is ",
          "Candidate shares the category path with has the brand bought before as fits the usual "
          "price range, so it is the best match.",
          "is a complementary need next to the recent purchase, a natural next step in the routine.",
          "is close to but less specific to the recent need. repeats the brand but in another "
          "category. only shares the broad area has little overlap with the history.",
          "So goes first and the other candidates keep the retriever's order. stays first and the "
          "retriever's order is kept. Earlier, shows a lasting interest.",
          "The user has no earlier purchases, so the candidates are judged on their own.",
          " So # goes first, the others keep their order.",
          "Recent . Same brand #. Same type #. Brand seen #. Top pick #. So # goes first, the "
          "others keep their order.",
          "Recent . Often bought next #. Bought next twice #. Bought next once #. So # goes "
          "first, the others keep their order."] + [
              n for _, n in _BANDS]
