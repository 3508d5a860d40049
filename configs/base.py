"""The full config tree every stage reads, assembled from each package's section defaults.

Sections: `data`, `sids`, `retriever` (dgr2_jax.data.config), `task`, `eval` (dgr2_jax.task.config),
`train` (dgr2_jax.train.config), and the ones defined here: `model`, `decode`, `teacher_rl`, `cft`,
`opd`, `rl`, `bench`, `pipeline`, `hardware`. Presets (`demo.py`, `beauty_*.py`) start from `get_config()` and
override fields; `apply_variants(config, arg)` implements the ablation presets selected with the
`file.py:arg` convention of `ml_collections.config_flags` (e.g. `configs/demo.py:no_cft,block8`).

Config files are loaded by path, not imported as a package, so each preset puts the repository
root on sys.path before `from configs import base` (works from any working directory).
"""

import ml_collections

from dgr2_jax.data import config as data_config
from dgr2_jax.task import config as task_config
from dgr2_jax.train import config as train_config
# Stage order of `--config.stage=pipeline` (generate is a standalone tool, not a pipeline step).
from dgr2_jax.stages.pipeline import ORDER as PIPELINE_STAGES


def model_config() -> ml_collections.ConfigDict:
  """The AR re-ranker the SFT stage starts from.

  `init_from` '' => random init of the architecture below with the tokenizer's vocabulary
  (`vocab_size` 0 = len(tokenizer)); a model directory (HF or ours) => its config.json and weights
  (the architecture fields below are then ignored).
  """
  c = ml_collections.ConfigDict()
  c.init_from = ""  # '' = random init of the fields below; a model directory = its config and weights
  c.vocab_size = 0  # 0 = len(tokenizer)
  c.hidden_size = 64  # model width (the architecture fields are ignored with init_from)
  c.intermediate_size = 128  # MLP width
  c.num_hidden_layers = 2  # transformer layers
  c.num_attention_heads = 4  # query heads
  c.num_key_value_heads = 2  # K/V heads (grouped-query attention); divides num_attention_heads
  c.head_dim = 16  # per-head width (even: rotary embeddings)
  c.rms_norm_eps = 1e-6  # RMSNorm epsilon
  c.rope_theta = 1_000_000.0  # rotary embedding base (Qwen3's)
  c.tie_word_embeddings = True  # the LM head is the embedding matrix
  c.max_position_embeddings = 4096  # longest position the model is configured for
  # Activations / matmuls / KV cache; 'auto' = param_dtype (a loaded checkpoint's own dtype: bf16
  # checkpoints decode in bf16). Logits, softmax statistics and log-probs are f32 in any case.
  c.dtype = "auto"
  c.param_dtype = "float32"  # stored parameters (master weights: train.param_dtype)
  c.remat = False  # recompute each layer in the backward pass (less memory, more compute)
  # Attention route (dgr2_jax/model/attention.py): 'xla' (dense, fastest for tiny CPU models),
  # 'blockwise' (no [T, S] array; any device), 'cudnn', 'splitkey' (decode attention split over
  # keys, docs/decode_attention.md), 'auto' (on GPUs splitkey for decode windows and cudnn for
  # the rest, else blockwise).
  c.attention_impl = "xla"
  c.attention_k_splits = 0   # key splits of 'splitkey'; 0 = two thread blocks per SM at the batch
  c.logits_chunk = 0         # positions per vocabulary chunk of the losses; 0 = 64 MiB of logits
  # f32 logits of one decoding step's positions computed by one LM-head matmul (above: vocabulary
  # tiles for greedy steps, a few rows at a time otherwise); 2 GiB = batch 64 x 33 slots at Qwen3's V.
  c.logits_budget_bytes = 2**31
  return c


