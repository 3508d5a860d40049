"""The answer format, its parser, and the failure taxonomy of the paper.

Format: `<think>REASONING</think>{"ranking": ["<a_1><b_2><c_3><d_0>", ...]}` then EOS: the
candidates' SIDs (the paper's format, `task.answer_ids='sid'`), or `{"ranking": [3, 1, 2, ...]}`:
the 1-based candidate numbers the prompt shows as `#k` (`task.answer_ids='number'`, the tiny
demo's choice: a 3-layer model writes a one-token number far more reliably than a 3-token SID
picked by position). The parser reads both, so every consumer is format-agnostic.

Parsing rules (documented contract; tests pin each one):
- Trailing EOS/pad strings (`<|im_end|>`, `<|endoftext|>`) and anything after them are cut.
- `</think>` is required (`require_think=True`): the answer is the text after the LAST `</think>`,
  so SIDs repeated inside the reasoning never count. Missing `</think>` => unparseable
  (the model never finished reasoning, e.g. truncated at the length limit).
- In the answer text, the first `{...}` that JSON-decodes to an object with a "ranking" list of
  all strings or all integers is used; prose before or after it is tolerated. None =>
  unparseable (truncated JSON, wrong key, non-list, mixed or other entry types, booleans).
- String entries are normalised before comparison: Unicode NFKC (full-width `＜ａ＿１＞` ->
  `<a_1>`), then all whitespace and zero-width characters removed (`"<a_1> <b_2>"` ->
  `"<a_1><b_2>"`). Integer entries k in 1..N stand for candidate #k's SID; any other integer is
  out of set (kept in `ranking` as `"#k"`).

Verdict precedence (exactly one verdict per output, so the rates sum to 1):
  unparseable > out_of_set > duplicate > omission > valid.
Why: an out-of-set id that takes a candidate's place also causes an omission, and a duplicate in
a 10-long list also causes one; the root cause is reported, and `omission` is left for lists
that are merely short. The flags of every mode present are kept too (`flags`).
An invalid output is scored with the retriever's order (fallback), counted in metrics.
"""

from __future__ import annotations

import dataclasses
import json
import re
import unicodedata
from typing import Sequence

VALID = "valid"
DUPLICATE = "duplicate"
OMISSION = "omission"
OUT_OF_SET = "out_of_set"
UNPARSEABLE = "unparseable"
VERDICTS = (VALID, DUPLICATE, OMISSION, OUT_OF_SET, UNPARSEABLE)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_STOP_STRINGS = ("<|im_end|>", "<|endoftext|>")
_ZERO_WIDTH = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff"), None)
_WS = re.compile(r"\s+")


@dataclasses.dataclass(frozen=True)
class Parsed:
  """Parser result. `ranking`: normalised SIDs as written (may be invalid); `positions`: the
  ranking as 0-based indices into the candidate list when valid, else the retriever order."""
  verdict: str
  ranking: tuple[str, ...]
  positions: tuple[int, ...]
  reasoning: str | None
  flags: frozenset = frozenset()

  @property
  def valid(self) -> bool:
    return self.verdict == VALID


ANSWER_IDS = ("sid", "number")


def format_answer(ranking: Sequence[str | int]) -> str:
  return json.dumps({"ranking": list(ranking)}, ensure_ascii=False)


def format_response(reasoning: str, ranking: Sequence[str | int]) -> str:
  """The assistant message text without EOS (the pipeline appends the EOS token)."""
  return f"{THINK_OPEN}{reasoning}{THINK_CLOSE}{format_answer(ranking)}"


def ranking_entries(order: Sequence[int], candidate_sids: Sequence[str],
                    answer_ids: str = "sid") -> list:
  """The answer list for a ranking given as 0-based candidate positions."""
  if answer_ids == "sid":
    return [candidate_sids[k] for k in order]
  if answer_ids == "number":
    return [int(k) + 1 for k in order]
  raise ValueError(f"task.answer_ids must be one of {ANSWER_IDS}, got {answer_ids!r}")


def normalize_sid(s: str) -> str:
  s = unicodedata.normalize("NFKC", s).translate(_ZERO_WIDTH)
  return _WS.sub("", s)


def split_response(text: str) -> tuple[str | None, str | None]:
  """(reasoning, answer_text); either is None when the structure is missing."""
  for stop in _STOP_STRINGS:
    k = text.find(stop)
    if k >= 0:
      text = text[:k]
  k = text.rfind(THINK_CLOSE)
  if k < 0:
    return None, None
  head = text[:k]
  j = head.find(THINK_OPEN)
  reasoning = head[j + len(THINK_OPEN):] if j >= 0 else head
  return reasoning, text[k + len(THINK_CLOSE):]


def _find_ranking(answer: str) -> list | None:
  dec = json.JSONDecoder()
  start = answer.find("{")
  while start >= 0:
    try:
      obj, _ = dec.raw_decode(answer, start)
    except json.JSONDecodeError:
      obj = None
    if isinstance(obj, dict) and isinstance(obj.get("ranking"), list):
      r = obj["ranking"]
      sids = all(isinstance(x, str) for x in r)
      numbers = all(isinstance(x, int) and not isinstance(x, bool) for x in r)
      return r if sids or numbers else None
    start = answer.find("{", start + 1)
  return None


def parse_response(text: str, candidate_sids: Sequence[str], require_think: bool = True) -> Parsed:
  """Parses a decoded assistant message against the candidate list (retriever order)."""
  cands = [normalize_sid(c) for c in candidate_sids]
  index = {c: k for k, c in enumerate(cands)}
  if len(index) != len(cands):
    raise ValueError(f"candidate SIDs are not unique: {list(candidate_sids)}")
  fallback = tuple(range(len(cands)))
  reasoning, answer = split_response(text)
  if answer is None and not require_think:
    answer = text
  ranking = _find_ranking(answer) if answer is not None else None
  if ranking is None:
    return Parsed(UNPARSEABLE, (), fallback, reasoning, frozenset([UNPARSEABLE]))
  if ranking and isinstance(ranking[0], int):
    ranking = tuple(cands[k - 1] if 1 <= k <= len(cands) else f"#{k}" for k in ranking)
  else:
    ranking = tuple(normalize_sid(x) for x in ranking)
  flags = set()
  if any(x not in index for x in ranking):
    flags.add(OUT_OF_SET)
  in_set = [x for x in ranking if x in index]
  if len(set(in_set)) != len(in_set):
    flags.add(DUPLICATE)
  if len(set(in_set)) < len(cands):
    flags.add(OMISSION)
  for verdict in (OUT_OF_SET, DUPLICATE, OMISSION):
    if verdict in flags:
      return Parsed(verdict, ranking, fallback, reasoning, frozenset(flags))
  return Parsed(VALID, ranking, tuple(index[x] for x in ranking), reasoning, frozenset())
