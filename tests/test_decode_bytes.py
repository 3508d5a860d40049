"""Decode numerics and bytes: the working dtype (bf16 decoding agrees with f32; no weight converted
to f32 in the loop), the LM head read once per step (vocabulary tiles beyond the logits budget equal
the whole-row choice and the reference decoder), and the weight-read counter (dgr2_jax/aot/
weight_reads.py, benchmarks/decode_bytes.py's) checked on hand-made programs whose answers are known."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgr2_jax.aot import programs, weight_reads
from dgr2_jax.decode import reference, sampler
from dgr2_jax.model import logits as logits_lib
from dgr2_jax.model import qwen3
from dgr2_jax.model.config import Qwen3Config


sd = jax.ShapeDtypeStruct
PROMPTS = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [21, 22, 23]]


def _counts(fn, args, names):
  """Counts of fn's loop; its first len(names) arguments are the weights."""
  return weight_reads.analyse(weight_reads.lowered_text(jax.jit(fn), args), list(zip(names, args)))


def test_counter_on_a_known_program():
  """w is read by two matmuls and converted to f32 (read, then its f32 copy read twice over by
  the convert back): 5 reads, 2 convert events; v: a 4-step scan reads a quarter of it each step
  plus one matmul in one branch of a conditional (the larger branch counts): 2 reads. One
  data-dependent loop + one conditional = 2 host round trips per step."""
  def f(w, v, x):
    def body(c):
      i, x = c
      y = x @ w
      y = y + jnp.tanh(x) @ w.astype(jnp.float32).astype(x.dtype)
      tile = lambda a, j: (a + x[:, :4] @ jax.lax.dynamic_slice_in_dim(v, j * 4, 4), None)
      y = y + jax.lax.scan(tile, jnp.zeros_like(x), jnp.arange(4))[0]
      y = jax.lax.cond(y.sum() > 0, lambda: y @ v.T, lambda: y)
      return i + 1, y
    return jax.lax.while_loop(lambda c: c[0] < x.sum(), body, (0, x))
  args = (sd((16, 16), jnp.bfloat16), sd((16, 16), jnp.bfloat16), sd((2, 16), jnp.bfloat16))
  res = _counts(f, args, ["layers_0/w", "v"])
  assert res["reads"]["layers_0/w"] == 5.0
  assert res["reads"]["v"] == 2.0
  assert [w.split()[0] for _, w in res["converts"]] == ["converts", "reads"]
  assert res["round_trips_per_token"] == 2.0

  def once(w, x):   # the same weight read once: nothing flagged, and a fixed-length loop costs no trip
    return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ w), (0, x))
  res = _counts(once, args[::2], ["layers_0/w"])
  assert res["reads"]["layers_0/w"] == 1.0 and not res["converts"] and res["round_trips_per_token"] == 0.0


def test_counter_on_nested_decode_loops():
  """A speculative group's shape: 3 cycles of (2 steps reading w, then one reading v) in a
  data-dependent loop. Each loop that reads a layer itself is a step: w and v read once per their
  own step, and 1 host round trip per 9 steps; a layer weight read twice inside one step is not
  hidden by the nesting."""
  def f(w, v, x):
    def cycle(_, y):
      y = jax.lax.fori_loop(0, 2, lambda _, z: z @ w, y)
      return y @ v
    return jax.lax.while_loop(lambda c: c[0] < c[1].sum(), lambda c: (c[0] + 1, jax.lax.fori_loop(0, 3, cycle, c[1])),
                              (0, x))
  args = (sd((16, 16), jnp.bfloat16), sd((16, 16), jnp.bfloat16), sd((2, 16), jnp.bfloat16))
  res = _counts(f, args, ["layers_0/w", "layers_1/v"])
  assert res["reads"] == {"layers_0/w": 1.0, "layers_1/v": 1.0}
  assert res["round_trips_per_token"] == pytest.approx(1 / 9)

  def twice(w, v, x):   # v read in the cycle and again by a second matmul: 2 per step
    cycle = lambda _, y: jax.lax.fori_loop(0, 2, lambda _, z: z @ w, y) @ v @ v
    return jax.lax.while_loop(lambda c: c[0] < c[1].sum(), lambda c: (c[0] + 1, jax.lax.fori_loop(0, 3, cycle, c[1])),
                              (0, x))
  assert _counts(twice, args, ["layers_0/w", "layers_1/v"])["reads"]["layers_1/v"] == 2.0


