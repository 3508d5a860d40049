"""On-policy distillation (OPD): forward KL(teacher || student) on the student's own rollouts
(with `opd.divergence='reverse'`: KL(student || teacher) between the same distributions).

Both sides are next-token distributions at the same response index r (AR token shift):
  * teacher 'ar' (default): the frozen AR teacher scores prompt + rollout once, causally
    (`ar_teacher_hidden`, block size 1) -> its distribution for token r given P, o_<r;
  * student: `replay.replay_hidden` on the rollout's replayed canvases (block-causal + token
    shift) -> exactly the distribution the decoder drew token r from (before temperature).
Distributions are softmax(logits) with the mask token removed (it is never a valid output), at
temperature 1. Every vocabulary-sized term is computed in chunks of positions (model/logits.py),
so the step holds O(chunk x V) logits, never O(rollouts x R x V). The teacher side
(`opd.teacher_cache`):
  * 'full': the teacher's full-vocabulary log-probs, computed once per trajectory before the
    update and cached in the batch, `teacher_logp [b,R,V]` (4V bytes per token: 0.6 MB at Qwen3's
    vocabulary, so only for small vocabularies);
  * 'topk' (k = `opd.teacher_top_k`): `teacher_topk_logp [b,R,k]`, `teacher_topk_idx [b,R,k]` and
    the log of the remaining mass `teacher_rest_logp [b,R]` (8k + 4 bytes per token). The KL is
    then taken over k + 1 outcomes: the teacher's top-k tokens plus one "rest" bucket,
      sum_{i in topk} p_t(i) (log p_t(i) - log p_s(i)) + p_t(rest) (log p_t(rest) - log p_s(rest)),
    with p_s(rest) = 1 - sum_{i in topk} p_s(i) (computed as a logsumexp over the other tokens).
    This is the KL between the two distributions coarsened to those k + 1 outcomes, so it is
    <= the full KL (data processing) and equals it when k = V;
  * 'none': no cache; the AR teacher (frozen params passed to the train step) scores each
    micro-batch inside the loss, exactly, with the same chunking as the student. One update per
    batch of rollouts means the teacher runs once per trajectory either way, so this costs the
    same teacher compute as building a cache and no cache memory (docs/memory.md: the measured table).
Loss = sum over committed positions at or before the first EOS (`loss_mask`) of the KL, divided
by their count in the batch (token-level mean; the count is metrics["denominator"], so gradient
accumulation equals the big batch).

Student context (`opd.student_context`): the canvas the student's distribution at r is read from.
  * 'replay' (default; the contract of docs/design.md, "Replay"): the canvas of the denoising
    step that committed r, rebuilt from the rollout (`rollouts.replay_inputs`). This is the
    distribution the decoder actually drew token r from.
  * 'prefix': the canvas with exactly the tokens left of r in its block visible and the rest
    masked (`rollouts.left_to_right_commit_steps`), the block-diffusion model's pi(. | P, o_<r):
    the conditioning the paper's formula writes for both sides.
  They differ where the rollout committed out of order. Under 'replay' a token committed before
  its left neighbours is scored without them, while the teacher sees them, and those neighbours
  were often chosen afterwards to agree with it (e.g. the item SID after '#k' committed before
  the number k). The teacher's target then echoes the student's own sample, and the teacher's
  doubt lands on the neighbour, which the student scores with the answer in view. 'prefix'
  gives both sides the same conditioning but trains a canvas the parallel decoder does not
  visit. In the demo neither setting lowers the held-out KL reliably (docs/results.md: the recipe
  figures). Cost: 'prefix' needs one canvas per token (`replay_max_segments` 0 or >= block size
  to be exact; fewer merges neighbouring tokens, see train/replay.py); benchmarks/replay_cost.py
  times canvases per block.

Variant teacher 'self_tau1' (more decode compute as the teacher, a latency lever): the teacher is
a frozen copy of the student's starting diffusion model. For each student rollout we build the
tau = 1.0 trajectory that commits the SAME tokens in the SAME order, one token per step (tokens the
student committed together in one step are serialised left to right,
`rollouts.serialize_commit_steps`), and the teacher distribution at r is that model's replayed
distribution on its canvas there (every token committed before r in that order is visible).
Teacher-forcing the student's tokens keeps per-position targets; an independent tau = 1 rollout
would produce other tokens and give no target at the student's positions.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections

from dgr2_jax.model import logits as logits_lib
from dgr2_jax.model import qwen3
from dgr2_jax.train import losses
from dgr2_jax.train import replay

_NEG = -1e30
TEACHERS = ("ar", "self_tau1")
STUDENT_CONTEXTS = ("prefix", "replay")
TEACHER_CACHES = ("full", "none", "topk")
DIVERGENCES = ("forward", "reverse")
CACHE_KEYS = {"full": ("teacher_logp",), "topk": ("teacher_topk_logp", "teacher_topk_idx", "teacher_rest_logp"),
              "none": ()}


def opd_config() -> ml_collections.ConfigDict:
  """On-policy distillation from the AR teacher on the student's own rollouts (defaults: the paper's
  Appendix A/C)."""
  c = ml_collections.ConfigDict()
  c.init_from = ""             # '' => the previous model stage's dir (workdir/cft/model normally)
  c.teacher_dir = ""           # '' => the AR teacher (teacher_rl or sft model); unused for 'self_tau1'
  c.teacher = "ar"             # 'ar' | 'self_tau1' (see dgr2_jax/train/opd.py)
  c.student_context = "replay"  # 'replay' (decode-time canvases) | 'prefix' (P, o_<t; see train/opd.py)
  c.rollouts_per_prompt = 4    # G'
  c.lr = 1e-6                  # constant
  c.prompts_per_step = 128  # prompts per optimiser step (rows = prompts_per_step x rollouts_per_prompt)
  c.epochs = 1  # passes over the training prompts
  c.steps = 0                  # 0 => epochs * train prompts // prompts_per_step
  # Teacher side (module docstring): 'full' cache, 'topk' cache of teacher_top_k + rest mass, or
  # 'none' (scored exactly inside the step: no cache, and at Qwen3's vocabulary less time per step
  # than building a cache first; docs/memory.md, benchmarks/teacher_cache.py).
  c.teacher_cache = "none"
  c.teacher_top_k = 64  # teacher_cache='topk': teacher log-probs kept per position
  # Rows decoded per call of the decoder (0 = all prompts_per_step x rollouts_per_prompt at once):
  # the global batch of rollouts never has to fit in one decode; grad_accum_steps does the same
  # for the update.
  c.rollout_batch_size = 0
  c.temperature = 1.0          # rollout sampling temperature
  c.grad_accum_steps = 1  # micro-batches per optimiser step
  # Replay canvases per block (see train/replay.py): the scorer's cost grows with the canvases
  # (benchmarks/replay_cost.py), so the default bounds it; blocks that used more steps are merged
  # (inexact, reported as replay_exact). 0 or block_size = always exact. 8 is exact under the
  # default decode.steps_per_block = 8.
  c.replay_max_segments = 8
  # Validation curve: greedy Recall@1 on the first `valid_prompts` validation users before the
  # first step (the student before distillation) and every `valid_every` steps (0 = none), in
  # workdir/opd/valid_curve.json.
  c.valid_every = 0
  c.valid_prompts = 512        # validation users decoded per point of the curve
  # Validation users decoded per call, over all processes (0 = all at once). A call's users are
  # split over the data x fsdp devices, so a value > 0 must be a multiple of their count, as
  # valid_prompts is at 0. On 2 CPU cores calls of 64 decoded 1,536 users 2.5x (AR) and 1.3x
  # (block diffusion) as fast as one call of all (configs/demo.py sets 64).
  c.valid_batch_size = 0
  c.keep_best = False          # the best point beating the start by >= 2 paired SEs (loop.keep_bar), else the start
  # Weight of the KL at the candidate numbers the reasoning names (the token after ' #': the first
  # pick is decided there), against 1 for every other token (`train.opd.opd_loss`). A rollout is
  # ~60 tokens of which two decide the ranking; at 1 the few positions where the student's pick
  # differs from the teacher's are a sliver of the token mean.
  c.choice_weight = 1.0
  # The per-token divergence the loss averages (`opd_loss`): 'forward' KL(teacher || student), the
  # mass-covering one, or 'reverse' KL(student || teacher), the mode-seeking one that on-policy
  # distillation usually minimises (GKD, Agarwal et al. 2024; Thinking Machines' on-policy
  # distillation): exact over the vocabulary (or the teacher's top-k + rest), not a sampled estimate.
  c.divergence = "forward"
  # Held-out KL each step: the first `heldout_prompts` validation users (0 = none), one rollout
  # each at `temperature` with a fixed key, scored by the teacher: the forward and reverse KL in
  # the step's metrics (`heldout_kl`, `heldout_reverse_kl`).
  c.heldout_prompts = 0
  return c


def log_dist(logits, mask_id=None):
  """log softmax with the mask token removed (f32)."""
  x = logits.astype(jnp.float32)
  if mask_id is not None:
    x = x.at[..., mask_id].set(_NEG)
  return jax.nn.log_softmax(x, axis=-1)


def cache_from_logprobs(logp, top_k: int = 0) -> dict:
  """Teacher cache from its log-probs [b,R,V] (see the module docstring)."""
  if top_k <= 0:
    return {"teacher_logp": logp}
  vals, idx = jax.lax.top_k(logp, int(top_k))
  rest = _rest_logp(logp, idx)
  return {"teacher_topk_logp": vals, "teacher_topk_idx": idx.astype(jnp.int32), "teacher_rest_logp": rest}


def _rest_logp(logp, idx):
  """log of the mass outside the indices `idx` [...,k] (>= _NEG, so 0 * it stays finite)."""
  in_k = jnp.zeros(logp.shape, bool)
  in_k = jnp.put_along_axis(in_k, idx, True, axis=-1, inplace=False)
  return jnp.maximum(jax.nn.logsumexp(jnp.where(in_k, _NEG, logp), axis=-1), _NEG)


def _cache_per_position(config, params, hidden, top_k: int, mask_id):
  return logits_lib.per_position(config, params, lambda lg: cache_from_logprobs(log_dist(lg, mask_id), top_k),
                                 hidden)


def ar_teacher_hidden(teacher_config, teacher_params, prompt, prompt_len, clean):
  """The AR teacher's final hidden states [b,R,E] on prompt + rollout (row r predicts token r)."""
  return losses.response_hidden(teacher_config, teacher_params,
                                {"prompt_ids": prompt, "prompt_len": prompt_len, "response_ids": clean})


