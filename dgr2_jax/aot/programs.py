"""Programs built from shapes (nothing allocated unless run): the decoders at a model's shape,
one decoding step, and a loop of window forwards, as the benchmarks and compile-only checks build
them.

`SHAPES`: model shapes by name (`tiny`, `small`, Qwen3 `qwen3_0p6b`, `qwen3_8b`); `model_config`
gives one at a depth, in bf16 with compute dtype 'auto'. `decoder_program` is a decoder (AR, block
diffusion with either K/V write, a speculative round) jitted with the `jax.ShapeDtypeStruct`s of
its arguments, its params prepared as serving prepares them (`qwen3.decode_params`: projections
fused, kernels in the weight dtype); `step_program` one decoding step (a window forward against a
KV cache and the vocabulary term of its predicting positions). Under a compile-only target
(`targets.compile_for`) they lower with the routes that target takes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dgr2_jax.aot.weight_reads import leaves_of
from dgr2_jax.decode import sampler, speculative
from dgr2_jax.model import masks, qwen3
from dgr2_jax.model.config import Qwen3Config

SHAPES = {
    "tiny": dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "small": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32),
    "qwen3_0p6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3_8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}


def model_config(shape: str, layers: int) -> Qwen3Config:
  """`SHAPES[shape]` at `layers` layers: bf16 params, compute dtype 'auto', 'xla' attention, the last
  id as the mask token."""
  return Qwen3Config(rope_theta=1e6, **dict(SHAPES[shape], num_hidden_layers=layers),
                     param_dtype="bfloat16", dtype="auto", attention_impl="xla",
                     mask_token_id=SHAPES[shape]["vocab_size"] - 1, eos_token_id=0, pad_token_id=0)


def prepared_shapes(cfg: Qwen3Config, weight_dtype: str = "") -> dict:
  """ShapeDtypeStructs of the params a decoder's loop reads (`qwen3.decode_params`: per layer,
  projections fused, kernels in `weight_dtype`), prepared outside the decoder as serving does."""
  # Prepared in the params' own dtype: a decoder computing in another dtype casts them (and is caught).
  auto = cfg.replace(dtype="auto")
  return jax.eval_shape(lambda p: qwen3.decode_params(auto, p, weight_dtype), qwen3.param_shapes(cfg))


def decoder_program(program: str, cfg: Qwen3Config, batch: int, prompt_len: int, new_tokens: int, block: int,
                    weight_dtype: str = ""):
  """(jitted decoder, argument ShapeDtypeStructs, weight leaves) of one program, its params
  prepared (`prepared_shapes`)."""
  pshape = prepared_shapes(cfg, weight_dtype)
  sd = jax.ShapeDtypeStruct
  toks, lens = sd((batch, prompt_len), jnp.int32), sd((batch,), jnp.int32)
  scalars = (sd((), jnp.float32), sd((), jnp.float32), sd((), jnp.int32), sd((), jnp.float32),
             sd((2,), jnp.uint32), sd((), jnp.int32))
  mask = cfg.mask_token_id
  if program == "speculative":
    dc = sampler.DecodeConfig(block_size=block, max_new_tokens=new_tokens, eos_ids=(0,), mask_token_id=mask,
                              kv_write="separate", steps_per_block=0, weight_dtype=weight_dtype)
    fn = speculative.decoder_for(cfg, cfg, dc)
    return fn, (pshape, pshape, toks, lens) + scalars, leaves_of((pshape, pshape))
  bs = 1 if program == "ar" else block
  dc = sampler.DecodeConfig(block_size=bs, max_new_tokens=new_tokens, eos_ids=(0,), mask_token_id=mask,
                            kv_write="fused" if program == "diffusion_fused" else "separate", steps_per_block=0,
                            weight_dtype=weight_dtype)
  fn = sampler.decoder_for(cfg, dc)[1]
  return fn, (pshape, toks, lens) + scalars, leaves_of(pshape)


def step_program(program: str, cfg: Qwen3Config, batch: int, slots: int, block: int, weight_dtype: str = ""):
  """(jitted step, argument ShapeDtypeStructs): one window forward against a `slots` KV cache and
  the vocabulary term of its predicting positions, as one decoding step runs them."""
  pshape = prepared_shapes(cfg, weight_dtype)
  sd = jax.ShapeDtypeStruct
  width = {"ar": 1, "diffusion_fused": 2 * block}.get(program, block)   # fused: [previous block | canvas]
  c = cfg.as_block_diffusion(1) if width == 1 else cfg.as_block_diffusion(min(width, block))
  cache = jax.eval_shape(lambda: qwen3.init_cache(c, batch, slots))

  def step(params, cache, tokens, start, plen, positions, keys):
    h, cache = sampler.window_forward(c, params, tokens, start, cache, plen, slots - 256, positions, return_hidden=True)
    h = h[:, width - min(width, block):]                     # the predicting positions (fused: the canvas's)
    tok, lp = sampler.choose(c, params, h, keys, jnp.float32(0), jnp.int32(0), jnp.float32(1), c.mask_token_id)
    return tok, lp, cache

  args = (pshape, cache, sd((batch, width), jnp.int32), sd((batch,), jnp.int32), sd((batch,), jnp.int32),
          sd((batch, slots), jnp.int32), sd((batch, 2), jnp.uint32))
  return jax.jit(step, donate_argnums=(1,)), args


def full_weight_bytes(cfg: Qwen3Config, weight_dtype: str = "") -> tuple[int, int]:
  """(bytes of every weight, bytes a step must read: all but the untied input embedding), prepared
  for `weight_dtype`."""
  leaves = leaves_of(prepared_shapes(cfg, weight_dtype))
  total = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for _, x in leaves)
  emb = [int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for p, x in leaves if p.startswith("embed_tokens")][0]
  return total, total - (0 if cfg.tie_word_embeddings else emb)



def window_loop(cfg, params, batch: int, slots: int, width: int, head: bool = False, n: int = 50):
  """A compiled call running `n` forwards of a `width`-slot window against a `slots` KV cache in
  one `fori_loop` (each writing the cache the next one reads; `head`: the window's positions
  projected to the vocabulary too, as a decoding step does). Returns (call, n)."""
  p = slots - 64
  plen = jnp.full((batch,), p, jnp.int32)
  pos = masks.left_pad_positions(plen, p, slots)
  c = cfg.as_block_diffusion(1) if width == 1 else cfg.as_block_diffusion(min(width, 32), cfg.mask_token_id)
  toks = jnp.zeros((batch, width), jnp.int32)

  @jax.jit
  def loop(cache):
    def body(i, carry):
      cache, acc = carry
      h, cache = sampler.window_forward(c, params, toks + i % 2, p, cache, plen, p, pos, return_hidden=True)
      return cache, acc + (qwen3.lm_head(c, params, h).max() if head else h[0, 0, 0])
    return jax.lax.fori_loop(0, n, body, (cache, jnp.float32(0)))
  cache = qwen3.init_cache(c, batch, slots)
  call = lambda: loop(cache)
  jax.block_until_ready(call())
  return call, n
