"""The decoding layout (`qwen3.decode_params`): q/k/v and gate/up fused into one matmul each, and
optionally every projection kernel and the LM head in float8 with a per-output-channel scale.

The fused layout computes what the trained (HF) layout does, up to f32 rounding, and the decoders
give the same tokens with it; preparing is idempotent (a prepared tree comes back as it is); a
float8 decoder computes exactly what the same decoder computes on the dequantized weights, and its
logits stay near bf16's; the lowered decoders at Qwen3's vocabulary run 4 projection matmuls per
layer and step and read each float8 kernel once, its convert kept inside the decode loop."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgr2_jax.aot import programs, weight_reads
from dgr2_jax.decode import config as decode_config
from dgr2_jax.decode import sampler, speculative
from dgr2_jax.model import masks, qwen3
from dgr2_jax.model.config import Qwen3Config


FP8 = "float8_e4m3fn"
forward = jax.jit(qwen3.forward, static_argnums=0)   # one jit per config (eager flax is slow)
PROMPTS = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [21, 22, 23]]
sd = jax.ShapeDtypeStruct


def _tiny(**kw):
  base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rope_theta=10000.0, mask_token_id=63, eos_token_id=5,
              pad_token_id=0)
  return Qwen3Config(**{**base, **kw})


def _params(cfg, seed=1):
  """Random params with non-trivial norms and biases (a wrong mapping of either shows)."""
  p = qwen3.init_params(cfg, jax.random.PRNGKey(seed))
  keys = iter(jax.random.split(jax.random.PRNGKey(seed + 100), 1000))
  return jax.tree_util.tree_map(lambda x: x * 8 if x.ndim == 2 else x + 0.3 * jax.random.normal(next(keys), x.shape),
                                p)


def _forward_inputs(b=3, t=10):
  lens = np.array([t, 7, 4][:b])
  toks = np.random.RandomState(0).randint(0, 60, (b, t))
  valid = masks.left_pad_valid(lens, t, t)
  return toks, masks.left_pad_positions(lens, t, t), masks.sequence_mask(t, t, 1, valid), np.asarray(valid)


@pytest.mark.parametrize("heads,kv,bias,tied", [(4, 2, True, False), (4, 4, False, True), (8, 2, False, False)])
def test_fused_forward_equals_the_trained_layout(heads, kv, bias, tied):
  """Logits of the fused tree vs the HF-layout tree (f32: equal up to the dots' summation order),
  per layer (and scanned, once); and the documented column order of qkv_proj and gate_up_proj."""
  cfg = _tiny(num_attention_heads=heads, num_key_value_heads=kv, attention_bias=bias, tie_word_embeddings=tied)
  params = _params(cfg)
  fused = qwen3.decode_params(cfg, params)
  a = fused["layers_0"]["self_attn"]
  assert "q_proj" not in a and a["qkv_proj"]["kernel"].shape == (32, (heads + 2 * kv) * 8)
  assert ("bias" in a["qkv_proj"]) == bias and fused["layers_0"]["mlp"]["gate_up_proj"]["kernel"].shape == (32, 96)
  toks, pos, mask, valid = _forward_inputs()
  want = np.asarray(forward(cfg, params, toks, pos, mask)[0])
  scale = np.abs(want[valid]).max()
  for c in (cfg, cfg.replace(scan_layers=True)) if bias else (cfg,):
    got = np.asarray(forward(c, fused, toks, pos, mask)[0])
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-5, atol=1e-5 * scale)
  # Columns per kv head [K, G + 2, D] (its query heads, key, value) and per MLP unit [F, 2] (gate, up).
  x = jax.random.normal(jax.random.PRNGKey(5), (3, 32))
  p0 = params["layers_0"]
  qkv = (x @ a["qkv_proj"]["kernel"]).reshape(3, kv, heads // kv + 2, 8)
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))
  close(qkv[:, :, :-2].reshape(3, -1), x @ p0["self_attn"]["q_proj"]["kernel"])
  close(qkv[:, :, -2].reshape(3, -1), x @ p0["self_attn"]["k_proj"]["kernel"])
  close((x @ fused["layers_0"]["mlp"]["gate_up_proj"]["kernel"]).reshape(3, 48, 2)[..., 1],
        x @ p0["mlp"]["up_proj"]["kernel"])


def test_fused_cached_forward_equals_the_trained_layout():
  """Prefill + one-token steps against the KV cache: the fused tree gives the trained layout's logits."""
  cfg = _tiny(attention_bias=True)
  params = _params(cfg)
  fused = qwen3.decode_params(cfg, params)
  toks = np.random.RandomState(1).randint(0, 60, (2, 9))
  pos = np.broadcast_to(np.arange(9), (2, 9))
  ids = masks.slot_block_ids(6, 9, 1)
  valid = np.ones((2, 9), bool)
  outs = {}
  for name, p in (("hf", params), ("fused", fused)):
    cache, logits = qwen3.init_cache(cfg, 2, 9), []
    for lo, hi in ((0, 6), (6, 7), (7, 8), (8, 9)):
      out, cache = forward(cfg, p, toks[:, lo:hi], pos[:, lo:hi], masks.block_causal_mask(ids[lo:hi], ids, valid),
                                 cache, lo)
      logits.append(np.asarray(out))
    outs[name] = np.concatenate(logits, 1)
  np.testing.assert_allclose(outs["fused"], outs["hf"], rtol=1e-5, atol=1e-5 * np.abs(outs["hf"]).max())


def _run(cfg, params, dc, fuse=True):
  _, fn = sampler.decoder_for(cfg, dc, fuse_projections=fuse)
  toks, lens = sampler.left_pad(PROMPTS, 9, dc.pad_id)
  return jax.tree_util.tree_map(np.asarray, sampler.run_decoder(fn, params, toks, lens, dc))


@pytest.mark.parametrize("bs,tau", [(1, 1.0), (4, 0.9)])
def test_greedy_decode_same_tokens_fused_and_unfused(tiny_lm, bs, tau):
  """AR and block diffusion: the decoder fusing inside its jit, on params prepared outside, and
  unfused (`fuse_projections=False`) decode the same tokens at the same steps."""
  cfg, params = tiny_lm
  dc = sampler.DecodeConfig(block_size=bs, threshold=tau, max_new_tokens=8, mask_token_id=63, eos_ids=(5,))
  want = _run(cfg, params, dc, fuse=False)
  prepared = [_run(cfg, qwen3.decode_params(cfg, params), dc)] if bs > 1 else []   # retraced: a new tree
  for got in [_run(cfg, params, dc)] + prepared:
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    np.testing.assert_array_equal(got["commit_step"], want["commit_step"])
    np.testing.assert_allclose(got["logprob"], want["logprob"], atol=1e-5)


def test_decode_params_is_idempotent():
  """A prepared tree comes back as it is (the same object, nothing copied, nothing traced); the
  f32 scales stay f32 in a bf16 model; stacked layers are unstacked; bad weight dtypes fail."""
  cfg = _tiny(param_dtype="bfloat16")
  params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), _params(cfg))
  for wd, fuse in (("", True), (FP8, True), (FP8, False)):
    once = qwen3.decode_params(cfg, params, wd, fuse)
    assert qwen3.decode_params(cfg, once, wd, fuse) is once
    assert not jax.make_jaxpr(lambda p: qwen3.decode_params(cfg, p, wd, fuse))(once).eqns
  q = qwen3.decode_params(cfg, params, FP8)
  assert q["layers_1"]["mlp"]["down_proj"]["kernel_scale"].dtype == jnp.float32
  assert qwen3.decode_params(cfg, q, FP8, fuse=False) is q              # fuse=False never unfuses
  assert qwen3.is_quantized(q) == FP8 and qwen3.is_quantized(params) == ""
  assert qwen3.decode_params(cfg, qwen3.stack_layers(q), FP8).keys() == q.keys()
  assert qwen3.decode_params(cfg, qwen3.decode_params(cfg, params, fuse=False), FP8).keys() == q.keys()
  with pytest.raises(ValueError, match="params hold float8_e4m3fn kernels"):
    qwen3.decode_params(cfg, q)
  with pytest.raises(ValueError, match="weight_dtype must be '' or one of"):
    qwen3.decode_params(cfg, params, "int8")
  f32 = _tiny()   # f32 master weights decoding in bf16: cast once, then left alone
  once = qwen3.decode_params(cfg, _params(f32), FP8)
  assert {str(x.dtype) for x in jax.tree_util.tree_leaves(once)} == {"bfloat16", "float32", FP8}
  assert qwen3.decode_params(cfg, once, FP8) is once