def frozen_teacher(teacher_config, teacher_params):
  """The AR teacher's params as an OPD step holds them (teacher_cache 'none'): every floating leaf
  in the compute dtype. Exact: the model casts each weight to the compute dtype before using it
  (dense kernels, the embedding, the norms' scales, the LM head), so a bf16 teacher scores
  exactly as its f32 master weights do, in half the bytes (tests/test_train_step_memory.py)."""
  dt = teacher_config.jnp_dtype
  cast = lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dt else x
  return jax.jit(lambda t: jax.tree_util.tree_map(cast, t))(teacher_params)


def ar_teacher_cache(teacher_config, teacher_params, prompt, prompt_len, clean, *, top_k: int = 0,
                     mask_id=None) -> dict:
  """The AR teacher's causal next-token distributions on prompt + rollout, as a cache (projected to
  the vocabulary in chunks of positions, model/logits.py)."""
  hidden = ar_teacher_hidden(teacher_config, teacher_params, prompt, prompt_len, clean)
  return _cache_per_position(teacher_config, teacher_params, hidden, top_k, mask_id)


def replay_teacher_cache(model_config, teacher_params, prompt, prompt_len, segments, block_size: int, *,
                         top_k: int = 0, mask_id=None) -> dict:
  """A diffusion teacher's replayed distributions on `segments` (the 'self_tau1' variant)."""
  hidden = replay.replay_hidden(model_config, teacher_params, prompt, prompt_len, segments, block_size)
  return _cache_per_position(model_config, teacher_params, hidden, top_k, mask_id)