def decode_config() -> ml_collections.ConfigDict:
  """Block-diffusion decoding (dgr2_jax.decode.sampler.DecodeConfig); block_size 1 = AR."""
  c = ml_collections.ConfigDict()
  c.block_size = 32  # tokens decoded in parallel per block; 1 = AR (left to right)
  c.threshold = 0.9  # tau: commit each masked position whose top probability >= tau (1.0: one a step)
  c.temperature = 0.0  # 0 = greedy; > 0 samples
  c.top_k = 0  # sampling: keep the k most likely tokens (0 = all)
  c.top_p = 1.0  # sampling: nucleus mass (1.0 = all)
  c.max_new_tokens = 256  # response slots decoded (a multiple of block_size)
  # Step budget per block (dgr2_jax.decode.sampler; 0 = none: tau alone decides, >= 1 commit per
  # step). The paper evaluates with 64 denoising steps for responses of ~180 tokens (~130
  # reasoning + the ranking): 8 steps for each of their 6 blocks of 32 is 48 <= 64, so 8 per block
  # never exceeds the paper's budget. Without a budget, a model that is confident nowhere (the
  # naive conversion) decodes one token per step, left to right: AR in disguise, at no speedup.
  c.steps_per_block = 8
  # 'threshold' (decode/sampler.py) | 'speculative' (decode/speculative.py: this model drafts,
  # `verifier_dir` verifies; '' = the workdir's AR teacher). Speculative output is the verifier's.
  c.mode = "threshold"
  c.verifier_dir = ""  # mode='speculative': the verifying AR model ('' = the workdir's AR teacher)
  # How a finished block's clean K/V are written (decode/sampler.py): 'auto' = 'separate' on CPU;
  # on accelerators 'fused' up to 2 rows per device, 'separate' beyond; 'fused' | 'separate' force one.
  c.kv_write = "auto"
  # Decode steps per host round trip (decode/sampler.py): the decode loop asks "is every row
  # finished?" once per this many steps; up to this many - 1 steps after the last row finished
  # are masked (wasted). 1 = ask after every step.
  c.steps_per_sync = 8
  # mode='speculative' (decode/speculative.py): the verifier's pass runs after every this many
  # drafter steps, a fixed schedule with no host round trip (must divide steps_per_sync; a draft
  # completed earlier waits for the pass); 0 = as soon as enough drafts are ready, decided on the
  # device: no wait, but a host round trip per drafter step on a GPU.
  c.verify_every = 2
  # The decode mesh of eval, generate and bench (dgr2_jax/decode/mesh.py): `data` splits each
  # batch's rows, `tensor` the model (heads, MLP, vocabulary, KV cache); 0 or -1 = all remaining
  # devices. Default: every device decodes its own rows. An 8B model at batch 1: data=1, tensor=8.
  m = ml_collections.ConfigDict()
  m.data = -1   # devices that split each batch's rows; 0 or -1 = all remaining devices
  m.tensor = 1  # devices that split the model (heads, MLP, vocabulary, KV cache); 0/-1 as above
  c.mesh = m
  return c


def teacher_rl_config() -> ml_collections.ConfigDict:
  """The AR teacher's RL (stage teacher_rl: GRPO/DAPO with B = 1 on the SFT model, the paper's GR2)."""
  from dgr2_jax.train import grpo
  c = grpo.rl_config()
  c.lr = 1e-6  # constant
  c.steps = 200  # optimiser steps
  return c


def cft_config() -> ml_collections.ConfigDict:
  """Conversion fine-tuning (dgr2_jax.stages.cft, loss in dgr2_jax.train.cft)."""
  c = ml_collections.ConfigDict()
  c.init_from = ""          # '' => the previous model stage's dir (workdir/convert/model)
  c.epochs = 3  # passes over the training traces
  c.steps = 0               # > 0 overrides epochs
  c.lr = 0.0                # 0 => train.optimizer.peak_lr
  c.batch_size = 0          # 0 => train.batch_size
  c.block_size = 32  # block of the block-diffusion attention the model is trained for
  c.loss_weighting = "1/t"  # '1/t' (masked-diffusion ELBO) | 'none'
  c.eps = 1e-3              # t ~ U(eps, 1)
  c.complementary_mask = False  # also train on each mask's complement (two views per example)
  c.reasoning_weight = 1.0  # loss weight of the reasoning tokens
  c.answer_weight = 1.0  # loss weight of the answer tokens
  # Multiplies reasoning_weight on the reasoning's candidate numbers (the token after each ' #':
  # `next #4. So #4`): the first pick is decided there (dgr2_jax/train/cft.py). 1.0 = no change.
  c.choice_weight = 1.0
  return c


def opd_config() -> ml_collections.ConfigDict:
  """On-policy distillation from the AR teacher on the student's own rollouts."""
  from dgr2_jax.train import opd
  return opd.opd_config()


def rl_config() -> ml_collections.ConfigDict:
  """Trajectory-level GRPO against the re-ranking reward."""
  from dgr2_jax.train import grpo
  return grpo.rl_config()