def test_weight_dtype_setting():
  """DecodeConfig.weight_dtype: one clear error naming the field; its values are qwen3's."""
  assert decode_config.WEIGHT_DTYPES == ("",) + tuple(qwen3.QUANTIZED)
  with pytest.raises(ValueError, match=r"^config.decode.weight_dtype: must be one of \['', 'float8_e4m3fn'\]"):
    decode_config.DecodeConfig(weight_dtype="fp8")
  assert decode_config.DecodeConfig(weight_dtype=FP8, mask_token_id=0).weight_dtype == FP8


def test_quantize_error_bound():
  """e4m3 per output channel: each weight within 2^-4 of itself (3 mantissa bits, rounded) or, in
  the subnormal range, within 2^-10 of the channel's scale; the channel's maximum is exact; an
  all-zero channel has scale 1."""
  w = jax.random.normal(jax.random.PRNGKey(0), (64, 5)) * jnp.array([1e-3, 1.0, 30.0, 1.0, 0.0])
  w = w.at[3, 3].set(-50.0)
  q, s = qwen3.quantize(w, 0, FP8)
  assert q.dtype == jnp.float8_e4m3fn and s.shape == (5,) and float(s[4]) == 1.0
  back = q.astype(jnp.float32) * s
  err = jnp.abs(back - w)
  assert bool(jnp.all(err <= jnp.maximum(jnp.abs(w) * 2.0**-4, s * 2.0**-10) * (1 + 1e-6)))
  assert float(back[3, 3]) == pytest.approx(-50.0, rel=1e-6) and not bool(jnp.all(back == w))