def kl_from_cache(cache: dict, student_logp) -> jax.Array:
  """KL(teacher || student) [b,R] per position; full or top-k + rest (module docstring)."""
  if "teacher_logp" in cache:
    lt = cache["teacher_logp"]
    pt = jnp.exp(lt)
    return jnp.sum(jnp.where(pt > 0, pt * (lt - student_logp), 0.0), axis=-1)
  lt, idx = cache["teacher_topk_logp"], cache["teacher_topk_idx"]
  ls = jnp.take_along_axis(student_logp, idx, axis=-1)
  pt = jnp.exp(lt)
  kl = jnp.sum(jnp.where(pt > 0, pt * (lt - ls), 0.0), axis=-1)
  lt_rest = cache["teacher_rest_logp"]
  ls_rest = _rest_logp(student_logp, idx)
  pt_rest = jnp.exp(lt_rest)
  return kl + jnp.where(pt_rest > 0, pt_rest * (lt_rest - ls_rest), 0.0)


def reverse_kl_from_cache(cache: dict, student_logp) -> jax.Array:
  """KL(student || teacher) [b,R] per position, over the same outcomes as `kl_from_cache` (the
  whole vocabulary, or the teacher's top-k plus the rest): the divergence the student's own
  samples estimate, logged beside the loss."""
  if "teacher_logp" in cache:
    lt = cache["teacher_logp"]
    ps = jnp.exp(student_logp)
    return jnp.sum(jnp.where(ps > 0, ps * (student_logp - jnp.maximum(lt, _NEG)), 0.0), axis=-1)
  lt, idx = cache["teacher_topk_logp"], cache["teacher_topk_idx"]
  ls = jnp.take_along_axis(student_logp, idx, axis=-1)
  ps = jnp.exp(ls)
  rkl = jnp.sum(jnp.where(ps > 0, ps * (ls - lt), 0.0), axis=-1)
  ls_rest = _rest_logp(student_logp, idx)
  ps_rest = jnp.exp(ls_rest)
  return rkl + jnp.where(ps_rest > 0, ps_rest * (ls_rest - cache["teacher_rest_logp"]), 0.0)


