"""Qwen3 decoder as functional Flax linen modules, numerically matching transformers' Qwen3.

Parameters are a plain nested dict whose names follow HF (`layers_3/self_attn/q_proj/kernel`), so
the HF <-> ours mapping in `checkpoint.py` is a table. Attention takes an explicit mask (a dense
boolean array, or the key ranges of `attention.Ranges` / `attention.Streams` built in `masks.py`
and `streams.py`) and explicit position ids, and runs the route `config.attention_impl` names
(model/attention.py); the KV cache is a plain pytree created by `init_cache`, written with
`dynamic_update_slice` at `cache_index` (one slot for all rows, or one per row) and returned,
never mutated.

Decoding reads a prepared tree (`decode_params`): per layer, in the compute dtype, q/k/v fused into one
`qkv_proj` and gate/up into one `gate_up_proj` (one matmul each per layer and step), and optionally
the projection kernels in float8 with a per-output-channel scale. The modules compute with whichever
layout they are given; init, training and checkpoints keep the HF layout.

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
    # The mean of squares in f32, as HF computes it: in bf16 its 8-bit mantissa would round the
    # variance of a 1024..4096-wide row visibly, and the parity tests against transformers hold
    # at 1e-4; the cost is a convert of one activation row, nothing next to a weight read.
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


def embed_rows(table, tokens):
  """table [V, ...] (an embedding or its per-row scale, sharded over V under tensor parallelism),
  tokens [...] int -> table[tokens] [..., ...] (jnp.take).

  Under tensor parallelism XLA partitions the lookup vocabulary-parallel: each device takes the
  rows in its shard, zeros the others, and the rows are summed over the shards (an all-reduce of
  [rows, E]). A lookup of one row (an AR step at batch 1) is taken as two copies of that row, one
  kept: XLA's GPU compiler rewrites a one-index gather as a dynamic-slice before partitioning, and a
  dynamic-slice of a vocabulary-sharded table partitions by all-gathering the whole table, every
  step (1.2 GB for Qwen3-8B's input embedding)."""
  if tokens.size != 1:
    return jnp.take(table, tokens, axis=0)
  two = jnp.broadcast_to(tokens.reshape(1), (2,))
  return jnp.take(table, two, axis=0)[:1].reshape(tokens.shape + table.shape[1:])


def _dense(features, name, config, use_bias=False):
  return nn.Dense(features, use_bias=use_bias, name=name, dtype=config.jnp_dtype,
                  param_dtype=config.jnp_param_dtype,
                  kernel_init=nn.initializers.normal(0.02))


# Whether a float8 weight's dequantizing convert is tied to the step's activations (`in_step`);
# tests turn it off to see XLA hoist the converts.
PIN_DEQUANT = True


def in_step(w, x):
  """(w, x) as they are, w's uses tied to x's: when w is a float8 weight and x a value a decode
  step computes, XLA cannot hoist w's convert out of the decode loop (loop-invariant code motion
  would convert the whole weight once, before the loop, and every step would read the wide copy:
  XLA's CPU backend does so). An optimization barrier moves no data."""
  if not PIN_DEQUANT or w.dtype not in _FLOAT8:
    return w, x
  return jax.lax.optimization_barrier((w, x))


def _matmul(x, p: dict, dt):
  """x [..., In] @ a prepared projection `p` (`decode_params`: kernel [In, Out], optional bias
  [Out] and kernel_scale [Out]) in the compute dtype `dt`, as nn.Dense computes it. A float8
  kernel is converted to `dt` as the matmul's operand (XLA fuses the convert into the dot: the
  step reads the float8 bytes; `in_step` keeps it in the loop) and the f32 product's columns are
  scaled by `kernel_scale`."""
  w = p["kernel"]
  dims = (((x.ndim - 1,), (0,)), ((), ()))
  if "kernel_scale" in p:
    w, x = in_step(w, x)
    y = jax.lax.dot_general(x.astype(dt), w.astype(dt), dims, preferred_element_type=jnp.float32)
    y = (y * p["kernel_scale"]).astype(dt)
  else:
    y = jax.lax.dot_general(x.astype(dt), w.astype(dt), dims)
  return y + p["bias"].astype(dt) if "bias" in p else y


def _project(mod: nn.Module, x, name: str, features: int, use_bias: bool = False):
  """The projection `name` of module `mod`: nn.Dense on the trained layout; a quantized one
  (`decode_params` with a weight dtype) through `_matmul`."""
  if mod.has_variable("params", name) and "kernel_scale" in mod.get_variable("params", name):
    return _matmul(x, mod.get_variable("params", name), mod.config.jnp_dtype)
  return _dense(features, name, mod.config, use_bias)(x)


class Attention(nn.Module):
  config: Qwen3Config

  @nn.compact
  def __call__(self, x, rope, mask, cache, cache_index):
    c = self.config
    b, t, _ = x.shape
    h, k, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    g = h // k
    if self.has_variable("params", "qkv_proj"):   # decode_params: one matmul, columns [K, G + 2, D]
      qkv = _matmul(x, self.get_variable("params", "qkv_proj"), c.jnp_dtype).reshape(b, t, k, g + 2, d)
      q, kk, v = qkv[:, :, :, :g].reshape(b, t, h, d), qkv[:, :, :, g], qkv[:, :, :, g + 1]
    else:
      q = _project(self, x, "q_proj", h * d, c.attention_bias).reshape(b, t, h, d)
      kk = _project(self, x, "k_proj", k * d, c.attention_bias).reshape(b, t, k, d)
      v = _project(self, x, "v_proj", k * d, c.attention_bias).reshape(b, t, k, d)
    q = RMSNorm(d, c.rms_norm_eps, c.jnp_param_dtype, name="q_norm")(q)
    kk = RMSNorm(d, c.rms_norm_eps, c.jnp_param_dtype, name="k_norm")(kk)
    cos, sin = rope
    q = q * cos + rotate_half(q) * sin
    kk = kk * cos + rotate_half(kk) * sin

    new_cache = None
    if cache is not None:
      kk = _write_cache(cache["k"], kk, cache_index)                       # [B,S,K,D]
      v = _write_cache(cache["v"], v, cache_index)
      new_cache = {"k": kk, "v": v}

    qg = q.reshape(b, t, k, g, d)  # [B,T,K,G,D]
    out = attention.attend(qg, kk.astype(qg.dtype), v.astype(x.dtype), mask, c.attention_impl,
                           c.attention_k_splits)
    return _project(self, out.reshape(b, t, h * d), "o_proj", c.hidden_size, c.attention_bias), new_cache


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
    if self.has_variable("params", "gate_up_proj"):   # decode_params: one matmul, columns [F, 2]
      gu = _matmul(x, self.get_variable("params", "gate_up_proj"), c.jnp_dtype)
      gu = gu.reshape(gu.shape[:-1] + (c.intermediate_size, 2))
      gate, up = gu[..., 0], gu[..., 1]
    else:
      gate = _project(self, x, "gate_proj", c.intermediate_size)  # [B,T,F]
      up = _project(self, x, "up_proj", c.intermediate_size)
    return _project(self, nn.silu(gate) * up, "down_proj", c.hidden_size)


class DecoderLayer(nn.Module):
  """rope: (cos, sin) [B, T, 1, D] of the tokens' positions (`rope_cos_sin`, once per forward)."""
  config: Qwen3Config

  @nn.compact
  def __call__(self, x, rope, mask, cache, cache_index):
    c = self.config
    hid = RMSNorm(c.hidden_size, c.rms_norm_eps, c.jnp_param_dtype, name="input_layernorm")(x)
    attn, new_cache = Attention(c, name="self_attn")(hid, rope, mask, cache, cache_index)
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
  def __call__(self, x, rope, mask):
    return _layer_cls(self.config)(self.config, name="layer")(x, rope, mask, None, 0)[0], None


def _layer_cls(c: Qwen3Config):
  if not c.remat:
    return DecoderLayer
  return nn.remat(DecoderLayer, static_argnums=(), policy=REMAT_POLICIES[c.remat_policy])


class Qwen3(nn.Module):
  config: Qwen3Config

  @nn.compact
  def __call__(self, tokens, positions, mask, cache=None, cache_index=0, return_hidden=False):
    c = self.config
    quantized_embed = self.has_variable("params", "embed_tokens") and (
        "embedding_scale" in self.get_variable("params", "embed_tokens"))
    if quantized_embed:   # decode_params quantized the tied embedding: dequantize the gathered rows
      e = self.get_variable("params", "embed_tokens")
      table, tokens = in_step(e["embedding"], tokens)
      x = (embed_rows(table, tokens).astype(jnp.float32)
           * embed_rows(e["embedding_scale"], tokens)[..., None]).astype(c.jnp_dtype)
    else:
      embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=c.jnp_dtype, param_dtype=c.jnp_param_dtype,
                       embedding_init=nn.initializers.normal(0.02), name="embed_tokens")
      x = embed_rows(embed.embedding.astype(c.jnp_dtype), tokens)  # [B,T,E], as embed(tokens) computes it
    # Every layer rotates by the same positions: cos/sin once per forward, not once per layer.
    rope = rope_cos_sin(c, positions, c.jnp_dtype)
    new_cache = []
    if c.scan_layers:
      if cache is not None:
        raise ValueError("a KV cache needs per-layer params: forward() unstacks scanned layers for it")
      # One traced layer, scanned over the stacked params [L, ...] (compile time independent of depth).
      stack = nn.scan(ScannedLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=(nn.broadcast, nn.broadcast), length=c.num_hidden_layers)
      x, _ = stack(c, name="layers")(x, rope, mask)
    else:
      layer_cls = _layer_cls(c)
      for i in range(c.num_hidden_layers):
        x, lc = layer_cls(c, name=f"layers_{i}")(x, rope, mask,
                                                  None if cache is None else cache[i], cache_index)
        new_cache.append(lc)
    x = RMSNorm(c.hidden_size, c.rms_norm_eps, c.jnp_param_dtype, name="norm")(x)
    if return_hidden:
      return x, (new_cache if cache is not None else None)
    if quantized_embed or (self.has_variable("params", "lm_head")
                           and "kernel_scale" in self.get_variable("params", "lm_head")):
      logits = lm_head(c, self.variables["params"], x)
    elif c.tie_word_embeddings:
      logits = embed.attend(x)
    else:
      logits = _dense(c.vocab_size, "lm_head", c)(x)
    return logits.astype(jnp.float32), (new_cache if cache is not None else None)