def _dequantized(params):
  """A float8 tree's weights as f32 (kernel * scale): what the float8 decoder must compute with."""
  def walk(d):
    if "kernel_scale" in d:
      return {**{k: walk(v) if isinstance(v, dict) else v for k, v in d.items() if k != "kernel_scale"},
              "kernel": d["kernel"].astype(jnp.float32) * d["kernel_scale"]}
    if "embedding_scale" in d:
      return {"embedding": d["embedding"].astype(jnp.float32) * d["embedding_scale"][:, None]}
    return {k: walk(v) if isinstance(v, dict) else v for k, v in d.items()}
  return walk(params)


@pytest.mark.parametrize("tied,bs,budget", [(True, 1, 0), (False, 4, 0), (False, 1, 4 * 20)])
def test_float8_decoder_computes_with_the_dequantized_weights(tied, bs, budget):
  """In f32, the float8 decoder (its matmuls scaling the columns after the dot) decodes the tokens
  the same decoder decodes on kernel * scale as f32 weights: every scale is applied, once, in the
  projections, the LM head (tiled too: `budget`) and a tied embedding's gathered rows."""
  cfg = _tiny(tie_word_embeddings=tied, **({"logits_budget_bytes": budget} if budget else {}))
  q = qwen3.decode_params(cfg, _params(cfg, seed=3), FP8)
  dc = sampler.DecodeConfig(block_size=bs, threshold=0.9, max_new_tokens=8, mask_token_id=63, eos_ids=(5,),
                            weight_dtype=FP8)
  got = _run(cfg, q, dc)
  want = _run(cfg, _dequantized(q), dataclasses.replace(dc, weight_dtype=""))
  np.testing.assert_array_equal(got["tokens"], want["tokens"])
  np.testing.assert_array_equal(got["commit_step"], want["commit_step"])
  np.testing.assert_allclose(got["logprob"], want["logprob"], atol=1e-4)


def test_float8_logits_near_bf16(tiny_lm):
  """bf16 model, float8 weights: e4m3 rounds each weight by up to 2^-4 of itself, so the logits
  move by a few percent of their spread. Stated tolerance: mean |d logit| <= 0.12 x their standard
  deviation, max <= 0.25 x the largest |logit|, mean KL(bf16 || float8) <= 0.01 nats (measured here:
  0.07, 0.13, 0.003). The float8 diffusion decoder runs and commits every slot."""
  cfg, params = tiny_lm
  cfg = cfg.replace(param_dtype="bfloat16")
  params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
  toks = jnp.asarray(np.random.RandomState(0).randint(6, 60, (4, 16)))
  pos, mask = jnp.broadcast_to(jnp.arange(16), (4, 16)), masks.sequence_mask(16, 16, 1, jnp.ones((4, 16), bool))
  lb = forward(cfg, params, toks, pos, mask)[0]
  lf = forward(cfg, qwen3.decode_params(cfg, params, FP8), toks, pos, mask)[0]
  d = jnp.abs(lf - lb)
  assert float(d.mean()) <= 0.12 * float(lb.std()) and float(d.max()) <= 0.25 * float(jnp.abs(lb).max())
  assert float(d.max()) > 0                                            # it did quantize
  pb, pf = jax.nn.log_softmax(lb), jax.nn.log_softmax(lf)
  assert float((jnp.exp(pb) * (pb - pf)).sum(-1).mean()) <= 0.01
  dc = sampler.DecodeConfig(block_size=4, threshold=0.9, max_new_tokens=8, mask_token_id=63, eos_ids=(),
                            weight_dtype=FP8)
  out = _run(cfg, params, dc)
  assert (out["commit_step"] >= 0).all() and (out["tokens"] != 63).all()


