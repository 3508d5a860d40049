"""SASRec (Kang & McAuley, ICDM 2018) in Flax: the retriever that proposes each user's top-10.

Model as in the original: item embedding * sqrt(d) + learned positions (the most recent item sits at
position max_len-1), dropout, `num_blocks` x [LN(x) -> causal self-attention with x as keys/values,
residual onto LN(x); LN -> 2-layer point-wise FFN with residual], padding zeroed after each block,
final LN; the score of item i is <h_t, E_i> with the shared input embedding.

Training on the train split only (each user's seq[:-2]: every prefix predicts its next item), with
either softmax cross-entropy over all items ('ce', what reaches the published numbers in few epochs)
or the original binary cross-entropy with one sampled negative per position ('bce'). Users are
bucketed by length (4/8/12/16/24/32/max_len) so short sequences do not pay for padding. Early stopping on
validation NDCG@10; the best parameters are kept.

Evaluation: full ranking over all items with the user's history (the split's input) excluded;
Recall@k and NDCG@k from the rank of the held-out item; top-k lists are the candidates.
"""

from __future__ import annotations

import math
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm


class SASRec(nn.Module):
  n_items: int
  max_len: int = 50
  hidden: int = 64
  num_blocks: int = 2
  num_heads: int = 1
  dropout: float = 0.5

  def setup(self):
    self.item_emb = nn.Embed(self.n_items + 1, self.hidden,
                             embedding_init=nn.initializers.normal(self.hidden ** -0.5))
    self.pos_emb = nn.Embed(self.max_len, self.hidden,
                            embedding_init=nn.initializers.normal(self.hidden ** -0.5))
    self.attn_ln = [nn.LayerNorm(epsilon=1e-8) for _ in range(self.num_blocks)]
    self.attn = [nn.MultiHeadDotProductAttention(num_heads=self.num_heads, qkv_features=self.hidden,
                                                 dropout_rate=self.dropout)
                 for _ in range(self.num_blocks)]
    self.ffn_ln = [nn.LayerNorm(epsilon=1e-8) for _ in range(self.num_blocks)]
    self.ffn1 = [nn.Dense(self.hidden) for _ in range(self.num_blocks)]
    self.ffn2 = [nn.Dense(self.hidden) for _ in range(self.num_blocks)]
    self.drop = nn.Dropout(self.dropout)
    self.last_ln = nn.LayerNorm(epsilon=1e-8)

  def __call__(self, seq, train: bool = False):
    """seq [B, T] of item index + 1, LEFT-padded with 0 -> hidden states [B, T, H]."""
    t = seq.shape[1]
    pad = (seq > 0)[..., None].astype(jnp.float32)
    pos = jnp.arange(self.max_len - t, self.max_len)
    x = self.item_emb(seq) * math.sqrt(self.hidden) + self.pos_emb(pos)[None]
    x = self.drop(x, deterministic=not train) * pad
    causal = jnp.tril(jnp.ones([t, t], bool))
    mask = causal[None, None] & (seq > 0)[:, None, None, :]
    for b in range(self.num_blocks):
      q = self.attn_ln[b](x)
      x = q + self.attn[b](q, x, mask=mask, deterministic=not train)
      y = self.ffn_ln[b](x)
      h = self.drop(nn.relu(self.ffn1[b](y)), deterministic=not train)
      x = (y + self.drop(self.ffn2[b](h), deterministic=not train)) * pad
    return self.last_ln(x)

  def item_table(self):
    """[n_items, H] output embeddings (shared with the input table, row 0 = padding dropped)."""
    return self.item_emb.embedding[1:]


_BUCKETS = (4, 8, 12, 16, 24, 32)  # 1.3x the real positions on Beauty (1.8x with 8/16/32)


def _bucket_len(n: int, max_len: int) -> int:
  for b in _BUCKETS:
    if n <= b and b < max_len:
      return b
  return max_len


def _left_pad(rows: Sequence[Sequence[int]], t: int) -> np.ndarray:
  out = np.zeros([len(rows), t], np.int32)
  for r, s in enumerate(rows):
    s = list(s)[-t:]
    if s:
      out[r, t - len(s):] = s
  return out


