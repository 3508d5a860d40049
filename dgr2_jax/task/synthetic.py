"""Small synthetic task data with the data API's shapes (for tests, demos and benchmarks).

Items have Beauty-like metadata (category paths, brands incl. 'Unknown', prices incl. None),
unique 4-token SIDs, users have 5..12 purchases, and a toy 'retriever' proposes 10 candidates
(history excluded) that contain the next item for roughly `hit_rate` of the users.
"""

from __future__ import annotations

import numpy as np

_TREE = {
    "Makeup": {"Nails": ["Nail Polish", "Top Coat"], "Eyes": ["Mascara", "Eyeliner"],
               "Face": ["Foundation", "Concealers & Neutralizers"]},
    "Skin Care": {"Face": ["Creams & Moisturizers", "Cleansers"], "Body": ["Lotions"]},
    "Hair Care": {"Styling Products": ["Gels", "Hair Sprays"], "Shampoos": ["Shampoos"]},
}
_BRANDS = ["OPI", "Essie", "Maybelline", "L'Oreal", "Neutrogena", "Unknown", None]
_WORDS = ["Ultra", "Matte", "Hydrating", "Daily", "Pro", "Silk", "Glow", "Fresh", "Velvet",
          "Classic", "Deep", "Rose", "Argan", "Sheer", "Bold", "Gentle", "Lasting", "Pure"]


def make(n_items: int = 80, n_users: int = 40, hit_rate: float = 0.6, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  paths = [["Beauty", a, b, c] for a, bs in _TREE.items() for b, cs in bs.items() for c in cs]
  items = []
  for i in range(n_items):
    path = paths[int(rng.integers(len(paths)))]
    words = [_WORDS[int(k)] for k in rng.integers(len(_WORDS), size=int(rng.integers(2, 9)))]
    price = None if rng.random() < 0.1 else float(np.round(rng.uniform(2, 80), 2))
    items.append({"item": i, "title": " ".join(words) + f" {path[-1]} No. {i}",
                  "brand": _BRANDS[int(rng.integers(len(_BRANDS)))], "categories": path,
                  "price": price})
  sids = [f"<a_{i % 5}><b_{(i // 5) % 7}><c_{i // 35}><d_{i % 3}>" for i in range(n_items)]
  assert len(set(sids)) == n_items
  sid_tokens = sorted({t for s in sids for t in ["<" + x for x in s.split("<") if x]})
  sequences = []
  for _ in range(n_users):
    n = int(rng.integers(5, 13))
    sequences.append([int(x) for x in rng.choice(n_items, size=n, replace=False)])
  candidates = {}
  for split, cut in (("train", 3), ("valid", 2), ("test", 1)):
    c = np.zeros([n_users, 10], np.int32)
    for u, seq in enumerate(sequences):
      hist, target = set(seq[:-cut]), seq[-cut]
      pool = [i for i in rng.permutation(n_items) if i not in hist and i != target]
      row = [int(x) for x in pool[:10]]
      if rng.random() < hit_rate:
        row[int(rng.integers(10))] = target
      c[u] = row
    candidates[split] = c
  return dict(items=items, sids=sids, sid_tokens=sid_tokens, sequences=sequences,
              candidates=candidates)