def test_speculative_float8_computes_with_the_dequantized_weights():
  """The speculative decoder prepares both models with DecodeConfig.weight_dtype (f32 compute): its
  float8 decode gives the tokens of the same decoder on the dequantized weights."""
  cfg = _tiny()
  q = qwen3.decode_params(cfg, _params(cfg, seed=3), FP8)
  dc = sampler.DecodeConfig(block_size=4, threshold=0.9, max_new_tokens=8, mask_token_id=63, eos_ids=(5,))
  outs = []
  for p, wd in ((q, FP8), (_dequantized(q), "")):
    fn = speculative.decoder_for(cfg, cfg, dataclasses.replace(dc, weight_dtype=wd))
    outs.append(speculative.generate_with(fn, (p, p), PROMPTS, dc))
  np.testing.assert_array_equal(outs[0]["tokens"], outs[1]["tokens"])
  np.testing.assert_allclose(outs[0]["logprob"], outs[1]["logprob"], atol=1e-4)


def _qwen_vocab_config(**kw):
  return Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, param_dtype="bfloat16",
                     mask_token_id=151935, eos_token_id=0, pad_token_id=0, **kw)


@pytest.mark.parametrize("program,batch,tied", [("ar", 1, True), ("diffusion", 8, False), ("speculative", 2, False)])
def test_lowered_decoders_at_qwen3_vocab(program, batch, tied):
  """Qwen3's vocabulary at a tiny width, params prepared as serving does: 4 projection matmuls per
  layer and step (7 unfused); with float8 weights every kernel (and the head) read once, in float8
  bytes, and nothing converted to f32; at most 0.55x the weight bytes bf16's reads (the f32 scales
  add 4 bytes per output channel: 4 / 64 of a float8 row at this width, 0.4% at Qwen3-0.6B's)."""
  cfg = _qwen_vocab_config(tie_word_embeddings=tied)
  rows = {}
  for wd in ("", FP8):
    fn, args, leaves = programs.decoder_program(program, cfg, batch, 40, 64, 32, wd)
    res = weight_reads.analyse(weight_reads.lowered_text(fn, args), leaves)
    assert set(res["matmuls_per_layer"].values()) == {4}, res["matmuls_per_layer"]
    for path, r in res["reads"].items():
      assert r == pytest.approx(0.0 if path.endswith("embed_tokens/embedding") and not tied else 1.0, abs=1e-9), path
    assert res["converts"] == []
    rows[wd] = res["weight_bytes_read"]
  assert rows[FP8] <= 0.55 * rows[""]
  raw = qwen3.param_shapes(cfg)   # unfused: q, k, v, o, gate, up, down
  dc = sampler.DecodeConfig(block_size=1, max_new_tokens=8, eos_ids=(0,), mask_token_id=151935)
  fn = sampler.decoder_for(cfg, dc, fuse_projections=False)[1]
  args = (raw, sd((1, 40), jnp.int32), sd((1,), jnp.int32), sd((), jnp.float32), sd((), jnp.float32),
          sd((), jnp.int32), sd((), jnp.float32), sd((2,), jnp.uint32), sd((), jnp.int32))
  res = weight_reads.analyse(weight_reads.lowered_text(fn, args), weight_reads.leaves_of(raw))
  assert set(res["matmuls_per_layer"].values()) == {7}