def _qwen_vocab_config(**kw):
  """Qwen3's vocabulary at a tiny width (shapes only: nothing is allocated)."""
  return Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, param_dtype="bfloat16",
                     mask_token_id=151935, eos_token_id=0, pad_token_id=0, **kw)


@pytest.mark.parametrize("program,batch", [("ar", 8), ("diffusion", 64), ("diffusion_fused", 8), ("speculative", 8)])
def test_bf16_decoder_reads_each_weight_once_and_converts_none(program, batch):
  """The lowered decode loop at Qwen3's vocabulary: every weight (LM head included; the untied
  input embedding is only gathered) read once per step, no weight converted to f32; computing in
  f32 on bf16 weights is caught."""
  cfg = _qwen_vocab_config()
  fn, args, leaves = programs.decoder_program(program, cfg, batch, 40, 64, 32)
  res = weight_reads.analyse(weight_reads.lowered_text(fn, args), leaves)
  for path, r in res["reads"].items():
    want = 0.0 if path.endswith("embed_tokens/embedding") else 1.0
    assert r == pytest.approx(want, abs=1e-9), path
  assert all(0 < g < 0.02 for p, g in res["gathered"].items() if p.endswith("embed_tokens/embedding"))
  assert res["converts"] == []
  if program == "ar":
    fn, args, leaves = programs.decoder_program(program, cfg.replace(dtype="float32"), batch, 40, 64, 32)
    res = weight_reads.analyse(weight_reads.lowered_text(fn, args), leaves)
    assert len({p for p, _ in res["converts"]}) == len(leaves)


def test_vocabulary_tiles_read_the_head_once():
  """Beyond the logits budget the greedy term walks the head in tiles: one read per step (the
  clamped last tile overlaps the one before it by less than a tile)."""
  cfg = _qwen_vocab_config(logits_budget_bytes=4 * 64 * 5000)     # 64 positions x 5,000 columns
  def f(params, h):
    step = lambda c: (c[0] + 1, c[1] + logits_lib.greedy_over_vocab(cfg, params, h, 7)[1].sum())
    return jax.lax.while_loop(lambda c: c[1] < h.sum(), step, (0, jnp.float32(0)))
  pshape = qwen3.param_shapes(cfg)
  leaves = weight_reads.leaves_of(pshape)
  args = (pshape, sd((64, 64), jnp.bfloat16))
  text = jax.jit(f, keep_unused=True).lower(*args).as_text(dialect="hlo")
  counter = weight_reads.Counter(text, ["bf16"] * len(leaves), [int(np.prod(x.shape)) for _, x in leaves])
  loop = counter.run()[0]
  head = [i for i, (p, _) in enumerate(leaves) if p == "lm_head/kernel"][0]
  assert loop.children[0].trip == -(-151936 // 5000)
  assert 1.0 <= loop.reads()[head] / (151936 * 64 * 2) < 1 + 5000 / 151936


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("vocab,tile", [(64, 10), (151936, 40000)])
def test_greedy_over_vocab_equals_the_whole_row(tied, vocab, tile):
  cfg = Qwen3Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=tied,
                    logits_budget_bytes=4 * 6 * tile)
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  w = jax.random.normal(k1, (vocab, 16) if tied else (16, vocab)) * 3
  h = jax.random.normal(k2, (2, 3, 16))
  mask = vocab - 3 if tied else 5
  # The mask token would win position (0, 0): it must be skipped there.
  w = w.at[mask].set(10 * h[0, 0]) if tied else w.at[:, mask].set(10 * h[0, 0])
  params = {"embed_tokens": {"embedding": w}} if tied else {"lm_head": {"kernel": w}}
  tok, lp = logits_lib.greedy_over_vocab(cfg, params, h, mask)
  want_tok, want_lp = sampler._greedy_choice(qwen3.lm_head(cfg, params, h), mask)  # pylint: disable=protected-access
  assert int(jnp.argmax(qwen3.lm_head(cfg, params, h)[0, 0])) == mask
  np.testing.assert_array_equal(tok, want_tok)
  np.testing.assert_allclose(lp, want_lp, atol=1e-5)
  assert logits_lib.vocab_tile(cfg, 6) == tile and vocab % tile   # a clamped, overlapping last tile