def lm_head(config: Qwen3Config, params: Params, hidden: jnp.ndarray) -> jnp.ndarray:
  """hidden [..., E] -> f32 logits [..., V]; lets losses project only the positions they need.
  A float8 head (`decode_params`) is dequantized in the matmul: its f32 columns scaled."""
  w, scale = head_weight(config, params)
  w, hidden = in_step(w, hidden)
  x = jnp.einsum("...e,ve->...v" if config.tie_word_embeddings else "...e,ev->...v",
                 hidden.astype(config.jnp_dtype), w.astype(config.jnp_dtype), preferred_element_type=jnp.float32)
  return x if scale is None else x * scale


def head_weight(config: Qwen3Config, params: Params):
  """(the LM head's weight: the tied embedding [V, E] or lm_head's kernel [E, V], its per-vocabulary
  scale [V] f32 when `decode_params` quantized it, else None)."""
  if config.tie_word_embeddings:
    e = params["embed_tokens"]
    return e["embedding"], e.get("embedding_scale")
  return params["lm_head"]["kernel"], params["lm_head"].get("kernel_scale")


def forward(config: Qwen3Config, params: Params, tokens, positions, mask, cache: Cache | None = None,
            cache_index=0, return_hidden: bool = False):
  """tokens, positions [B, T] int; mask [B, T, S] bool -> (f32 logits [B, T, V], new cache or None).

  With `return_hidden=True` returns the final-norm hidden states [B, T, E] instead of logits.
  Params in either layout (`stack_layers`), HF-named or prepared for decoding (`decode_params`);
  the config's `scan_layers` picks the computation.
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


# ---- the decoding layout (`decode_params`) -------------------------------------------------------
# Weight dtypes a decoder may store its projection kernels in (decode/config.py DecodeConfig.weight_dtype):
# the dtype, and the largest finite value, which a column's absolute maximum is scaled to.
QUANTIZED = {"float8_e4m3fn": (jnp.float8_e4m3fn, 448.0)}
_SCALES = ("kernel_scale", "embedding_scale")   # f32 per output channel: never cast to the compute dtype


def decode_params(config: Qwen3Config, params: Params, weight_dtype: str = "", fuse: bool = True) -> Params:
  """The parameters a decoder's loop reads, prepared once per call (not once per step):

  * per layer (the KV cache is per layer), every float leaf in the compute dtype `config.jnp_dtype`
    (f32 master weights decoding in bf16 are cast here, before the loop);
  * `fuse`: per layer, q/k/v fused into `self_attn/qkv_proj` (kernel [E, (H + 2K) D], bias if the
    model has one) and gate/up into `mlp/gate_up_proj` (kernel [E, 2F]): one matmul each per layer
    and step instead of three and two. The columns are ordered per kv head [K, G + 2, D] (its G
    query heads, its key, its value) and per MLP unit [F, 2] (gate, up), so that a tensor-parallel
    split of the columns into equal contiguous shards keeps each shard's heads and units whole;
  * `weight_dtype` ('' = the compute dtype, or a key of QUANTIZED): every projection kernel
    (qkv/q/k/v, o, gate_up/gate/up, down, and the LM head: lm_head's kernel or the tied embedding)
    stored in that float8 dtype with an f32 `kernel_scale` (`embedding_scale`) per output channel
    (its absolute maximum / the dtype's largest value); the projections dequantize in the matmul.
    An untied input embedding stays in the compute dtype (a step gathers a few of its rows).

  Idempotent: a tree it prepared (for the same weight dtype) is returned as it is, nothing copied,
  so serving, eval and benchmarks can prepare once outside their decode calls and the decoder's own
  call (inside its jit) does nothing. A float8 tree asked for weight_dtype '' is an error (it cannot
  be made exact again). Any forward (`forward`, the decoders) computes with either layout."""
  if weight_dtype and weight_dtype not in QUANTIZED:
    raise ValueError(f"weight_dtype must be '' or one of {sorted(QUANTIZED)}, got {weight_dtype!r}")
  params = unstack_layers(params)
  dt = config.jnp_dtype
  quantized = is_quantized(params)
  if quantized and quantized != weight_dtype:
    raise ValueError(f"params hold {quantized} kernels (decode_params weight_dtype={quantized!r}); "
                     f"cannot prepare them for weight_dtype={weight_dtype!r}")
  uncast = lambda x: jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dt and x.dtype not in _FLOAT8
  needs_cast = any(uncast(x) for path, x in _leaves(params) if path[-1] not in _SCALES)
  needs_fuse = fuse and any("q_proj" in params[n]["self_attn"] for n in _layer_names(params))
  if not (needs_cast or needs_fuse or (weight_dtype and not quantized)):
    return params
  cast = lambda path, x: x.astype(dt) if path[-1] not in _SCALES and uncast(x) else x
  params = jax.tree_util.tree_map_with_path(lambda kp, x: cast(tuple(_key(k) for k in kp), x), params)
  if needs_fuse:
    params = {**params, **{n: _fuse_layer(config, params[n]) for n in _layer_names(params)}}
  if weight_dtype and not quantized:
    params = _quantize(config, params, weight_dtype)
  return params


_FLOAT8 = tuple(np.dtype(d) for d, _ in QUANTIZED.values())


def _key(k) -> str:
  return str(getattr(k, "key", k))


def _leaves(params):
  return [(tuple(_key(k) for k in kp), x) for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]]


def _layer_names(params) -> list:
  return [n for n in params if n.startswith("layers_")]


def is_quantized(params) -> str:
  """The QUANTIZED weight dtype a `decode_params` tree holds its kernels in, '' if none."""
  for _, x in _leaves(params):
    for name, (d, _) in QUANTIZED.items():
      if x.dtype == d:
        return name
  return ""


def _fuse_layer(config: Qwen3Config, layer: dict) -> dict:
  """One layer's q/k/v and gate/up projections -> qkv_proj, gate_up_proj (`decode_params`)."""
  k, g, d = config.num_key_value_heads, config.num_kv_groups, config.head_dim
  a, m = layer["self_attn"], layer["mlp"]
  # Leaves [..., H*D] -> [..., K, G, D] (query head h belongs to kv head h // G), k and v -> [..., K, 1, D]:
  # kernels, biases and the float8 scales of a tree quantized unfused alike.
  heads = lambda x, n: x.reshape(x.shape[:-1] + (k, n, d))
  flat = lambda x, n: x.reshape(x.shape[:-n] + (-1,))
  qkv = {leaf: flat(jnp.concatenate([heads(a["q_proj"][leaf], g), heads(a["k_proj"][leaf], 1),
                                     heads(a["v_proj"][leaf], 1)], axis=-2), 3) for leaf in a["q_proj"]}
  gate_up = {leaf: flat(jnp.stack([m["gate_proj"][leaf], m["up_proj"][leaf]], axis=-1), 2)   # [..., F, 2]
             for leaf in m["gate_proj"]}
  attn = {n: v for n, v in a.items() if n not in ("q_proj", "k_proj", "v_proj")}
  mlp = {n: v for n, v in m.items() if n not in ("gate_proj", "up_proj")}
  return {**layer, "self_attn": {**attn, "qkv_proj": qkv}, "mlp": {**mlp, "gate_up_proj": gate_up}}


def quantize(w, axis: int, weight_dtype: str):
  """(w in `weight_dtype`, f32 scale over the other axis): w ~= q * scale, per output channel
  (`axis`: the one reduced over, the input features); an all-zero channel has scale 1."""
  dtype, top = QUANTIZED[weight_dtype]
  w32 = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w32), axis=axis, keepdims=True)
  scale = jnp.where(amax > 0, amax / top, 1.0)
  q = jnp.clip(w32 / scale, -top, top).astype(dtype)
  return q, jnp.squeeze(scale, axis)