def test_float8_convert_stays_in_the_loop():
  """Compiled for this backend (XLA's CPU hoists every loop-invariant weight convert it can): no
  float8 weight enters the AR decode loop as a wider copy; without `qwen3.in_step` they do."""
  cfg = _qwen_vocab_config(tie_word_embeddings=True)
  fn, args, leaves = programs.decoder_program("ar", cfg, 1, 40, 64, 32, FP8)
  narrow = {p for p, x in leaves if x.dtype == jnp.float8_e4m3fn}

  def hoisted():
    sampler.compiled_decoder.cache_clear()
    fn, args, _ = programs.decoder_program("ar", cfg, 1, 40, 64, 32, FP8)
    res = weight_reads.analyse(weight_reads.compiled_text(fn, args), leaves, lowered=False)
    return {p for p, w in res["converts"] if "before the loop" in w} & narrow
  assert len(narrow) == 9 and not hoisted()
  try:
    qwen3.PIN_DEQUANT = False
    assert hoisted() == narrow or jax.default_backend() != "cpu"
  finally:
    qwen3.PIN_DEQUANT = True
    sampler.compiled_decoder.cache_clear()


def test_counter_folds_a_float8_convert_into_its_matmul():
  """The lowered count: a float8 weight converted inside the loop and multiplied reads its float8
  bytes once (one matmul); converted before the loop, every step reads the wide copy (flagged)."""
  def inside(w, x):
    return jax.lax.while_loop(lambda c: c[0] < c[1].sum(), lambda c: (c[0] + 1, c[1] @ w.astype(jnp.bfloat16)),
                              (0, x))

  def before(w, x):
    wb = w.astype(jnp.bfloat16)
    return jax.lax.while_loop(lambda c: c[0] < c[1].sum(), lambda c: (c[0] + 1, c[1] @ wb), (0, x))
  args = (sd((16, 16), jnp.float8_e4m3fn), sd((2, 16), jnp.bfloat16))
  leaves = [("layers_0/w", args[0])]
  res = weight_reads.analyse(weight_reads.lowered_text(jax.jit(inside), args), leaves)
  assert res["reads"]["layers_0/w"] == 1.0 and res["matmuls_per_layer"] == {"layers_0": 1} and not res["converts"]
  res = weight_reads.analyse(weight_reads.lowered_text(jax.jit(before), args), leaves)
  assert res["reads"]["layers_0/w"] == 2.0 and "made before the loop" in res["converts"][0][1]
  # the compiled count keeps an in-loop convert as XLA left it (no folding)
  assert weight_reads.analyse(weight_reads.lowered_text(jax.jit(inside), args), leaves, lowered=False)[
      "reads"]["layers_0/w"] == 3.0


def test_8b_shapes():
  """Qwen3-8B's prepared tree, from shapes only: fused and float8 kernels of the documented shapes."""
  cfg = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, param_dtype="bfloat16")
  p = jax.eval_shape(lambda x: qwen3.decode_params(cfg, x, FP8), qwen3.param_shapes(cfg))
  a, m = p["layers_35"]["self_attn"], p["layers_35"]["mlp"]
  assert a["qkv_proj"]["kernel"].shape == (4096, 6144) and a["qkv_proj"]["kernel_scale"].shape == (6144,)
  assert m["gate_up_proj"]["kernel"].shape == (4096, 24576) and m["gate_up_proj"]["kernel"].dtype == jnp.float8_e4m3fn
  assert p["lm_head"]["kernel"].dtype == jnp.float8_e4m3fn and p["embed_tokens"]["embedding"].dtype == jnp.bfloat16
  axes = qwen3.param_logical_axes(p)
  assert axes["layers_0"]["self_attn"]["qkv_proj"]["kernel_scale"] == ("heads",)
  assert axes["lm_head"]["kernel_scale"] == ("vocab",)


def test_eval_decodes_in_float8_rollouts_never():
  """decode.weight_dtype reaches every DecodeConfig built from the config (eval, bench, generate,
  serving), but on-policy rollouts decode with the weights being trained."""
  import types

  import ml_collections

  from dgr2_jax.decode import runtime
  from dgr2_jax.stages import on_policy
  config = ml_collections.ConfigDict({"decode": {**decode_config.decode_config().to_dict(), "weight_dtype": FP8},
                                      "task": {"response_len": 32}})
  tids = types.SimpleNamespace(eos_id=5, mask_id=63, pad_id=0)
  assert runtime.decode_config(config, tids, _tiny()).weight_dtype == FP8
  dc = on_policy.rollout_decode_config(config, tids, _tiny(), 0.7)
  assert dc.weight_dtype == "" and dc.temperature == 0.7