def token_kl(student_config, params, batch: dict, *, block_size: int, teacher_cache: str = "full",
             mask_id=None, teacher=None):
  """(KL(teacher || student) [b,R], student argmax == teacher argmax [b,R], KL(student || teacher)
  [b,R]) at every response index, in vocabulary chunks; the batch as in `opd_loss`. Positions
  outside `loss_mask` hold garbage.

  `teacher_cache` 'full' / 'topk' read the teacher from the batch's cache; 'none' scores the AR
  teacher here, `teacher = (teacher_config, teacher_params)`, exactly and without a cache."""
  if teacher_cache not in TEACHER_CACHES:
    raise ValueError(f"opd.teacher_cache must be one of {TEACHER_CACHES}, got {teacher_cache!r}")
  need = CACHE_KEYS[teacher_cache]
  missing = [k for k in need if k not in batch]
  if missing:
    raise ValueError(f"OPD batch lacks teacher cache fields {missing} for teacher_cache={teacher_cache!r}")
  if teacher_cache == "none" and teacher is None:
    raise ValueError("opd teacher_cache='none' scores the teacher in the loss: pass teacher=(config, params)")
  mask_id = student_config.mask_token_id if mask_id is None else mask_id
  hidden = replay.replay_hidden(student_config, params, batch["prompt"], batch["prompt_len"],
                                {k: batch[k] for k in ("clean", "seg_tokens", "pred_seg")}, block_size)
  if teacher_cache == "none":
    tcfg, tparams = teacher
    tparams = jax.lax.stop_gradient(tparams)  # frozen: no gradient, whatever the caller passes
    th = ar_teacher_hidden(tcfg, tparams, batch["prompt"], batch["prompt_len"], batch["clean"])

    def one(xs):
      hs, ht = xs
      ls = log_dist(qwen3.lm_head(student_config, params, hs), mask_id)
      lt = log_dist(qwen3.lm_head(tcfg, tparams, ht), mask_id)
      cache = {"teacher_logp": lt}
      return (kl_from_cache(cache, ls), jnp.argmax(ls, -1) == jnp.argmax(lt, -1),
              reverse_kl_from_cache(cache, ls))
    lead = hidden.shape[:-1]
    flat = (hidden.reshape(-1, hidden.shape[-1]), th.reshape(-1, th.shape[-1]))
    chunk = logits_lib.positions_per_chunk(student_config.vocab_size, flat[0].shape[0],
                                           student_config.logits_chunk)
    kl, agree, rkl = logits_lib.map_positions(one, flat, chunk)
    return kl.reshape(lead), agree.reshape(lead), rkl.reshape(lead)

  def one(lg, *fields):
    ls = log_dist(lg, mask_id)
    cache = dict(zip(need, fields))
    t_top = cache["teacher_topk_idx"][..., 0] if teacher_cache == "topk" else jnp.argmax(cache["teacher_logp"], -1)
    return kl_from_cache(cache, ls), jnp.argmax(ls, -1) == t_top, reverse_kl_from_cache(cache, ls)
  return logits_lib.per_position(student_config, params, one, hidden, *[batch[k] for k in need])


class Choice(NamedTuple):
  """The candidate numbers' weight in `opd_loss`: `after_id` the token before each (' #'; -1 = no
  choice positions), `weight` their KL's weight against 1 for every other token."""
  after_id: int = -1
  weight: float = 1.0


class Objective(NamedTuple):
  """What `opd_loss` averages: the per-token `divergence` ('forward' KL(teacher || student) or
  'reverse' KL(student || teacher)) with the `choice` positions' weight."""
  divergence: str = "forward"
  choice: Choice = Choice()