_PROJECTIONS = ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "gate_proj", "up_proj",
                "down_proj")


def _quantize(config: Qwen3Config, params: Params, weight_dtype: str) -> Params:
  """Every projection kernel and the LM head of a per-layer tree in `weight_dtype` (`decode_params`)."""
  def proj(p):
    q, s = quantize(p["kernel"], 0, weight_dtype)
    return {**p, "kernel": q, "kernel_scale": s}
  out = dict(params)
  for n in _layer_names(params):
    layer = params[n]
    out[n] = {**layer, **{m: {k: proj(v) if k in _PROJECTIONS else v for k, v in layer[m].items()}
                          for m in ("self_attn", "mlp")}}
  if config.tie_word_embeddings:   # the head's output channels are the embedding's rows
    q, s = quantize(params["embed_tokens"]["embedding"], 1, weight_dtype)
    out["embed_tokens"] = {"embedding": q, "embedding_scale": s}
  else:
    out["lm_head"] = proj(params["lm_head"])
  return out


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
    ("qkv_proj", "kernel"): ("embed", "heads"),        # decode_params' layout (decoding only)
    ("qkv_proj", "bias"): ("heads",),
    ("gate_up_proj", "kernel"): ("embed", "mlp"),
    ("q_norm", "scale"): (None,),
    ("k_norm", "scale"): (None,),
    ("input_layernorm", "scale"): (None,),
    ("post_attention_layernorm", "scale"): (None,),
    ("norm", "scale"): (None,),
}
# decode_params' float8 scales: split like their kernel's output axis.
PARAM_LOGICAL_AXES.update({(k[0], "kernel_scale"): v[-1:] for k, v in list(PARAM_LOGICAL_AXES.items())
                           if k[1] == "kernel"})
PARAM_LOGICAL_AXES[("embed_tokens", "embedding_scale")] = ("vocab",)


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