def bench_config() -> ml_collections.ConfigDict:
  """Speed/accuracy frontier (dgr2_jax.stages.bench)."""
  c = ml_collections.ConfigDict()
  c.thresholds = (1.0, 0.9, 0.6, 0.4)  # tau of each diffusion row of the frontier
  c.block_sizes = (32,)  # block sizes benchmarked (each divides decode.max_new_tokens)
  c.include_ar = True        # the AR row (block 1, the SFT model): the speedup reference
  c.model_dir = ""           # '' => the last model stage of pipeline.stages (rl/opd/cft/convert)
  c.ar_model_dir = ""        # '' => workdir/sft/model
  c.split = ""               # '' => eval.split
  c.max_examples = 0         # 0 => eval.max_examples
  c.batch_size = 0           # 0 => eval.batch_size
  # Every row at each of these batch sizes: 1 (the paper's latency regime) and 0 => the eval batch
  # (throughput); speedups are against the AR row of the same batch size.
  c.batch_sizes = (1, 0)
  c.speculative = True       # rows of speculative decoding (the diffusion model drafts, AR verifies)
  # Speed: after every row of a batch size has decoded once (metrics, compilation), the rows decode
  # their batches again in turn, this many rounds; a row's seconds are its median round.
  c.timing_rounds = 5
  # ... and only the first this many batches of each row (0 = all): on a whole split at 512 new
  # tokens, timing every batch five times more would take hours per row at Qwen3-8B.
  c.timing_batches = 0
  return c


def pipeline_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.stages = PIPELINE_STAGES  # ablations drop entries; the order is fixed
  c.speculative_row = True    # a `speculative` row in the ladder (equal to the `ar` row's metrics)
  # tau of the ladder's block-diffusion rows (0 => decode.threshold). The paper's accuracy table
  # (Q1) is at tau 1.0, "quality-preserving", with its step budget. The speculative row drafts and
  # the on-policy stages roll out at decode's settings whatever this is.
  c.ladder_threshold = 0.0
  # Step budget of the ladder's block-diffusion rows (-1 => decode.steps_per_block; 0 = none). A
  # budget of S steps per block commits at least block_size/S positions a step whatever tau is, so
  # tau 1.0 is one position a step only with 0 here (~11x the forward passes of tau 0.9 on real
  # Beauty; an untrained conversion then decodes mostly left to right: docs/results.md).
  c.ladder_steps_per_block = -1
  return c


def hardware_config() -> ml_collections.ConfigDict:
  """What the dry run plans for (launch/dry_run.py): no devices are needed to plan."""
  c = ml_collections.ConfigDict()
  c.num_devices = 0          # 0 => jax.device_count()
  c.device_memory_gb = 0.0   # 0 => unknown (no fit check)
  return c


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.stage = "pipeline"  # 'pipeline' (every stage of pipeline.stages), one stage, or 'generate'
  c.seed = 0  # seed of every random choice of the run
  c.dry_run = False  # print the mesh and per-device memory plan, then exit (allocates nothing)
  c.data = data_config.data_config()
  c.sids = data_config.sids_config()
  c.retriever = data_config.retriever_config()
  c.task = task_config.task_config()
  c.eval = task_config.eval_config()
  c.train = train_config.train_config()
  c.model = model_config()
  c.decode = decode_config()
  c.cft = cft_config()
  c.teacher_rl = teacher_rl_config()
  c.opd = opd_config()
  c.rl = rl_config()
  c.bench = bench_config()
  c.pipeline = pipeline_config()
  c.hardware = hardware_config()
  return c


# ---- ablation presets ---------------------------------------------------------------------------
def _drop(config, *stages):
  config.pipeline.stages = tuple(s for s in config.pipeline.stages if s not in stages)


def _block(config, b: int):
  config.cft.block_size = b
  config.decode.block_size = b
  config.bench.block_sizes = (b,)


VARIANTS = {
    "": lambda c: None,
    "full": lambda c: None,
    "no_cft": lambda c: _drop(c, "cft"),          # naive conversion -> OPD -> RL
    "no_teacher_rl": lambda c: _drop(c, "teacher_rl"),  # the SFT model is the AR teacher
    "cft_only": lambda c: _drop(c, "opd", "rl"),
    "opd_no_rl": lambda c: _drop(c, "rl"),
    "rl_no_opd": lambda c: _drop(c, "opd"),
    "weight_none": lambda c: setattr(c.cft, "loss_weighting", "none"),
    "complementary": lambda c: setattr(c.cft, "complementary_mask", True),
    **{f"block{b}": (lambda c, b=b: _block(c, b)) for b in (4, 8, 16, 32, 64)},
}


def apply_variants(config, arg) -> ml_collections.ConfigDict:
  """Applies comma-separated ablation presets (`no_cft,block8`); unknown names fail."""
  for name in [a.strip() for a in (arg or "").split(",")]:
    if name not in VARIANTS:
      raise ValueError(f"unknown config preset {name!r}; known: {sorted(k for k in VARIANTS if k)}")
    VARIANTS[name](config)
  return config
