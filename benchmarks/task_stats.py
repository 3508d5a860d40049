"""Prompt-length, reasoning-length and pre-rank-floor statistics of the re-ranking task.

Data, in order of preference:
  --workdir DIR    a pipeline workdir with data/, sids/, retriever/ (the real thing: real SIDs
                   and the project's retriever, so the pre-rank floor is the paper's quantity);
  --beauty_dir DIR real Amazon Beauty metadata and sequences (default: ../shared/data/
                   amazon_beauty next to the repo) with PLACEHOLDER SIDs and a STAND-IN retriever
                   (last-items transition counts + popularity); its floor is not the project's;
  --synthetic      dgr2_jax.task.synthetic data.
Tokenizer: --tokenizer DIR (e.g. a real Qwen3 directory) or a demo BPE built in a temp dir.

  python benchmarks/task_stats.py [--workdir W | --beauty_dir D | --synthetic] [--max_users N]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from dgr2_jax.data import beauty  # noqa: E402
from dgr2_jax.task import answer, config, metrics, prompts, synthetic, traces  # noqa: E402
from dgr2_jax.task import tokenizer as tok_lib  # noqa: E402


def standin_candidates(sequences, n_items: int, cut: int, n: int = 10) -> np.ndarray:
  """Transition counts from every user's prefix before the split's cutoff + popularity."""
  trans = collections.defaultdict(collections.Counter)
  pop = collections.Counter()
  for s in sequences:
    pre = s[:-cut]
    pop.update(pre)
    for a, b in zip(pre[:-1], pre[1:]):
      trans[a][b] += 1
  popular = [i for i, _ in pop.most_common(200)]
  out = np.zeros([len(sequences), n], np.int32)
  for u, s in enumerate(sequences):
    hist = s[:-cut]
    score = collections.Counter()
    for w, a in zip((1.0, 0.5, 0.25), hist[::-1]):
      for b, c in trans[a].items():
        score[b] += w * c
    seen, row = set(hist), []
    for i, _ in score.most_common():
      if i not in seen and len(row) < n:
        row.append(i)
        seen.add(i)
    for i in popular:
      if len(row) == n:
        break
      if i not in seen:
        row.append(i)
        seen.add(i)
    out[u] = row
  return out


def summary(xs) -> str:
  xs = np.asarray(xs)
  return (f"mean {xs.mean():.1f}  p50 {np.percentile(xs, 50):.0f}  p90 {np.percentile(xs, 90):.0f}"
          f"  max {xs.max()}  (n={len(xs)})")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", default="")
  ap.add_argument("--beauty_dir", default=os.path.join(REPO, "..", "shared", "data",
                                                       "amazon_beauty"))
  ap.add_argument("--synthetic", action="store_true")
  ap.add_argument("--tokenizer", default="")
  ap.add_argument("--max_users", type=int, default=2000, help="users sampled for token stats")
  ap.add_argument("--rationale_tokens", type=int, default=130)
  args = ap.parse_args()
  t0 = time.time()
  if args.workdir and os.path.isdir(os.path.join(args.workdir, "retriever")):
    from dgr2_jax.stages import traces as traces_stage
    d = traces_stage.load_task_data(args.workdir)
    source = f"workdir {args.workdir} (real SIDs, project retriever)"
  elif not args.synthetic and os.path.exists(os.path.join(args.beauty_dir, "items.jsonl")):
    d = beauty.load_with_placeholder_sids(args.beauty_dir)
    d["candidates"] = {s: standin_candidates(d["sequences"], len(d["items"]), c)
                       for s, c in traces.SPLIT_CUT.items()}
    source = "real Beauty metadata, PLACEHOLDER SIDs, STAND-IN retriever"
  else:
    d = synthetic.make(n_items=400, n_users=300)
    source = "synthetic"
  print(f"data: {source}; {len(d['items'])} items, {len(d['sequences'])} users "
        f"({time.time() - t0:.0f}s)")
  tok_dir = args.tokenizer or tok_lib.build_demo_tokenizer(
      tok_lib.demo_corpus(d["items"]), d["sid_tokens"], tempfile.mkdtemp(), 2048)
  tok = tok_lib.load_tokenizer(tok_dir)
  print(f"tokenizer: {args.tokenizer or 'demo BPE'} ({len(tok)} tokens)")
  count = lambda s: len(tok.encode(s, add_special_tokens=False))

  print("\npre-rank floor (retriever order), users whose target is among the candidates:")
  for split in ("train", "valid", "test"):
    exs, c = traces.build_examples(d["sequences"], d["candidates"][split], split)
    m = metrics.prerank_floor([e["target_pos"] for e in exs])
    print(f"  {split:5s}: n={m['n']} of {c['users']} users  R@1 {m['recall@1']:.4f}  "
          f"R@3 {m['recall@3']:.4f}  NDCG@3 {m['ndcg@3']:.4f}")

  cfg = config.task_config()
  cfg.rationale_tokens = args.rationale_tokens
  exs, _ = traces.build_examples(d["sequences"], d["candidates"]["train"], "train",
                                 insert_target="random_position")
  rng = np.random.default_rng(0)
  sample = [exs[i] for i in sorted(rng.choice(len(exs), min(args.max_users, len(exs)),
                                              replace=False))]
  for variant in prompts.VARIANTS:
    lens = []
    for e in sample:
      ids, _ = prompts.render_prompt_ids(tok, e["history"], e["candidates"], d["items"], d["sids"],
                                         style=prompts.PromptStyle(variant), max_history=cfg.max_history)
      lens.append(len(ids))
    print(f"\nprompt tokens ({variant}, history <= {cfg.max_history}): {summary(lens)}")
  reason, resp, valid = [], [], 0
  for e in sample:
    t = traces.builtin_trace(e, d["items"], d["sids"], cfg, count)
    r, _ = answer.split_response(t["response"])
    reason.append(count(r))
    resp.append(count(t["response"]) + 1)
    p = answer.parse_response(t["response"], [d["sids"][i] for i in e["candidates"]])
    valid += p.valid and p.positions[0] == e["target_pos"]
  print(f"reasoning tokens (built-in rationale, knob {cfg.rationale_tokens}): {summary(reason)}")
  print(f"response tokens (incl. answer + EOS): {summary(resp)}")
  print(f"generated target answers valid with target first: {valid}/{len(sample)}")
  print(f"({time.time() - t0:.0f}s)")


if __name__ == "__main__":
  main()