@pytest.mark.parametrize("bs", [4])
def test_decoder_beyond_the_logits_budget_equals_reference(tiny_lm, bs):
  """A budget below one row's logits: greedy steps take vocabulary tiles, sampled ones go a row at a
  time; both still equal the plain-Python reference."""
  cfg, params = tiny_lm
  cfg = cfg.replace(logits_budget_bytes=4 * bs * 64 - 4)           # < one row; tiles of 63 / bs columns
  assert sampler._rows_per_chunk(cfg, 3, bs) == 1                 # pylint: disable=protected-access
  for temp, top_k in ((0.0, 0), (0.8, 20)):
    dc = sampler.DecodeConfig(block_size=bs, threshold=0.1, max_new_tokens=8, mask_token_id=63, eos_ids=(5,),
                              temperature=temp, top_k=top_k)
    key = jax.random.PRNGKey(3)
    out = sampler.generate(cfg, params, PROMPTS, dc, rng=key)
    ref = reference.reference_decode(cfg, params, PROMPTS, dc, rng=key)
    np.testing.assert_array_equal(out["tokens"], ref["tokens"])
    np.testing.assert_array_equal(out["commit_step"], ref["commit_step"])
    np.testing.assert_allclose(out["logprob"], ref["logprob"], atol=1e-5)


@pytest.mark.parametrize("bs,tau", [(1, 1.0), (4, 0.9)])
def test_bf16_decoding_agrees_with_f32(tiny_lm, bs, tau):
  """A bf16 checkpoint decodes in bf16 (dtype 'auto', KV cache bf16): most rows decode the same
  tokens as in f32, and where they do, the log-probs agree to bf16 precision."""
  cfg, params = tiny_lm
  bcfg = cfg.replace(param_dtype="bfloat16")
  bparams = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
  assert bcfg.jnp_dtype == jnp.bfloat16
  r = np.random.RandomState(0)
  prompts = [r.randint(6, 60, size=n).tolist() for n in r.randint(3, 12, size=16)]
  dc = sampler.decode_config_for(cfg, block_size=bs, threshold=tau, max_new_tokens=16, eos_ids=())
  a = sampler.generate(cfg, params, prompts, dc)
  b = sampler.generate(bcfg, bparams, prompts, dc)
  same = [np.array_equal(x, y) and np.array_equal(s, t)
          for x, y, s, t in zip(a["tokens"], b["tokens"], a["commit_step"], b["commit_step"])]
  assert sum(same) >= 12, same
  d = np.abs(a["logprob"] - b["logprob"])[np.asarray(same)]
  assert d.max() < 0.1 and d.mean() < 0.02, (d.max(), d.mean())
  assert not np.array_equal(a["logprob"], b["logprob"])        # it did compute in bf16


def test_top_k_top_p_from_candidates_equal_the_sorted_filters():
  """The lax.top_k candidates keep exactly what a sort of the whole row keeps, at Qwen3's
  vocabulary; a flat row whose top-p mass the candidates do not reach takes the sorted path."""
  from dgr2_jax.decode import sampling
  v = 151936
  x = jax.random.normal(jax.random.PRNGKey(0), (3, v)) * 3
  x = x.at[1].set(jax.random.normal(jax.random.PRNGKey(1), (v,)) * 0.01)
  fast, full = jax.jit(sampling._filter_top_k_top_p), jax.jit(sampling._filter_sorted)  # pylint: disable=protected-access
  for k, p in ((0, 0.9), (20, 1.0), (20, 0.5), (2000, 1.0), (0, 0.999), (1, 0.3), (1024, 0.9)):
    a, b = fast(x, jnp.int32(k), jnp.float32(p)), full(x, jnp.int32(k), jnp.float32(p))
    np.testing.assert_array_equal(np.asarray(a) > -1e29, np.asarray(b) > -1e29)
    np.testing.assert_array_equal(np.where(np.asarray(a) > -1e29, a, 0), np.where(np.asarray(b) > -1e29, b, 0))
