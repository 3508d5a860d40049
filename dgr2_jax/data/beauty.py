"""Amazon Beauty readers (two input formats) and the TIGER/S3-Rec preprocessing.

Input formats in a folder (`data.dir`):
- 'tsv' (the shared folder): `interactions.tsv.gz` (or `.tsv`) with a header
  `user_id item_id timestamp [position]`, plus `items.jsonl` (`item_id`, `title`, `brand`, `price`,
  `categories` (one path, a list of strings), optional `asin`).
- 'mcauley' (the original 2014 files): `reviews_Beauty_5.json.gz` (one JSON object a line:
  `reviewerID`, `asin`, `unixReviewTime`, ...) plus `meta_Beauty.json.gz` (one Python dict literal a
  line: `asin`, `title`, `brand`, `price`, `categories` (list of paths)). Plain `.json` also works.

Preprocessing (`process`): k-core filter on users and items iterated to a fixed point; users numbered
in order of first appearance in the file; each user's sequence sorted by time with ties kept in file
order (stable; for 'tsv' the `position` column orders ties); items numbered in order of first
appearance walking the users' sequences in user order. On the McAuley files this is the S3-Rec / P5
numbering (item index = P5 id - 1). Every error is one line naming the file and line.
"""

from __future__ import annotations

import ast
import collections
import gzip
import html
import json
import os
import re
from typing import Any, Iterator

from dgr2_jax.fileio import InputError

TSV_INTERACTIONS = ("interactions.tsv.gz", "interactions.tsv")
TSV_ITEMS = ("items.jsonl",)
MCAULEY_REVIEWS = ("reviews_Beauty_5.json.gz", "reviews_Beauty_5.json")
MCAULEY_META = ("meta_Beauty.json.gz", "meta_Beauty.json")


def _open_text(path: str):
  if path.endswith(".gz"):
    return gzip.open(path, "rt", encoding="utf-8")
  return open(path, encoding="utf-8")


def _lines(path: str) -> Iterator[tuple[int, str]]:
  """(1-based line number, stripped line) for non-blank lines."""
  with _open_text(path) as f:
    for n, line in enumerate(f, 1):
      line = line.rstrip("\n").rstrip("\r")
      if line.strip():
        yield n, line


def _first_existing(d: str, names: tuple[str, ...]) -> str | None:
  for n in names:
    p = os.path.join(d, n)
    if os.path.exists(p):
      return p
  return None


def resolve_format(data_dir: str, fmt: str = "auto") -> tuple[str, dict[str, str]]:
  """Checks the folder and returns (format, {'interactions'|'reviews': path, 'items'|'meta': path})."""
  if not data_dir:
    raise ValueError("data.dir is empty: set --config.data.dir to the Beauty data folder")
  if not os.path.isdir(data_dir):
    raise FileNotFoundError(f"data.dir {data_dir!r} does not exist or is not a directory")
  if not os.listdir(data_dir):
    raise FileNotFoundError(f"data.dir {data_dir!r} is empty")
  if fmt not in ("auto", "tsv", "mcauley"):
    raise ValueError(f"data.format must be 'auto', 'tsv' or 'mcauley', got {fmt!r}")
  tsv = (_first_existing(data_dir, TSV_INTERACTIONS), _first_existing(data_dir, TSV_ITEMS))
  mc = (_first_existing(data_dir, MCAULEY_REVIEWS), _first_existing(data_dir, MCAULEY_META))
  if fmt == "auto":
    fmt = "tsv" if tsv[0] else "mcauley" if mc[0] else ""
  if fmt == "tsv" and all(tsv):
    return "tsv", {"interactions": tsv[0], "items": tsv[1]}
  if fmt == "mcauley" and all(mc):
    return "mcauley", {"reviews": mc[0], "meta": mc[1]}
  raise FileNotFoundError(
      f"data.dir {data_dir!r} (format {fmt or 'auto'}) lacks its files: need interactions.tsv.gz + "
      "items.jsonl, or reviews_Beauty_5.json.gz + meta_Beauty.json.gz")


def _clean_str(x: Any) -> str | None:
  if x is None:
    return None
  s = " ".join(html.unescape(str(x)).split())
  return s


def _clean_price(x: Any, where: str) -> float | None:
  if x is None or x == "":
    return None
  try:
    return float(x)
  except (TypeError, ValueError):
    raise InputError(f"{where}: price {x!r} is not a number") from None


