"""Label-free first-pick policies on a workdir's candidate lists: training split beside validation.

  python benchmarks/trace_policies.py --workdir=/tmp/dgr2_beauty_cpu [--max_history=20]

Reads the data, SID and retriever stages of a workdir (nothing is trained) and prints, for every
policy, its Recall@1 on the users whose target the retriever lists, on the training split (where
`task.trace_policy='fit'` chooses) and on validation, with the override rate and the override
precision against #1's on the same users. The rows: the retriever's order; the grid `fit` chooses
from (task/policy.py: relations to the last purchase, strongest first, x how far down, and with
the next-purchase tiers of `task.mark_copurchase`, task/copurchase.py, ahead of them); and
candidates outside that grid, to show what else the prompt offers: the first code or first two
codes of the SID shared with the last purchase (semantic neighbours), the brand of either of the
last two purchases, and a per-cell table of P(target | position, relation) estimated on the
training lists (argmax, with a margin over #1). Last, a list-wise choice model fit on the
training lists (`choice_model`: a softmax over the ten candidates of a linear score of the same
marks, position and their interactions): what a learner fit on those lists, the RL stages' prompt
pool, gets from the marks beyond the fixed tiers.

Then the ceiling a learner reaches on validation's own distribution (`cross_validated`): the same
choice model, and one that also sees the SID codes shared with the last purchase and the brands
of the last two purchases, fit on the training lists plus four fifths of validation and scored on
the fifth it did not see (5 folds), each beside the chosen trace policy on the same users (paired
difference and its standard error). A re-ranker that reads these features cannot be expected to
beat the policy by more than this row does.

When the workdir also has its traces (`traces/train.jsonl`, `traces/policy.json`), a second table
sets the prompt pools side by side under the chosen policy: every training list as built (with
`task.insert_target`'s inserted targets), the inserted ones alone, the natural ones (the RL
stages' `prompt_pool='natural'`) and validation; how often the target carries a next-purchase
count, and what the policy's overrides win there.
"""

from __future__ import annotations

import json
import os
import re
import sys

from absl import app
from absl import flags
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from dgr2_jax.data import api  # noqa: E402
from dgr2_jax.task import copurchase  # noqa: E402
from dgr2_jax.task import policy as policy_lib  # noqa: E402
from dgr2_jax.task import prompts  # noqa: E402
from dgr2_jax.task import rationale  # noqa: E402
from dgr2_jax.task import traces  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "a workdir with data, sids and retriever built",
                               required=True)
_MAX_HISTORY = flags.DEFINE_integer("max_history", 20, "history items the prompt shows (task.max_history)")


def features(ex: dict, items, sids, max_history: int) -> list[dict]:
  """Per candidate: the relation to the last purchase and the extra evidence tried here."""
  hist = ex["history"][-max_history:] if max_history > 0 else ex["history"]
  codes = lambda i: re.findall(r"<[^>]+>", sids[i])
  last = codes(hist[-1])
  recent = {prompts.brand(items[i]) for i in hist[-2:]} - {None}
  out = []
  for c in ex["candidates"]:
    cc = codes(c)
    out.append({"rel": rationale.relation(items[c], [items[i] for i in hist]),
                "next": copurchase.tier(ex["bought_next"][len(out)]),
                "code1": cc[0] == last[0], "code2": cc[:2] == last[:2],
                "brand_last2": prompts.brand(items[c]) in recent})
  return out


def first_by(fs, tests, reach=10) -> int:
  for test in tests:
    ks = [k for k in range(min(reach, len(fs))) if test(fs[k])]
    if ks:
      return ks[0]
  return 0


