"""A tiny GRPO run for the dynamic-sampling tests (tests/test_dynamic_sampling.py and its
multi-process worker tests/mp_rl_worker.py).

A random 1-layer block-diffusion Qwen3 (vocab 64, block 4, 8 new tokens) rolls out G = 4 samples of
each of 16 fixed prompts; the reward is the rollout's mean token id / 64 (it differs between any
two different samples), except for the prompts whose example id is in `dead`, which all get reward
0: their groups have no reward variance. The prompts come from the grain iterator the RL stages use
(`on_policy.prompt_iterator`'s `pipeline.make_iterator`), so each process holds its share of every
draw and the order is that of one process.
"""

import jax
import ml_collections
import numpy as np

from dgr2_jax.decode import sampler
from dgr2_jax.model import qwen3
from dgr2_jax.model.config import Qwen3Config
from dgr2_jax.task import pipeline
from dgr2_jax.train import config as train_config
from dgr2_jax.train import grpo, loop, rollouts

G, BS, R, MASK, N_PROMPTS, PPS = 4, 4, 8, 63, 16, 2


def model():
  cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                    mask_token_id=MASK, eos_token_id=5, pad_token_id=0).as_block_diffusion(BS, MASK)
  params = qwen3.init_params(cfg, jax.random.PRNGKey(4))
  return cfg, jax.tree_util.tree_map(lambda x: x * 3 if x.ndim == 2 else x, params)


def decode_config():
  return sampler.DecodeConfig(block_size=BS, threshold=0.5, temperature=1.0, max_new_tokens=R, eos_ids=(5,),
                              mask_token_id=MASK, pad_id=0)


def prompts() -> dict:
  rs = np.random.RandomState(0)
  toks, lens = sampler.left_pad([rs.randint(6, 60, rs.randint(2, 6)).tolist() for _ in range(N_PROMPTS)], 5, 0)
  return {"prompt_ids": toks, "prompt_len": lens, "example_id": np.arange(N_PROMPTS)}


def prompt_iter(pps: int = PPS, process=None):
  return pipeline.make_iterator(prompts(), pps, seed=0, field="prompts_per_step", process=process)


def make_batch_fn(cfg, dead=(), seen=None):
  """The RL stage's make_batch (stages/rl.py) with the toy reward; `seen` collects each call's
  example ids (this process's)."""
  dc, dead = decode_config(), np.asarray(sorted(dead), np.int64)

  def make_batch(p, pr, key):
    roll = rollouts.sample(cfg, p, pr["prompt_ids"], pr["prompt_len"], dc, key, G)
    seg = rollouts.replay_inputs(roll, BS, MASK)
    m = roll["loss_mask"]
    rew = (roll["tokens"] * m).sum(1) / np.maximum(m.sum(1), 1) / 64.0
    rew = np.where(np.isin(np.repeat(pr["example_id"], G), dead), 0.0, rew).astype(np.float32)
    adv, keep = grpo.group_advantages(rew, G)
    if seen is not None:
      seen.append([int(i) for i in pr["example_id"]])
    batch = dict(prompt=roll["prompt_ids"], prompt_len=roll["prompt_len"], old_logp=roll["logprob"],
                 advantages=adv, loss_mask=m & keep[:, None], **{k: seg[k] for k in rollouts.SEGMENT_KEYS})
    return batch, {"reward_mean": float(rew.mean()), "groups_dropped": float(1 - keep.reshape(-1, G)[:, 0].mean())}

  return make_batch


def loss_fn(cfg):
  obj = grpo.Objective(clip_low=0.2, clip_high=0.28)
  return lambda p, b, rng: grpo.grpo_loss(cfg, p, b, rng, block_size=BS, objective=obj, temperature=1.0,
                                          mask_id=MASK)


def loop_config(steps: int, rows: int, grad_accum: int = 1, data: int = -1):
  """The on-policy loop's config (`on_policy.on_policy_config`'s fields): `rows` per step."""
  config = ml_collections.ConfigDict({"seed": 0, "train": train_config.train_config()})
  tc = config.train
  tc.batch_size, tc.total_steps, tc.grad_accum_steps = rows, steps, grad_accum
  tc.tensorboard, tc.async_checkpointing, tc.checkpoint_every = False, False, 1
  tc.optimizer.peak_lr, tc.optimizer.warmup_steps, tc.optimizer.schedule = 3e-2, 0, "constant"
  tc.mesh.data = data
  return config


def train(workdir: str, *, steps: int, draws: int, target: int, dead=(), seen=None, data: int = -1,
          it=None) -> dict:
  """`loop.train` on the dynamic-sampling step source as stages/rl.py sets it up (`draws` x the
  rows of a draw, `draws` micro-batches; seed 0)."""
  cfg, params = model()
  rows = PPS * G
  source = rollouts.on_policy_batches(make_batch_fn(cfg, dead, seen), prompt_iter() if it is None else it, 0,
                                      rollouts.DynamicSampling(draws, target, G))
  return loop.train(loop_config(steps, draws * rows, draws, data), workdir, params=params, loss_fn=loss_fn(cfg),
                    step_batches=source, desc="rl-toy")


def first_batches(k: int) -> list[list[int]]:
  """The example ids of the iterator's first `k` global batches."""
  it = prompt_iter(process=(0, 1))
  return [[int(i) for i in next(it)["example_id"]] for _ in range(k)]