def item_record(raw_id: str, d: dict, where: str) -> dict:
  cats = d.get("categories") or []
  if cats and isinstance(cats[0], (list, tuple)):
    # McAuley: several category paths; keep the first rooted at "Beauty" (RecBole keeps one path).
    paths = [list(p) for p in cats]
    cats = next((p for p in paths if p and p[0] == "Beauty"), paths[0])
  if not isinstance(cats, (list, tuple)) or not all(isinstance(c, str) for c in cats):
    raise InputError(f"{where}: categories must be a list of strings (or of lists), got {cats!r}")
  return {
      "raw_id": raw_id,
      "asin": str(d.get("asin") or ""),
      "title": _clean_str(d.get("title")) or "",
      "brand": _clean_str(d.get("brand")),
      "categories": [_clean_str(c) for c in cats],
      "price": _clean_price(d.get("price"), where),
  }


def read_tsv(paths: dict[str, str]) -> tuple[list[tuple[str, str, int, int]], dict[str, dict]]:
  """Returns (interactions [(user, item, timestamp, tie_order)] in file order, items by raw id)."""
  path = paths["interactions"]
  rows = []
  header = None
  for n, line in _lines(path):
    f = line.split("\t")
    if header is None:
      header = f
      if f[:3] != ["user_id", "item_id", "timestamp"]:
        raise InputError(f"{path}:{n}: header must start with user_id<TAB>item_id<TAB>timestamp, got {line!r}")
      has_pos = len(f) > 3 and f[3] == "position"
      continue
    if len(f) != len(header):
      raise InputError(f"{path}:{n}: expected {len(header)} tab-separated fields, got {len(f)}: {line!r}")
    try:
      ts = int(f[2])
      order = int(f[3]) if has_pos else len(rows)
    except ValueError:
      raise InputError(f"{path}:{n}: timestamp/position must be integers: {line!r}") from None
    rows.append((f[0], f[1], ts, order))
  if not rows:
    raise InputError(f"{path}: no interactions")
  ipath = paths["items"]
  items = {}
  for n, line in _lines(ipath):
    where = f"{ipath}:{n}"
    try:
      d = json.loads(line)
    except json.JSONDecodeError as e:
      raise InputError(f"{where}: malformed JSON ({e.msg})") from None
    if not isinstance(d, dict) or "item_id" not in d:
      raise InputError(f"{where}: expected a JSON object with an item_id")
    items[str(d["item_id"])] = item_record(str(d["item_id"]), d, where)
  return rows, items


_ASIN_RE = re.compile(r"""['"]asin['"]\s*:\s*['"]([^'"]+)['"]""")


def read_mcauley(paths: dict[str, str]) -> tuple[list[tuple[str, str, int, int]], dict[str, dict]]:
  """Same output as read_tsv, from the original McAuley review + metadata files."""
  path = paths["reviews"]
  rows = []
  for n, line in _lines(path):
    try:
      d = json.loads(line)
      rows.append((str(d["reviewerID"]), str(d["asin"]), int(d["unixReviewTime"]), len(rows)))
    except json.JSONDecodeError as e:
      raise InputError(f"{path}:{n}: malformed JSON ({e.msg})") from None
    except (KeyError, TypeError, ValueError):
      raise InputError(f"{path}:{n}: need reviewerID, asin and an integer unixReviewTime") from None
  if not rows:
    raise InputError(f"{path}: no interactions")
  wanted = {r[1] for r in rows}
  mpath = paths["meta"]
  items = {}
  for n, line in _lines(mpath):
    m = _ASIN_RE.search(line)
    if m is None:
      raise InputError(f"{mpath}:{n}: no 'asin' field")
    if m.group(1) not in wanted:  # the metadata covers far more items than the 5-core
      continue
    try:
      d = ast.literal_eval(line)
    except (ValueError, SyntaxError):
      raise InputError(f"{mpath}:{n}: malformed Python dict literal") from None
    if not isinstance(d, dict):
      raise InputError(f"{mpath}:{n}: expected a dict literal")
    items[str(d["asin"])] = item_record(str(d["asin"]), d, f"{mpath}:{n}")
  return rows, items


def read_dir(data_dir: str, fmt: str = "auto"):
  """(format, interactions, items, the paths read)."""
  fmt, paths = resolve_format(data_dir, fmt)
  rows, items = (read_tsv if fmt == "tsv" else read_mcauley)(paths)
  return fmt, rows, items, paths


