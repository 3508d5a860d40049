"""Qwen3 decoder as functional Flax linen modules, numerically matching transformers' Qwen3.

Parameters are a plain nested dict whose names follow HF (`layers_3/self_attn/q_proj/kernel`), so
the HF <-> ours mapping in `checkpoint.py` is a table. Attention takes an explicit mask (a dense
boolean array, or the key ranges of `attention.Ranges` / `attention.Streams` built in `masks.py`
and `streams.py`) and explicit position ids, and runs the route `config.attention_impl` names
(model/attention.py); the KV cache is a plain pytree created by `init_cache`, written with
`dynamic_update_slice` at `cache_index` (one slot for all rows, or one per row) and returned,
never mutated.

Shapes: B batch, T query tokens, S key slots (= T without cache, = cache length with cache),
H query heads, K kv heads, G = H // K, D head_dim, E hidden, F intermediate, V vocab.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dgr2_jax.model import attention
from dgr2_jax.model.config import Qwen3Config

Params = dict
Cache = list  # one {"k": [B, S, K, D], "v": [B, S, K, D]} per layer

class RMSNorm(nn.Module):
  dim: int
  eps: float
  param_dtype: Any

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (self.dim,), self.param_dtype)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    # HF: weight * normed.to(input_dtype)
    return scale.astype(x.dtype) * x32.astype(x.dtype)


def rotate_half(x):
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([-x2, x1], axis=-1)


def rope_cos_sin(config: Qwen3Config, positions: jnp.ndarray, dtype):
  """positions [B, T] -> cos, sin [B, T, 1, D] (computed in f32, cast like HF)."""
  inv_freq, scale = config.rope_inv_freq_and_scale()
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B,T,D/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return ((jnp.cos(emb) * scale).astype(dtype)[:, :, None, :],
          (jnp.sin(emb) * scale).astype(dtype)[:, :, None, :])


def _dense(features, name, config, use_bias=False):
  return nn.Dense(features, use_bias=use_bias, name=name, dtype=config.jnp_dtype,
                  param_dtype=config.jnp_param_dtype,
                  kernel_init=nn.initializers.normal(0.02))


class Attention(nn.Module):
  config: Qwen3Config

  @nn.compact
  def __call__(self, x, positions, mask, cache, cache_index):
    c = self.config
    b, t, _ = x.shape
    h, k, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q = _dense(h * d, "q_proj", c, c.attention_bias)(x).reshape(b, t, h, d)
    kk = _dense(k * d, "k_proj", c, c.attention_bias)(x).reshape(b, t, k, d)
    v = _dense(k * d, "v_proj", c, c.attention_bias)(x).reshape(b, t, k, d)
    q = RMSNorm(d, c.rms_norm_eps, c.jnp_param_dtype, name="q_norm")(q)
    kk = RMSNorm(d, c.rms_norm_eps, c.jnp_param_dtype, name="k_norm")(kk)
    cos, sin = rope_cos_sin(c, positions, x.dtype)
    q = q * cos + rotate_half(q) * sin
    kk = kk * cos + rotate_half(kk) * sin

    new_cache = None
    if cache is not None:
      kk = _write_cache(cache["k"], kk, cache_index)                       # [B,S,K,D]
      v = _write_cache(cache["v"], v, cache_index)
      new_cache = {"k": kk, "v": v}

    qg = q.reshape(b, t, k, h // k, d)  # [B,T,K,G,D]
    out = attention.attend(qg, kk.astype(qg.dtype), v.astype(x.dtype), mask, c.attention_impl,
                           c.attention_k_splits)
    return _dense(c.hidden_size, "o_proj", c, c.attention_bias)(out.reshape(b, t, h * d)), new_cache


def _write_cache(buf, x, index):
  """Writes x [B,T,K,D] into buf [B,S,K,D] at slot `index` (scalar, or [B]: one slot per row)."""
  x = x.astype(buf.dtype)
  index = jnp.asarray(index)
  if index.ndim == 0:
    return jax.lax.dynamic_update_slice(buf, x, (0, index, 0, 0))
  return jax.vmap(lambda c_, x_, i: jax.lax.dynamic_update_slice(c_, x_, (i, 0, 0)))(buf, x, index)


class MLP(nn.Module):
  config: Qwen3Config

  @nn.compact
  def __call__(self, x):
    c = self.config
    gate = _dense(c.intermediate_size, "gate_proj", c)(x)  # [B,T,F]
    up = _dense(c.intermediate_size, "up_proj", c)(x)
    return _dense(c.hidden_size, "down_proj", c)(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
  config: Qwen3Config

  @nn.compact
  def __call__(self, x, positions, mask, cache, cache_index):
    c = self.config
    hid = RMSNorm(c.hidden_size, c.rms_norm_eps, c.jnp_param_dtype, name="input_layernorm")(x)
    attn, new_cache = Attention(c, name="self_attn")(hid, positions, mask, cache, cache_index)
    x = x + attn
    hid = RMSNorm(c.hidden_size, c.rms_norm_eps, c.jnp_param_dtype, name="post_attention_layernorm")(x)
    return x + MLP(c, name="mlp")(hid), new_cache


REMAT_POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,   # recompute the whole layer
    "dots_saveable": jax.checkpoint_policies.dots_saveable,         # keep matmul outputs
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload_dots": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


class ScannedLayer(nn.Module):
  """A decoder layer as the body of `nn.scan` over the stack (no KV cache: training and scoring)."""
  config: Qwen3Config

  @nn.compact
  def __call__(self, x, positions, mask):
    return _layer_cls(self.config)(self.config, name="layer")(x, positions, mask, None, 0)[0], None


def _layer_cls(c: Qwen3Config):
  if not c.remat:
    return DecoderLayer
  return nn.remat(DecoderLayer, static_argnums=(), policy=REMAT_POLICIES[c.remat_policy])


class Qwen3(nn.Module):
  config: Qwen3Config

  @nn.compact
  def __call__(self, tokens, positions, mask, cache=None, cache_index=0, return_hidden=False):
    c = self.config
    embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=c.jnp_dtype, param_dtype=c.jnp_param_dtype,
                     embedding_init=nn.initializers.normal(0.02), name="embed_tokens")
    x = embed(tokens)  # [B,T,E]
    new_cache = []
    if c.scan_layers:
      if cache is not None:
        raise ValueError("a KV cache needs per-layer params: forward() unstacks scanned layers for it")
      # One traced layer, scanned over the stacked params [L, ...] (compile time independent of depth).
      stack = nn.scan(ScannedLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=(nn.broadcast, nn.broadcast), length=c.num_hidden_layers)
      x, _ = stack(c, name="layers")(x, positions, mask)
    else:
      layer_cls = _layer_cls(c)
      for i in range(c.num_hidden_layers):
        x, lc = layer_cls(c, name=f"layers_{i}")(x, positions, mask,
                                                  None if cache is None else cache[i], cache_index)
        new_cache.append(lc)
    x = RMSNorm(c.hidden_size, c.rms_norm_eps, c.jnp_param_dtype, name="norm")(x)
    if return_hidden:
      return x, (new_cache if cache is not None else None)
    if c.tie_word_embeddings:
      logits = embed.attend(x)
    else:
      logits = _dense(c.vocab_size, "lm_head", c)(x)
    return logits.astype(jnp.float32), (new_cache if cache is not None else None)


def lm_head(config: Qwen3Config, params: Params, hidden: jnp.ndarray) -> jnp.ndarray:
  """hidden [..., E] -> f32 logits [..., V]; lets losses project only the positions they need."""
  w = params["embed_tokens"]["embedding"].T if config.tie_word_embeddings else params["lm_head"]["kernel"]
  return jnp.einsum("...e,ev->...v", hidden.astype(config.jnp_dtype), w.astype(config.jnp_dtype),
                    preferred_element_type=jnp.float32)


def forward(config: Qwen3Config, params: Params, tokens, positions, mask, cache: Cache | None = None,
            cache_index=0, return_hidden: bool = False):
  """tokens, positions [B, T] int; mask [B, T, S] bool -> (f32 logits [B, T, V], new cache or None).

  With `return_hidden=True` returns the final-norm hidden states [B, T, E] instead of logits.
  Params in either layout (`stack_layers`); the config's `scan_layers` picks the computation.
  """
  config, params = (config.replace(scan_layers=False), unstack_layers(params)) if cache is not None else (
      config, to_layout(config, params))
  return Qwen3(config).apply({"params": params}, tokens, positions, mask, cache, cache_index,
                             return_hidden)


# ---- layouts of the layer parameters: per layer (`layers_3/...`, the HF-named tree every model
# directory holds) or stacked (`layers/layer/...` with a leading [L] axis, what `nn.scan` trains) --
def is_stacked(params) -> bool:
  return "layers" in params


def stack_layers(params: Params) -> Params:
  """Per-layer tree -> stacked tree (leaves [L, ...]); the other entries are shared."""
  if is_stacked(params):
    return params
  names = sorted((k for k in params if k.startswith("layers_")), key=lambda k: int(k.split("_")[1]))
  out = {k: v for k, v in params.items() if not k.startswith("layers_")}
  stack = np.stack if isinstance(jax.tree_util.tree_leaves(params[names[0]])[0], np.ndarray) else jnp.stack
  out["layers"] = {"layer": jax.tree_util.tree_map(lambda *xs: stack(xs), *[params[n] for n in names])}
  return out


def unstack_layers(params: Params) -> Params:
  """Stacked tree -> per-layer tree (the checkpoint layout)."""
  if not is_stacked(params):
    return params
  layer = params["layers"]["layer"]
  n = jax.tree_util.tree_leaves(layer)[0].shape[0]
  out = {k: v for k, v in params.items() if k != "layers"}
  out.update({f"layers_{i}": jax.tree_util.tree_map(lambda x, i=i: x[i], layer) for i in range(n)})
  return out


def decode_params(config: Qwen3Config, params: Params) -> Params:
  """The parameters a decoder's loop reads: per layer (the KV cache is per layer) and every float
  leaf in the compute dtype `config.jnp_dtype`, so that no step converts a weight (f32 master
  weights decoding in bf16 are cast once per call, before the loop). A per-layer tree already in
  that dtype (a checkpoint decoding with dtype 'auto') is returned as it is: nothing is copied."""
  dt = config.jnp_dtype
  cast = lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dt else x
  return jax.tree_util.tree_map(cast, unstack_layers(params))


def to_layout(config: Qwen3Config, params: Params) -> Params:
  """`params` in the layout `config.scan_layers` computes with."""
  return stack_layers(params) if config.scan_layers else unstack_layers(params)


def init_params(config: Qwen3Config, rng) -> Params:
  t = jnp.zeros((1, 1), jnp.int32)
  return Qwen3(config).init(rng, t, t, jnp.ones((1, 1, 1), bool))["params"]


def param_shapes(config: Qwen3Config) -> Params:
  """Parameter ShapeDtypeStructs without allocating (jax.eval_shape)."""
  return jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))


def count_params(tree) -> int:
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(tree))


def init_cache(config: Qwen3Config, batch: int, max_len: int, dtype=None) -> Cache:
  dtype = dtype or config.jnp_dtype
  shape = (batch, max_len, config.num_key_value_heads, config.head_dim)
  return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
          for _ in range(config.num_hidden_layers)]


# Logical axis names of every parameter (MaxText style), mapped to mesh axes by the rules table in
# the training config. Keyed by the last two path components.
PARAM_LOGICAL_AXES = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("q_proj", "kernel"): ("embed", "heads"),
    ("k_proj", "kernel"): ("embed", "heads"),
    ("v_proj", "kernel"): ("embed", "heads"),
    ("o_proj", "kernel"): ("heads", "embed"),
    ("q_proj", "bias"): ("heads",),
    ("k_proj", "bias"): ("heads",),
    ("v_proj", "bias"): ("heads",),
    ("o_proj", "bias"): ("embed",),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("q_norm", "scale"): (None,),
    ("k_norm", "scale"): (None,),
    ("input_layernorm", "scale"): (None,),
    ("post_attention_layernorm", "scale"): (None,),
    ("norm", "scale"): (None,),
}


def param_logical_axes(params) -> Any:
  """Pytree of logical-axis tuples with the structure of `params` (stacked layers: a leading
  unsharded layer axis)."""
  def axes(path, _):
    key = tuple(getattr(p, "key", str(p)) for p in path[-2:])
    if key not in PARAM_LOGICAL_AXES:
      raise KeyError(f"no logical axes for parameter {'/'.join(map(str, key))}")
    stacked = getattr(path[0], "key", None) == "layers"
    return ((None,) if stacked else ()) + PARAM_LOGICAL_AXES[key]
  return jax.tree_util.tree_map_with_path(axes, params)
