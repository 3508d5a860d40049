import sys, time, json, os
import jax; print(jax.devices(), flush=True)
from dgr2_jax.data import sasrec
import types
wd = 'workdir_dev'
seqs = json.load(open(wd + '/data/sequences.json')); n_items = sum(1 for _ in open(wd + '/data/items.jsonl'))
def split_examples(sequences, split):
  cut = {"train": 3, "valid": 2, "test": 1}[split]
  import numpy as np
  return [s[:-cut] for s in sequences], np.asarray([s[-cut] for s in sequences], np.int32)
class api: split_examples = staticmethod(split_examples)
class dc:
  @staticmethod
  def retriever_config():
    return types.SimpleNamespace(max_len=50, hidden=64, num_blocks=2, num_heads=1, dropout=0.5, loss='ce', learning_rate=1e-3, weight_decay=0.0, batch_size=128, num_epochs=200, eval_every=2, patience=5, eval_batch_size=512)
for loss, bs, lr, drop in [('ce', 128, 3e-3, 0.5), ('ce', 256, 3e-3, 0.5)]:
  cfg = dc.retriever_config(); cfg.loss = loss; cfg.batch_size = bs; cfg.learning_rate = lr; cfg.dropout = drop
  tr = sasrec.Trainer(cfg, n_items, [s[:-2] for s in seqs], 0)
  vh, vt = api.split_examples(seqs, 'valid'); th, tt = api.split_examples(seqs, 'test')
  t0 = time.time()
  n_ep = int(sys.argv[1]) if bs == 128 else int(sys.argv[2])
  ev = 1
  for ep in range(1, n_ep + 1):
    l = tr.train_epoch()
    if ep % ev == 0:
      mv = sasrec.rank_metrics(tr.rank(vh, vt, 10)[1]); mt = sasrec.rank_metrics(tr.rank(th, tt, 10)[1])
      print(loss, bs, ep, f'{time.time()-t0:.0f}s loss {l:.3f} valid R10 {mv["recall@10"]:.4f} N10 {mv["ndcg@10"]:.4f} test R10 {mt["recall@10"]:.4f} N10 {mt["ndcg@10"]:.4f} hits {mt["n_hits@10"]}', flush=True)
