"""Synthetic Beauty-like data: same schema as the shared `items.jsonl` / `interactions.tsv.gz`.

Items sit in a category tree (top > mid > leaf) with brands (each brand makes items in a few leaves)
and log-normal prices per top category; titles are built from brand, adjectives and the leaf noun,
so item text carries the structure the SIDs should find. Users have a latent taste (a Dirichlet over
leaves), brand loyalty and category drift: the next item comes from the last item's brand, else the
last item's leaf, else a sibling leaf, else the taste; within that pool by Zipf popularity. So the
next item is predictable from the history well beyond global popularity. No item repeats in a user.
"""

from __future__ import annotations

import gzip
import json
import os

import numpy as np

_TOPS = ["Makeup", "Skin Care", "Hair Care", "Fragrance", "Bath & Body", "Tools & Accessories"]
_NOUNS = ["Lipstick", "Mascara", "Serum", "Cleanser", "Shampoo", "Conditioner", "Perfume", "Lotion",
          "Brush", "Eyeliner", "Toner", "Mask", "Balm", "Polish", "Gel", "Oil", "Cream", "Spray"]
_ADJ = ["Hydrating", "Matte", "Volumizing", "Gentle", "Radiant", "Long-Lasting", "Organic", "Silky",
        "Repair", "Fresh", "Nourishing", "Ultra", "Daily", "Intense", "Soothing", "Classic"]
_BRANDS = ["Lumina", "Verdant", "Oriel", "Cascade", "Nova", "Petal & Co", "Saffron", "Aurelle",
           "Blythe", "Corvo", "Dune", "Elara", "Fennel", "Gala", "Halcyon", "Iris"]


def generate(cfg, seed: int) -> tuple[list[tuple[str, str, int, int]], dict[str, dict]]:
  """(interactions [(user, item, timestamp, tie_order)], items by raw id) like beauty.read_tsv."""
  rng = np.random.default_rng(seed)
  leaves = []  # (top, mid, leaf)
  for t in range(cfg.num_top_categories):
    top = _TOPS[t % len(_TOPS)] + ("" if t < len(_TOPS) else f" {t}")
    for m in range(cfg.num_mid_categories):
      for l in range(cfg.num_leaf_categories):
        leaves.append((top, f"{top.split()[0]} Line {m}", _NOUNS[(len(leaves)) % len(_NOUNS)]))
  n_leaf = len(leaves)
  brand_names = [_BRANDS[b % len(_BRANDS)] + ("" if b < len(_BRANDS) else f" {b}")
                 for b in range(cfg.num_brands)]
  # Each brand covers 2 leaves; items pick a leaf, then a brand among those covering it (or any).
  brand_leaves = [rng.choice(n_leaf, size=min(2, n_leaf), replace=False) for _ in range(cfg.num_brands)]
  items = {}
  item_leaf = np.zeros(cfg.num_items, np.int64)
  item_brand = np.zeros(cfg.num_items, np.int64)
  # sorted: a set of strings iterates in an order that changes with each process's hash seed
  top_price = {t: float(rng.uniform(5, 40)) for t in sorted({l[0] for l in leaves})}
  for i in range(cfg.num_items):
    leaf = i % n_leaf if i < n_leaf else int(rng.integers(n_leaf))
    cands = [b for b in range(cfg.num_brands) if leaf in brand_leaves[b]]
    brand = int(rng.choice(cands)) if cands else int(rng.integers(cfg.num_brands))
    item_leaf[i], item_brand[i] = leaf, brand
    top, mid, noun = leaves[leaf]
    adj = rng.choice(_ADJ, size=2, replace=False)
    price = round(float(top_price[top] * rng.lognormal(0.0, 0.4)), 2)
    raw = str(i + 1)
    items[raw] = {
        "item_id": i + 1, "asin": f"SYN{i + 1:07d}",
        "title": f"{brand_names[brand]} {adj[0]} {adj[1]} {noun} No. {i + 1}",
        "brand": brand_names[brand] if rng.random() > 0.05 else None,
        "price": price if rng.random() > 0.05 else None,
        "categories": ["Beauty", top, mid, noun],
    }
  pop = 1.0 / np.arange(1, cfg.num_items + 1) ** 0.8
  pop = pop[rng.permutation(cfg.num_items)]
  by_leaf = [np.flatnonzero(item_leaf == l) for l in range(n_leaf)]
  by_brand = [np.flatnonzero(item_brand == b) for b in range(cfg.num_brands)]
  sibling = [[m for m in range(n_leaf) if leaves[m][:2] == leaves[l][:2] and m != l] or [l]
             for l in range(n_leaf)]

  def pick(pool, seen):
    pool = np.array([j for j in pool if j not in seen])
    if pool.size == 0:
      return None
    p = pop[pool] / pop[pool].sum()
    return int(rng.choice(pool, p=p))

  rows = []
  t0 = 1_300_000_000
  for u in range(cfg.num_users):
    taste = rng.dirichlet(np.full(n_leaf, 0.3))
    n = min(cfg.min_len + int(rng.poisson(cfg.mean_extra_len)), cfg.num_items)
    seen: set[int] = set()
    seq = []
    cur = pick(by_leaf[int(rng.choice(n_leaf, p=taste))], seen)
    while len(seq) < n:
      if cur is None:
        cur = pick(range(cfg.num_items), seen)
      seq.append(cur)
      seen.add(cur)
      r = rng.random()
      if r < cfg.p_same_brand:
        nxt = pick(by_brand[item_brand[cur]], seen)
      elif r < cfg.p_same_brand + (1 - cfg.p_same_brand) * cfg.p_stay_leaf:
        nxt = pick(by_leaf[item_leaf[cur]], seen)
      elif rng.random() < 0.5:
        nxt = pick(by_leaf[int(rng.choice(sibling[item_leaf[cur]]))], seen)
      else:
        nxt = pick(by_leaf[int(rng.choice(n_leaf, p=taste))], seen)
      cur = nxt
    day = t0 + int(rng.integers(0, 1000)) * 86400
    for pos, it in enumerate(seq):
      day += int(rng.integers(0, 30)) * 86400  # day resolution with ties, like Beauty
      rows.append((f"U{u + 1}", str(it + 1), day, pos))
  return rows, items