def opd_loss(student_config, params, batch: dict, rng=None, teacher_params=None, *, block_size: int,
             teacher_cache: str = "full", mask_id=None, teacher_config=None,
             objective: Objective = Objective()) -> tuple[jax.Array, dict]:
  """-> (loss, metrics). batch: prompt [b,P], prompt_len [b], clean [b,R], seg_tokens, pred_seg,
  loss_mask [b,R] and the teacher cache (`CACHE_KEYS[teacher_cache]`; none for 'none', which
  takes the AR teacher's params as `teacher_params`, the training loop's frozen argument).

  The loss is the weighted mean over `loss_mask` of the per-token KL(teacher || student)
  (`objective.divergence` 'forward') or KL(student || teacher) ('reverse'), each token weighing 1,
  or `choice.weight` at the candidate numbers (`objective.choice`: `losses.choice_positions`, with
  `choice.after_id` >= 0).
  Metrics: the unweighted token means of the KL (`kl_to_teacher`), of the
  reverse KL(student || teacher) on the student's own rollouts (`reverse_kl`) and of the argmax
  agreement; and, with `choice.after_id` >= 0, the KL and the agreement at the choice positions."""
  del rng
  divergence, choice = objective
  if divergence not in DIVERGENCES:
    raise ValueError(f"opd.divergence must be one of {DIVERGENCES}, got {divergence!r}")
  teacher = (teacher_config, teacher_params) if teacher_cache == "none" else None
  kl, agree, rkl = token_kl(student_config, params, batch, block_size=block_size, teacher_cache=teacher_cache,
                            mask_id=mask_id, teacher=teacher)
  m = batch["loss_mask"].astype(jnp.float32)
  tokens = jnp.sum(m)
  mean = lambda x, w: jnp.sum(w * x) / jnp.maximum(jnp.sum(w), 1.0)
  w = m
  metrics = {}
  if choice.after_id >= 0:
    at = losses.choice_positions(batch["clean"], choice.after_id).astype(jnp.float32) * m
    w = m + (float(choice.weight) - 1.0) * at
    metrics.update(choice_kl=mean(kl, at), choice_agreement=mean(agree, at), choice_tokens=jnp.sum(at))
  denom = jnp.sum(w)
  loss = jnp.sum(w * (kl if divergence == "forward" else rkl)) / jnp.maximum(denom, 1e-8)
  # Agreement of the argmaxes: a cheap readable progress signal next to the KL.
  metrics.update(kl_to_teacher=mean(kl, m), reverse_kl=mean(rkl, m), top1_agreement=mean(agree, m), tokens=tokens,
                 denominator=denom)
  return loss, metrics


def validate(config, runs: set) -> None:
  """Checks the `opd` config section."""
  from dgr2_jax import checks
  from dgr2_jax.train import cft
  c = config
  if "opd" not in c:
    return
  cft._model_dirs(c, runs, "opd")  # pylint: disable=protected-access
  checks.positive_int(c, "opd", "rollouts_per_prompt")
  checks.positive_int(c, "opd", "prompts_per_step")
  checks.one_of(c, "opd", "teacher", TEACHERS)
  if "student_context" in c.opd:
    checks.one_of(c, "opd", "student_context", STUDENT_CONTEXTS)
    if c.opd.teacher == "self_tau1" and c.opd.student_context != "replay":
      checks.fail("opd.student_context", "must be 'replay' with opd.teacher='self_tau1'")
  if float(c.opd.lr) <= 0:
    checks.fail("opd.lr", f"must be > 0, got {c.opd.lr}")
  if float(c.opd.get("choice_weight", 1.0)) < 0:
    checks.fail("opd.choice_weight", f"must be >= 0, got {c.opd.choice_weight}")
  if "divergence" in c.opd:
    checks.one_of(c, "opd", "divergence", DIVERGENCES)
  if not checks.is_int(c.opd.get("heldout_prompts", 0), 0):
    checks.fail("opd.heldout_prompts", f"must be an int >= 0, got {c.opd.heldout_prompts!r}")
  if c.opd.get("teacher_cache", "full") not in TEACHER_CACHES:
    checks.fail("opd.teacher_cache", f"must be one of {list(TEACHER_CACHES)}, got {c.opd.teacher_cache!r}")
  if c.opd.get("teacher_cache", "full") == "none" and c.opd.teacher != "ar":
    checks.fail("opd.teacher_cache", f"'none' scores the AR teacher in the step; teacher {c.opd.teacher!r} "
                "needs 'full' or 'topk'")
  if not checks.is_int(c.opd.get("rollout_batch_size", 0), 0):
    checks.fail("opd.rollout_batch_size", f"must be an int >= 0 (0 = all rollouts at once), got "
                f"{c.opd.rollout_batch_size!r}")
  if not checks.is_int(c.opd.get("valid_batch_size", 0), 0):
    checks.fail("opd.valid_batch_size", f"must be an int >= 0 (0 = all at once), got {c.opd.valid_batch_size!r}")