def score(feats, tpos, pick) -> dict:
  n = hits = over = over_hits = top1 = 0
  for fs, t in zip(feats, tpos):
    if t < 0:
      continue
    k = pick(fs)
    n, hits = n + 1, hits + (k == t)
    if k:
      over, over_hits, top1 = over + 1, over_hits + (k == t), top1 + (t == 0)
  return {"recall@1": hits / n, "override_rate": over / n,
          "override_precision": over_hits / over if over else float("nan"),
          "top1_on_overrides": top1 / over if over else float("nan"), "n": n}


def table(feats, tpos) -> np.ndarray:
  """P(target is #k | position k, relation) on the training lists, smoothed toward the mean."""
  rels = list(rationale.RELATIONS)
  hit, cnt = np.zeros([10, len(rels)]), np.zeros([10, len(rels)])
  for fs, t in zip(feats, tpos):
    for k, f in enumerate(fs):
      j = rels.index(f["rel"])
      cnt[k, j] += 1
      hit[k, j] += t == k
  return (hit + hit.sum() / cnt.sum()) / (cnt + 1.0)


def _bucket(k: int) -> int:
  """The position bucket the choice models cross their features with: #1, #2-3, #4-6, #7-10."""
  return 0 if k == 0 else 1 if k < 3 else 2 if k < 6 else 3


def _phi(k: int, f: dict) -> np.ndarray:
  """One candidate's features: position, next-purchase tier and relation (one-hot each), and the
  tier and the relation crossed with a position bucket (#1, #2-3, #4-6, #7-10)."""
  tiers, rels = [None] + list(copurchase.TIERS), list(rationale.RELATIONS)
  b = _bucket(k)
  v = np.zeros(10 + len(tiers) + len(rels) + 4 * (len(tiers) + len(rels)))
  t, r = tiers.index(f["next"]), rels.index(f["rel"])
  v[k] = v[10 + t] = v[10 + len(tiers) + r] = 1.0
  base = 10 + len(tiers) + len(rels)
  v[base + 4 * t + b] = v[base + 4 * (len(tiers) + r) + b] = 1.0
  return v


def _phi_sid_brand(k: int, f: dict) -> np.ndarray:
  """`_phi` plus what else the prompt shows about a candidate: its SID's first code and first two
  codes shared with the last purchase, and its brand among the last two purchases' (each alone
  and crossed with the position bucket)."""
  b = _bucket(k)
  extra = np.zeros(3 * 5)
  for j, key in enumerate(("code1", "code2", "brand_last2")):
    if f[key]:
      extra[5 * j] = extra[5 * j + 1 + b] = 1.0
  return np.concatenate([_phi(k, f), extra])


def choice_model(feats, tpos, l2: float = 0.01, steps: int = 1500, phi=_phi):
  """A conditional logit (softmax over a list's candidates of w . phi) fit by full-batch Adam on
  the lists whose target is listed -> a pick function (argmax score)."""
  rows = [(fs, t) for fs, t in zip(feats, tpos) if t >= 0 and len(fs) == 10]
  x = np.stack([np.stack([phi(k, f) for k, f in enumerate(fs)]) for fs, _ in rows])   # [n, 10, d]
  y = np.eye(10)[[t for _, t in rows]]
  w, m, v = np.zeros(x.shape[-1]), np.zeros(x.shape[-1]), np.zeros(x.shape[-1])
  for i in range(1, steps + 1):
    z = x @ w
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    g = np.einsum("nk,nkd->d", p - y, x) / len(rows) + l2 * w
    m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
    w -= 0.05 * (m / (1 - 0.9 ** i)) / (np.sqrt(v / (1 - 0.999 ** i)) + 1e-8)
  return lambda fs: int(np.argmax([phi(k, f) @ w for k, f in enumerate(fs)]))