def k_core(rows: list, k: int) -> list:
  """Drops rows of users / items with < k rows, repeatedly, until nothing changes (a true k-core)."""
  while True:
    uc = collections.Counter(r[0] for r in rows)
    ic = collections.Counter(r[1] for r in rows)
    kept = [r for r in rows if uc[r[0]] >= k and ic[r[1]] >= k]
    if len(kept) == len(rows):
      return kept
    rows = kept


def process(rows: list, items: dict[str, dict], min_count: int = 5, where: str = "items") -> dict:
  """k-core, stable time order, integer remapping. Returns a plain dict:

  users [raw user id per index], items [item dicts per index: item, raw_id, asin, title, brand,
  categories, price], sequences [[item index]], timestamps [[int]].
  """
  rows = k_core(rows, min_count)
  if not rows:
    raise InputError(f"no interactions left after the {min_count}-core filter")
  by_user: dict[str, list] = {}
  for r in rows:  # dict keeps first-appearance order
    by_user.setdefault(r[0], []).append(r)
  item_index: dict[str, int] = {}
  sequences, timestamps = [], []
  for u, rs in by_user.items():
    rs = sorted(rs, key=lambda r: (r[2], r[3]))  # sorted() is stable; tie_order breaks day ties
    seq = []
    for r in rs:
      if r[1] not in item_index:
        item_index[r[1]] = len(item_index)
      seq.append(item_index[r[1]])
    sequences.append(seq)
    timestamps.append([r[2] for r in rs])
  out_items = []
  for raw, idx in item_index.items():
    if raw not in items:
      raise InputError(f"item id {raw!r} from the interactions does not resolve in {where}")
    out_items.append({"item": idx, **items[raw]})
  return {"users": list(by_user), "items": out_items, "sequences": sequences, "timestamps": timestamps}


def stats(sequences: list[list[int]], n_items: int) -> dict:
  """Dataset statistics (exact; avg_seq_len unrounded)."""
  lens = [len(s) for s in sequences]
  counts = collections.Counter(i for s in sequences for i in s)
  n = sum(lens)
  return {
      "users": len(sequences),
      "items": n_items,
      "interactions": n,
      "avg_seq_len": n / max(len(sequences), 1),
      "min_seq_len": min(lens),
      "max_seq_len": max(lens),
      "min_item_count": min(counts.values()),
      "max_item_count": max(counts.values()),
      "sparsity": 1.0 - n / (len(sequences) * max(n_items, 1)),
  }


def format_stats(s: dict) -> str:
  return (f"users {s['users']:,}  items {s['items']:,}  interactions {s['interactions']:,}  "
          f"avg_seq_len {s['avg_seq_len']:.3f}")


def load_with_placeholder_sids(beauty_dir: str) -> dict:
  """{items, sids, sid_tokens, sequences} of a 'tsv' folder read as it is (items in file order, each
  user's interactions in file order, no k-core), with PLACEHOLDER SIDs: a unique 4-level code from
  the item index, not semantic. For the benchmarks that want the real catalogue's text lengths
  without the SID and retriever stages (benchmarks/task_stats.py, benchmarks/prefix_reuse.py)."""
  items = []
  with open(os.path.join(beauty_dir, "items.jsonl")) as f:
    for k, line in enumerate(f):
      r = json.loads(line)
      if r["item_id"] != k + 1:
        raise ValueError(f"{beauty_dir}/items.jsonl:{k + 1}: item_id {r['item_id']} out of order")
      items.append(dict(item=k, title=r["title"] or "", brand=r["brand"],
                        categories=r["categories"] or [], price=r["price"]))
  seqs = collections.defaultdict(list)
  with gzip.open(os.path.join(beauty_dir, "interactions.tsv.gz"), "rt") as f:
    next(f)
    for line in f:
      u, i, _, _ = line.split("\t")
      seqs[int(u)].append(int(i) - 1)
  sequences = [seqs[u] for u in sorted(seqs)]
  # Placeholder SIDs: a unique 4-level code from the item index (NOT semantic).
  sids = [f"<a_{i % 256}><b_{(i // 256) % 256}><c_{i // 65536}><d_0>" for i in range(len(items))]
  tokens = sorted({t for s in sids for t in ["<" + x for x in s.split("<") if x]})
  return dict(items=items, sids=sids, sid_tokens=tokens, sequences=sequences)