def _batches(lengths: np.ndarray, batch_size: int, max_len: int, rng=None):
  """Index batches grouped by bucket length; shuffled when rng is given. Yields (idx, bucket_len)."""
  buckets: dict[int, list[int]] = {}
  for i, n in enumerate(lengths):
    buckets.setdefault(_bucket_len(max(int(n), 1), max_len), []).append(i)
  out = []
  for t, idx in sorted(buckets.items()):
    idx = np.asarray(idx)
    if rng is not None:
      idx = rng.permutation(idx)
    out += [(idx[s:s + batch_size], t) for s in range(0, len(idx), batch_size)]
  if rng is not None:
    out = [out[j] for j in rng.permutation(len(out))]
  return out


def rank_metrics(ranks: np.ndarray, ks=(5, 10)) -> dict:
  """Recall@k / NDCG@k for one held-out item per user; rank 0 = top."""
  ranks = np.asarray(ranks)
  m = {}
  for k in ks:
    hit = ranks < k
    m[f"recall@{k}"] = float(hit.mean())
    m[f"ndcg@{k}"] = float(np.where(hit, 1.0 / np.log2(ranks + 2.0), 0.0).mean())
  m["n_hits@10"] = int((ranks < 10).sum())
  m["n_users"] = int(ranks.size)
  return m


def candidate_ranks(cands: np.ndarray, targets: np.ndarray) -> np.ndarray:
  """Rank of each target in its candidate list (len(list) when absent)."""
  hit = cands == targets[:, None]
  return np.where(hit.any(1), hit.argmax(1), cands.shape[1])