def cross_validated(train_feats, train_tpos, feats, tpos, phi=_phi, folds: int = 5, seed: int = 0,
                    steps: int = 1500) -> np.ndarray:
  """Each list's pick by a choice model fit on the training lists and the other folds of
  (feats, tpos): [len(feats)] positions. Fold k's picks never see fold k's targets."""
  fold = np.random.default_rng(seed).integers(0, folds, len(feats))
  picks = np.zeros(len(feats), int)
  for k in range(folds):
    out = fold == k
    pick = choice_model(list(train_feats) + [f for f, o in zip(feats, out) if not o],
                        list(train_tpos) + [t for t, o in zip(tpos, out) if not o], steps=steps, phi=phi)
    for i in np.flatnonzero(out):
      picks[i] = pick(feats[i])
  return picks


def pool_table(wd: str, items, sids, max_history: int) -> list[str]:
  """The markdown rows of the prompt-pool table (module docstring); [] without traces."""
  paths = {s: os.path.join(wd, "traces", f"{s}.jsonl") for s in ("train", "valid")}
  policy_path = os.path.join(wd, "traces", "policy.json")
  if not all(os.path.exists(p) for p in [policy_path, *paths.values()]):
    return []
  with open(policy_path) as f:
    chosen = json.load(f)["policy"]
  listed = lambda r: r.get("target_pos") is not None and r["target_pos"] >= 0
  recs = {s: [r for r in traces.read_jsonl(p) if listed(r)] for s, p in paths.items()}
  pools = {"train, every list as built (targets inserted)": recs["train"],
           "train, inserted targets only": [r for r in recs["train"] if r.get("inserted")],
           "train, natural lists (`prompt_pool='natural'`)": [r for r in recs["train"] if not r.get("inserted")],
           "validation": recs["valid"]}
  out = ["| prompts | n | target has a next-purchase count | target is #1 | policy R@1 | policy - #1 | "
         "override rate | override precision | #1 precision there |", "|---|---|---|---|---|---|---|---|---|"]
  for name, rs in pools.items():
    if not rs:
      continue
    t = np.asarray([r["target_pos"] for r in rs])
    pick = np.asarray([policy_lib.choose_from([(f["next"], f["rel"]) for f in features(r, items, sids, max_history)],
                                              chosen) for r in rs])
    counted = np.mean([r["bought_next"][r["target_pos"]] > 0 for r in rs])
    ov = pick != 0
    r1, floor = np.mean(pick == t), np.mean(t == 0)
    out.append(f"| {name} | {len(rs):,} | {counted:.3f} | {floor:.3f} | {r1:.4f} | {r1 - floor:+.4f} | "
               f"{ov.mean():.3f} | {np.mean(pick[ov] == t[ov]):.3f} | {np.mean(t[ov] == 0):.3f} |")
  return out


def ceiling_table(feats, tpos, wd: str, rows) -> str:
  """The cross-validated choice models on validation beside the chosen policy (module docstring):
  `traces/policy.json` when the workdir has it, else the grid row best on the training lists."""
  policy_path = os.path.join(wd, "traces", "policy.json")
  if os.path.exists(policy_path):
    with open(policy_path) as f:
      chosen = json.load(f)["policy"]
    name, base = policy_lib.name(chosen), lambda fs: policy_lib.choose_from([(f["next"], f["rel"]) for f in fs], chosen)
  else:
    name, base = max(rows[:1 + len(policy_lib.GRID_TIERS_NEXT) * len(policy_lib.GRID_REACH)],
                     key=lambda r: score(feats["train"], tpos["train"], r[1])["recall@1"])
  keep = [i for i, (fs, t) in enumerate(zip(feats["valid"], tpos["valid"])) if t >= 0 and len(fs) == 10]
  vf, vt = [feats["valid"][i] for i in keep], np.asarray([tpos["valid"][i] for i in keep])
  ref = np.asarray([base(fs) for fs in vf]) == vt
  out = [f"\nCross-validated on validation (5 folds; fit on the training lists and the other folds; "
         f"n = {len(vt)}), beside the policy `{name}` ({ref.mean():.4f}) on the same users:\n",
         "| learner | valid R@1 | - policy | SE |", "|---|---|---|---|"]
  for label, phi in (("choice model on the marks", _phi),
                     ("choice model on the marks, SID codes and the last two brands", _phi_sid_brand)):
    d = (cross_validated(feats["train"], tpos["train"], vf, vt, phi=phi) == vt) - ref.astype(float)
    out.append(f"| {label} | {ref.mean() + d.mean():.4f} | {d.mean():+.4f} | {d.std() / np.sqrt(len(d)):.4f} |")
  return "\n".join(out)