def write_tsv(out_dir: str, rows, items: dict[str, dict]) -> None:
  """Writes `interactions.tsv.gz` + `items.jsonl` in the shared format (used by tests and demos)."""
  os.makedirs(out_dir, exist_ok=True)
  with gzip.open(os.path.join(out_dir, "interactions.tsv.gz"), "wt") as f:
    f.write("user_id\titem_id\ttimestamp\tposition\n")
    for u, i, ts, pos in rows:
      f.write(f"{u}\t{i}\t{ts}\t{pos}\n")
  with open(os.path.join(out_dir, "items.jsonl"), "w") as f:
    for d in items.values():
      f.write(json.dumps(d) + "\n")


def write_mcauley(out_dir: str, rows, items: dict[str, dict]) -> None:
  """Writes `reviews_Beauty_5.json.gz` + `meta_Beauty.json.gz` (Python literals) like McAuley's.

  Reviews are grouped by item (as in the original file), so first-appearance order differs from the
  time order and the numbering rule is exercised.
  """
  os.makedirs(out_dir, exist_ok=True)
  asin = {k: d.get("asin") or f"A{k}" for k, d in items.items()}
  order = sorted(range(len(rows)), key=lambda j: int(rows[j][1]))
  with gzip.open(os.path.join(out_dir, "reviews_Beauty_5.json.gz"), "wt") as f:
    for j in order:
      u, i, ts, _ = rows[j]
      f.write(json.dumps({"reviewerID": u, "asin": asin[i], "overall": 5.0,
                          "unixReviewTime": ts, "reviewText": "ok"}) + "\n")
  with gzip.open(os.path.join(out_dir, "meta_Beauty.json.gz"), "wt") as f:
    for k, d in items.items():
      m = {"asin": asin[k], "title": d["title"], "categories": [d["categories"], ["Beauty"]]}
      if d.get("brand") is not None:
        m["brand"] = d["brand"]
      if d.get("price") is not None:
        m["price"] = d["price"]
      f.write(repr(m) + "\n")