class Trainer:
  """Holds the model, jitted steps and the train split; `fit()` then `evaluate()` / `topk()`."""

  def __init__(self, cfg, n_items: int, train_seqs: Sequence[Sequence[int]], seed: int):
    self.cfg, self.n_items = cfg, n_items
    self.model = SASRec(n_items, cfg.max_len, cfg.hidden, cfg.num_blocks, cfg.num_heads,
                        cfg.dropout)
    self.rng = np.random.default_rng(seed)
    self.key = jax.random.PRNGKey(seed)
    self.params = self.model.init(jax.random.PRNGKey(seed), jnp.ones([1, 8], jnp.int32))
    self.opt = optax.adamw(cfg.learning_rate, b2=0.98, weight_decay=cfg.weight_decay)
    self.opt_state = self.opt.init(self.params)
    # Inputs seq[:-1] -> targets seq[1:] (item index + 1; 0 = no target), last max_len positions.
    self.inputs = [[i + 1 for i in s[:-1]][-cfg.max_len:] for s in train_seqs]
    self.targets = [[i + 1 for i in s[1:]][-cfg.max_len:] for s in train_seqs]
    self.lengths = np.asarray([len(s) for s in self.inputs])
    self._train_step = jax.jit(self._step)
    self._scores = jax.jit(self._score_fn)

  def _loss(self, params, seq, tgt, key):
    k1, k2 = jax.random.split(key)
    h = self.model.apply(params, seq, train=True, rngs={"dropout": k1})
    table = self.model.apply(params, method=SASRec.item_table)
    valid = (tgt > 0).astype(jnp.float32)
    if self.cfg.loss == "ce":
      logits = h @ table.T
      nll = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(tgt - 1, 0))
    elif self.cfg.loss == "bce":
      neg = jax.random.randint(k2, tgt.shape, 0, self.n_items)
      pos_l = jnp.sum(h * table[jnp.maximum(tgt - 1, 0)], -1)
      neg_l = jnp.sum(h * table[neg], -1)
      nll = -jax.nn.log_sigmoid(pos_l) - jax.nn.log_sigmoid(-neg_l)
    else:
      raise ValueError(f"retriever.loss must be 'ce' or 'bce', got {self.cfg.loss!r}")
    return jnp.sum(nll * valid) / jnp.maximum(valid.sum(), 1.0)

  def _step(self, params, opt_state, seq, tgt, key):
    loss, g = jax.value_and_grad(self._loss)(params, seq, tgt, key)
    upd, opt_state = self.opt.update(g, opt_state, params)
    return optax.apply_updates(params, upd), opt_state, loss

  def _score_fn(self, params, seq, exclude):
    """Scores [B, n_items] from the last position; `exclude` [B, n_items] bool -> -inf."""
    h = self.model.apply(params, seq)[:, -1]
    s = h @ self.model.apply(params, method=SASRec.item_table).T
    return jnp.where(exclude, -jnp.inf, s)

  def train_epoch(self) -> float:
    bs = self.cfg.batch_size
    losses = []
    for idx, t in _batches(self.lengths, bs, self.cfg.max_len, self.rng):
      seq = _left_pad([self.inputs[i] for i in idx], t)
      tgt = _left_pad([self.targets[i] for i in idx], t)
      if len(idx) < bs:  # fixed shapes: pad the batch with empty users (no targets)
        seq = np.concatenate([seq, np.zeros([bs - len(idx), t], np.int32)])
        tgt = np.concatenate([tgt, np.zeros([bs - len(idx), t], np.int32)])
      self.key, k = jax.random.split(self.key)
      self.params, self.opt_state, loss = self._train_step(self.params, self.opt_state, seq, tgt, k)
      losses.append(loss)
    return float(np.mean(jax.device_get(losses)))

  def rank(self, histories: Sequence[Sequence[int]], targets: np.ndarray | None, k: int,
           params=None) -> tuple[np.ndarray, np.ndarray | None]:
    """(top-k item indices [n, k] with history excluded, rank of each target or None)."""
    params = self.params if params is None else params
    bs = self.cfg.eval_batch_size
    n = len(histories)
    top = np.zeros([n, k], np.int32)
    ranks = None if targets is None else np.zeros([n], np.int64)
    lengths = np.asarray([len(h) for h in histories])
    for idx, t in _batches(lengths, bs, self.cfg.max_len):
      seq = _left_pad([[i + 1 for i in histories[j]] for j in idx], t)
      excl = np.zeros([bs, self.n_items], bool)
      for r, j in enumerate(idx):
        excl[r, list(histories[j])] = True
      if len(idx) < bs:
        seq = np.concatenate([seq, np.zeros([bs - len(idx), t], np.int32)])
      s = self._scores(params, seq, excl)
      top[idx] = np.asarray(jax.lax.top_k(s, k)[1])[: len(idx)]
      if targets is not None:
        s = np.asarray(s)[: len(idx)]
        ts = s[np.arange(len(idx)), targets[idx]]
        ranks[idx] = (s > ts[:, None]).sum(1)
    return top, ranks

  def fit(self, valid_histories, valid_targets, log=print) -> dict:
    """Trains with early stopping on validation NDCG@10; keeps the best parameters."""
    cfg = self.cfg
    best, best_params, best_epoch, bad, history = -1.0, self.params, 0, 0, []
    bar = tqdm.trange(1, cfg.num_epochs + 1, desc="sasrec", mininterval=5.0)
    for epoch in bar:
      loss = self.train_epoch()
      if epoch % cfg.eval_every and epoch != cfg.num_epochs:
        bar.set_postfix(loss=f"{loss:.4f}")
        continue
      _, ranks = self.rank(valid_histories, valid_targets, 10)
      m = rank_metrics(ranks)
      history.append({"epoch": epoch, "loss": loss, **m})
      bar.set_postfix(loss=f"{loss:.4f}", val_ndcg10=f"{m['ndcg@10']:.4f}", best=f"{best:.4f}")
      if m["ndcg@10"] > best:
        best, best_params, best_epoch, bad = m["ndcg@10"], self.params, epoch, 0
      else:
        bad += 1
        if bad >= cfg.patience:
          break
    bar.close()
    self.params = best_params
    log(f"sasrec: best epoch {best_epoch}, valid NDCG@10 {best:.4f}")
    return {"best_epoch": best_epoch, "best_valid_ndcg@10": best, "history": history}


def popularity_topk(train_seqs, histories, n_items: int, k: int) -> np.ndarray:
  """Baseline: the k most frequent training items not in the user's history."""
  counts = np.bincount([i for s in train_seqs for i in s], minlength=n_items)
  order = np.argsort(-counts, kind="stable")
  out = np.zeros([len(histories), k], np.int32)
  for u, h in enumerate(histories):
    hs = set(h)
    out[u] = [i for i in order[: k + len(hs)] if i not in hs][:k]
  return out