def main(argv):
  del argv
  wd = _WORKDIR.value
  items, sids, seqs = api.load_items(wd), api.load_sids(wd), api.load_sequences(wd)
  feats, tpos = {}, {}
  for split in ("train", "valid"):
    exs, _ = traces.build_examples(seqs, api.load_candidates(wd, split), split, require_target=False,
                                   bought_next=True)
    feats[split] = [features(e, items, sids, _MAX_HISTORY.value) for e in exs]
    tpos[split] = [e["target_pos"] for e in exs]
  rel = lambda name: (lambda f: f["rel"] == name)
  rows = [("retriever order", lambda fs: 0)]
  for tiers in policy_lib.GRID_TIERS_NEXT:
    for reach in policy_lib.GRID_REACH:
      p = {"tiers": tiers, "reach": reach}
      rows.append((policy_lib.name(p),
                   lambda fs, p=p: policy_lib.choose_from([(f["next"], f["rel"]) for f in fs], p)))
  for reach in (3, 10):
    rows += [(f"same SID first code within the top {reach}",
              lambda fs, r=reach: first_by(fs, [lambda f: f["code1"]], r)),
             (f"same SID first two codes within the top {reach}",
              lambda fs, r=reach: first_by(fs, [lambda f: f["code2"]], r)),
             (f"same brand, else same first two codes, within the top {reach}",
              lambda fs, r=reach: first_by(fs, [rel("Same brand"), lambda f: f["code2"]], r)),
             (f"brand of either of the last two purchases within the top {reach}",
              lambda fs, r=reach: first_by(fs, [lambda f: f["brand_last2"]], r))]
  tab = table(feats["train"], tpos["train"])
  rels = list(rationale.RELATIONS)
  for margin in (0.0, 0.01, 0.02):
    def pick(fs, m=margin):
      sc = [tab[k, rels.index(f["rel"])] for k, f in enumerate(fs)]
      k = int(np.argmax(sc))
      return k if sc[k] >= sc[0] + m else 0
    rows.append((f"table P(target | position, relation), margin {margin}", pick))
  rows.append(("list-wise choice model on the same marks, fit on the training lists",
               choice_model(feats["train"], tpos["train"])))
  print("| policy | train R@1 | valid R@1 | valid - floor | valid override rate | "
        "override precision | #1 precision there |")
  print("|---|---|---|---|---|---|---|")
  floor = None
  for name, pick in rows:
    tr, va = score(feats["train"], tpos["train"], pick), score(feats["valid"], tpos["valid"], pick)
    floor = va["recall@1"] if floor is None else floor
    print(f"| {name} | {tr['recall@1']:.4f} | {va['recall@1']:.4f} | {va['recall@1'] - floor:+.4f} | "
          f"{va['override_rate']:.3f} | {va['override_precision']:.3f} | {va['top1_on_overrides']:.3f} |")
  print(f"(train n = {score(feats['train'], tpos['train'], lambda fs: 0)['n']}, "
        f"valid n = {score(feats['valid'], tpos['valid'], lambda fs: 0)['n']}: users whose target is listed)")
  print(ceiling_table(feats, tpos, wd, rows))
  pools = pool_table(wd, items, sids, _MAX_HISTORY.value)
  if pools:
    print("\nThe prompt pools under the chosen policy (traces/policy.json):\n")
    print("\n".join(pools))


if __name__ == "__main__":
  app.run(main)