@pytest.mark.parametrize("weight_dtype", ["", FP8])
def test_load_on_device_prepares_on_the_host(monkeypatch, weight_dtype):
  """A model directory reaches the device as the decoders read it: per layer, fused, in the run's
  compute dtype (an f32 checkpoint decoding in bf16 puts half its bytes there), kernels in the
  weight dtype, so the decoder's own preparation returns it as it is; it decodes exactly what the
  checkpoint's own tree decodes (prepared inside the decode call); each (directory, weight dtype)
  is read once."""
  from dgr2_jax.decode import runtime
  from dgr2_jax.model import checkpoint
  cfg = _tiny()
  raw = jax.device_get(_params(cfg))                     # host f32 arrays, as load_model_dir gives ours
  loads = []

  def load(path, dtype=None):   # load_model_dir: each tensor cast as it is read
    loads.append((path, dtype))
    return cfg, jax.tree_util.tree_map(lambda x: x if dtype is None else x.astype(dtype), raw)
  monkeypatch.setattr(checkpoint, "load_model_dir", load)
  models = {}
  mc, p = runtime.load_on_device("m", {"dtype": "bfloat16"}, models, None, weight_dtype)
  assert mc.jnp_dtype == jnp.bfloat16
  a = p["layers_1"]["self_attn"]
  assert "qkv_proj" in a and "q_proj" not in a and "gate_up_proj" in p["layers_1"]["mlp"]
  assert a["qkv_proj"]["kernel"].dtype == (jnp.float8_e4m3fn if weight_dtype else jnp.bfloat16)
  assert p["norm"]["scale"].dtype == jnp.bfloat16 and isinstance(a["o_proj"]["kernel"], jax.Array)
  bytes_ = lambda t: sum(x.nbytes for x in jax.tree_util.tree_leaves(t))
  assert bytes_(p) <= bytes_(raw) / 2 + 1024
  assert qwen3.decode_params(mc, p, weight_dtype) is p      # nothing left for a decode call to prepare
  dc = sampler.decode_config_for(mc, block_size=4, threshold=0.7, max_new_tokens=8, eos_ids=(5,),
                                 weight_dtype=weight_dtype)
  want, got = sampler.generate(mc, raw, PROMPTS, dc), sampler.generate(mc, p, PROMPTS, dc)
  for k in ("tokens", "commit_step", "nfe"):
    np.testing.assert_array_equal(got[k], want[k])
  np.testing.assert_array_equal(got["logprob"], want["logprob"])
  assert runtime.load_on_device("m", {"dtype": "bfloat16"}, models, None, weight_dtype)[1] is p
  runtime.load_on_device("m", {"dtype": "bfloat16"}, models, None, "" if weight_dtype else FP8)
  assert loads == [("m", "bfloat16"), ("m", "bfloat16")]   # read in the compute dtype, never the f32 tree
  runtime.load_on_device("m", None, models, None, weight_dtype)
  assert loads[-1] == ("m", None)                            # the checkpoint's own dtype ('auto')


def test_prepare_on_host_without_a_cpu_backend(monkeypatch):
  """With JAX_PLATFORMS naming no cpu, the tree is prepared on the default device and fetched: the
  same host arrays."""
  from dgr2_jax.decode import runtime
  cfg = _tiny()
  raw = jax.device_get(_params(cfg))
  want = runtime.prepare_on_host(cfg, raw, FP8)

  def no_cpu(*a, backend=None, **k):
    raise RuntimeError(f"Unknown backend: {backend!r} requested")
  monkeypatch.setattr(jax, "local_devices", no_cpu)
  got = runtime.prepare_on_host(cfg, raw, FP8)
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert isinstance(a, np.ndarray) and a.dtype == b.dtype
    np.testing.assert_array_equal(a.astype(np.float32), b.astype(np.float32))


def test_load_on_device_reads_a_checkpoint_in_the_compute_dtype(tmp_path):
  """A saved f32 model directory read in bf16 and prepared gives the tree that preparing its f32
  params gives: the cast on read rounds as decode_params' cast does."""
  from dgr2_jax.decode import runtime
  from dgr2_jax.model import checkpoint
  cfg = _tiny()
  raw = jax.device_get(_params(cfg))
  checkpoint.save_model_dir(str(tmp_path / "m"), cfg, raw)
  mc, p = runtime.load_on_device(str(tmp_path / "m"), {"dtype": "bfloat16"}, None, None, FP8)
  want = runtime.prepare_on_host(cfg.replace(dtype="bfloat16"), raw, FP8)
  assert jax.tree_util.tree_structure(p) == jax.tree_util.tree_structure(want)
  for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(want)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a).astype(np.float32), b.astype(np.float32))
