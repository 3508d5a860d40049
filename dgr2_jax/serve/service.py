"""What the server serves, without HTTP: a pipeline workdir's models, tokenizer and item catalogue
behind the engines, and the re-rank / generate requests checked, rendered, decoded and parsed
exactly as the eval stage does.

`Service(config, workdir)` loads
  * the final model (`--model_dir`, else the last diffusion model stage of the workdir's chain)
    for mode 'threshold' (block diffusion at `config.decode`'s block size; tau per request);
  * the AR teacher (`--verifier_dir`, else `config.decode.verifier_dir`, else the workdir's
    teacher) for mode 'ar' (block size 1) and as the verifier of mode 'speculative';
  * the tokenizer (the model directory's when it has one, else the traces stage's) and the data
    stage's item table and SIDs (item ids are indices into that table).
Prompts are `task.pipeline.encode_prompt` of {history, candidates} with `config.task` (the eval
stage's prompts); outputs are scored with `task.metrics.score_output` (the eval stage's parser):
an invalid output falls back to the retriever's order. Bad input raises `BadRequest` naming the
field.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

from dgr2_jax import chain
from dgr2_jax.decode import prefix, runtime
from dgr2_jax.serve import engine as engine_lib
from dgr2_jax.serve import slots as slots_lib
from dgr2_jax.task import answer as answer_lib
from dgr2_jax.task import copurchase
from dgr2_jax.task import metrics as metrics_lib
from dgr2_jax.task import pipeline as pipeline_lib
from dgr2_jax.task import tokenizer as tok_lib

MODES = ("threshold", "speculative", "ar")


class BadRequest(ValueError):
  """A request field is missing, of the wrong type or out of range (HTTP 400). `reason` is the
  metrics label."""

  def __init__(self, field: str, msg: str, reason: str = "bad_field"):
    super().__init__(f"{field}: {msg}")
    self.field, self.reason = field, reason


@dataclasses.dataclass(frozen=True)
class ServeOptions:
  slots: int = 8                    # rows decoded together per engine
  steps_per_round: int = 8          # denoising steps per host round trip
  policy: str = "continuous"        # engine.POLICIES
  early_exit: bool = True           # a round ends right after a row finishes (engine.py)
  max_queue: int = 256              # waiting requests per mode before 429
  default_timeout_s: float = 60.0
  max_timeout_s: float = 600.0
  modes: tuple = MODES


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def resolve_models(config, workdir: str, model_dir: str | None = None, verifier_dir: str | None = None):
  """(final model dir, AR teacher dir or None); FileNotFoundError naming what is missing."""
  if not model_dir:
    stage = chain.final_model_stage(config)
    if stage is None:
      raise FileNotFoundError("--model_dir is required: the config's pipeline has no diffusion model stage")
    model_dir = chain.model_dir(workdir, stage)
  if not os.path.isfile(os.path.join(model_dir, "config.json")):
    raise FileNotFoundError(f"--model_dir: model directory {model_dir!r} does not exist (run the pipeline first)")
  verifier_dir = (verifier_dir or config.get("decode", {}).get("verifier_dir", "")
                  or chain.teacher_model_dir(config, workdir))
  if not os.path.isfile(os.path.join(verifier_dir, "config.json")):
    verifier_dir = None
  return model_dir, verifier_dir


class Service:
  """The engines of one workdir plus request checking, prompt rendering and answer parsing."""

  def __init__(self, config, workdir: str, model_dir: str | None = None, verifier_dir: str | None = None,
               options: ServeOptions = ServeOptions()):
    from dgr2_jax.data import api
    self.config, self.workdir, self.options = config, workdir, options
    self.task = config.task
    self.model_dir, self.verifier_dir = resolve_models(config, workdir, model_dir, verifier_dir)
    tok_path = (self.model_dir if os.path.exists(os.path.join(self.model_dir, "tokenizer_config.json"))
                else tok_lib.tokenizer_dir(config, workdir))
    self.tokenizer = tok_lib.load_tokenizer(tok_path)
    self.tids = tok_lib.token_ids(self.tokenizer)
    self.items, self.sids = api.load_items(workdir), api.load_sids(workdir)
    self.num_candidates = int(api.load_candidates(workdir, "test").shape[1])
    # task.mark_copurchase: next-purchase counts over the interactions the test protocol knows
    # (every user's sequence but its last item), so a served impression reads as in eval.
    self.next_table = (copurchase.table(api.load_sequences(workdir), 1)
                       if self.task.get("mark_copurchase", False) else None)
    self.prompt_slots = int(self.task.prompt_len)
    # Prepared for decoding on the host (per layer, projections fused, kernels in decode.weight_dtype):
    # the decoders' own qwen3.decode_params then does nothing, and the device holds one copy.
    wd = runtime.weight_dtype(config)   # both models prepared alike
    mc, params = runtime.load_on_device(self.model_dir, config.get("model"), weight_dtype=wd)
    self.model_config = mc
    self.dc = runtime.decode_config(config, self.tids, mc)
    self.max_new_tokens = self.dc.max_new_tokens
    o = options
    engines = {}
    if "threshold" in o.modes:
      dec = slots_lib.SlotDecoder(mc, params, self.dc, o.slots, self.prompt_slots)
      engines["threshold"] = engine_lib.Engine("threshold", dec, o.steps_per_round, o.policy, o.max_queue,
                                                 o.early_exit)
    if self.verifier_dir and ("ar" in o.modes or "speculative" in o.modes):
      vc, vparams = runtime.load_on_device(self.verifier_dir, config.get("model"), weight_dtype=wd)
      if "ar" in o.modes:
        # The AR models decode left to right, as the eval ladder decodes them.
        c_ar = config.copy_and_resolve_references()
        with c_ar.unlocked():
          c_ar.decode.block_size, c_ar.decode.threshold, c_ar.decode.mode = 1, 1.0, "threshold"
        dc_ar = runtime.decode_config(c_ar, self.tids, vc)
        dec = slots_lib.SlotDecoder(vc, vparams, dc_ar, o.slots, self.prompt_slots)
        engines["ar"] = engine_lib.Engine("ar", dec, o.steps_per_round, o.policy, o.max_queue,
                                                 o.early_exit)
      if "speculative" in o.modes:
        from dgr2_jax.decode import speculative
        speculative.check_pair(mc, vc, self.dc.mask_token_id)
        dc, p = self.dc, self.prompt_slots

        def spec_fn(prompts, tau):
          return speculative.generate(mc, params, vc, vparams, prompts, dataclasses.replace(dc, threshold=tau),
                                      max_prompt_len=p)
        engines["speculative"] = engine_lib.StaticEngine("speculative", spec_fn, o.slots, o.max_queue)
    self.engines = engines
    self.shared_prefix = self._set_shared_prefix(engines)
    self.modes = tuple(m for m in MODES if m in engines)
    self.scheduler = engine_lib.Scheduler(engines)

  def _set_shared_prefix(self, engines: dict) -> int:
    """`decode.shared_prefix` != 0: the token prefix of every re-rank prompt (the system message and
    instructions: the common prefix of probe prompts that differ from their first history item on,
    `prefix.resolve`) is prefilled once by each slot engine (serve/slots.py). -> its length."""
    if self.dc.shared_prefix == 0:
      return 0
    ni, nc = len(self.items), self.num_candidates
    probes = [pipeline_lib.encode_prompt(self.tokenizer, self.example(h, [(i + k) % ni for i in range(nc)]),
                                         self.items, self.sids, self.task)[0]
              for k, h in enumerate(([], [0], [1 % ni]))]
    n = prefix.resolve(self.dc.shared_prefix, probes)
    for eng in engines.values():
      if hasattr(eng, "decoder"):   # slot engines; the speculative one finds the prefix per batch
        eng.decoder.set_prefix(probes[0][:n])
    return n

  # ---- request fields -------------------------------------------------------------------------
  def _items(self, body: dict, field: str, allow_empty: bool) -> list[int]:
    v = body.get(field)
    if not isinstance(v, list) or not all(_is_int(x) for x in v):
      raise BadRequest(field, "must be a list of item ids (ints)")
    if not v and not allow_empty:
      raise BadRequest(field, "must not be empty")
    bad = [x for x in v if not 0 <= x < len(self.items)]
    if bad:
      raise BadRequest(field, f"unknown item id {bad[0]} (the item table has ids 0..{len(self.items) - 1})",
                       "unknown_item")
    return list(v)

  def decode_options(self, body: dict) -> dict:
    """mode, threshold, max_new_tokens, timeout_s of a request body, checked, defaults filled."""
    mode = body.get("mode", "threshold")
    if mode not in self.modes:
      raise BadRequest("mode", f"must be one of {list(self.modes)}, got {mode!r}" if isinstance(mode, str)
                       else f"must be one of {list(self.modes)}")
    tau = body.get("threshold", self.dc.threshold)
    if not _is_num(tau) or not 0.0 < tau <= 1.0:
      raise BadRequest("threshold", "must be a number in (0, 1]")
    if mode == "ar":
      tau = 1.0
    n = body.get("max_new_tokens", self.max_new_tokens)
    if not _is_int(n) or not 1 <= n <= self.max_new_tokens:
      raise BadRequest("max_new_tokens", f"must be an int in [1, {self.max_new_tokens}]")
    t = body.get("timeout_s", self.options.default_timeout_s)
    if not _is_num(t) or not 0 < t <= self.options.max_timeout_s:
      raise BadRequest("timeout_s", f"must be a number in (0, {self.options.max_timeout_s}]")
    return dict(mode=mode, threshold=float(tau), max_new_tokens=int(n), timeout_s=float(t))

  def rerank_request(self, body: dict) -> tuple[dict, engine_lib.Request, str]:
    """(example, engine request, mode) of a /v1/rerank body; BadRequest on bad input."""
    if not isinstance(body, dict):
      raise BadRequest("body", "must be a JSON object")
    unknown = sorted(set(body) - {"history", "candidates", "mode", "threshold", "max_new_tokens", "timeout_s"})
    if unknown:
      raise BadRequest(unknown[0], "unknown field")
    if "history" not in body:
      raise BadRequest("history", "is required")
    if "candidates" not in body:
      raise BadRequest("candidates", "is required")
    history = self._items(body, "history", allow_empty=True)
    cands = self._items(body, "candidates", allow_empty=False)
    if len(cands) != self.num_candidates:
      raise BadRequest("candidates", f"must hold {self.num_candidates} item ids (the retriever's list), "
                       f"got {len(cands)}", "candidate_count")
    if len(set(cands)) != len(cands):
      raise BadRequest("candidates", "item ids must be distinct")
    opts = self.decode_options(body)
    ex = self.example(history, cands)
    try:
      prompt, _ = pipeline_lib.encode_prompt(self.tokenizer, ex, self.items, self.sids, self.task)
    except ValueError as e:
      raise BadRequest("candidates", f"the prompt does not fit task.prompt_len ({e})") from None
    return ex, self._request(prompt, opts), opts["mode"]

  def example(self, history: list[int], cands: list[int]) -> dict:
    """The task example of one impression, as the eval stage builds a test user's."""
    ex = dict(history=history, candidates=cands, example_id=None, user=None, target=-1, target_pos=-1)
    if self.next_table is not None:
      ex["bought_next"] = copurchase.counts(self.next_table, history, cands)
    return ex

  def _request(self, prompt, opts) -> engine_lib.Request:
    return engine_lib.Request(prompt, threshold=opts["threshold"], max_new_tokens=opts["max_new_tokens"],
                              deadline=time.monotonic() + opts["timeout_s"])

  def rerank_response(self, ex: dict, res: dict) -> dict:
    rec = metrics_lib.score_output(res["output_ids"], self.tokenizer, self.tids, ex, self.sids)
    valid = rec["verdict"] == answer_lib.VALID
    reasoning, _ = answer_lib.split_response(rec["output"])
    return dict(ranking=rec["ranking_items"] if valid else list(ex["candidates"]), reasoning=reasoning or "",
                valid=valid, fallback=not valid, verdict=rec["verdict"], nfe=res["nfe"],
                latency_ms=round(res["latency_ms"], 3))

  def generate_request(self, body: dict) -> tuple[engine_lib.Request, str]:
    """A /v1/generate body: exactly one of prompt_ids, prompt (text, no template), messages (the
    chat template + generation prompt), as the generate stage reads them."""
    if not isinstance(body, dict):
      raise BadRequest("body", "must be a JSON object")
    kinds = [k for k in ("prompt_ids", "prompt", "messages") if k in body]
    unknown = sorted(set(body) - {"prompt_ids", "prompt", "messages", "enable_thinking", "mode", "threshold",
                                  "max_new_tokens", "timeout_s"})
    if unknown:
      raise BadRequest(unknown[0], "unknown field")
    if len(kinds) != 1:
      raise BadRequest("prompt_ids", "exactly one of prompt_ids, prompt, messages is required")
    kind, v = kinds[0], body[kinds[0]]
    if kind == "prompt_ids":
      if not isinstance(v, list) or not v or not all(_is_int(t) and 0 <= t < self.model_config.vocab_size for t in v):
        raise BadRequest("prompt_ids", f"must be a non-empty list of token ids in [0, {self.model_config.vocab_size})")
      ids = list(v)
    elif kind == "prompt":
      if not isinstance(v, str) or not v:
        raise BadRequest("prompt", "must be a non-empty string")
      ids = list(self.tokenizer.encode(v, add_special_tokens=False))
    else:
      if not isinstance(v, list) or not v or not all(
          isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in v):
        raise BadRequest("messages", 'must be a non-empty list of {"role": str, "content": str}')
      think = body.get("enable_thinking", self.task.enable_thinking)
      if not isinstance(think, bool):
        raise BadRequest("enable_thinking", "must be a boolean")
      text = self.tokenizer.apply_chat_template(v, tokenize=False, add_generation_prompt=True,
                                                enable_thinking=think)
      ids = list(self.tokenizer.encode(text, add_special_tokens=False))
    if not ids:
      raise BadRequest(kind, "encodes to no tokens")
    if len(ids) > self.prompt_slots:
      raise BadRequest(kind, f"{len(ids)} tokens, more than task.prompt_len={self.prompt_slots}")
    opts = self.decode_options(body)
    return self._request(ids, opts), opts["mode"]

  def generate_response(self, res: dict) -> dict:
    return dict(output_ids=res["output_ids"],
                text=self.tokenizer.decode(res["output_ids"], skip_special_tokens=False),
                nfe=res["nfe"], latency_ms=round(res["latency_ms"], 3))

  def warmup(self):
    """One request per mode through the engines (compiles prefill and step) before /readyz. With a
    shared prefix, the slot engines also prefill one prompt without it (a /v1/generate prompt of
    its own), so no first request of that kind waits for a compile."""
    ex = dict(history=[0], candidates=list(range(self.num_candidates)))
    t = self.options.max_timeout_s
    for mode in self.modes:
      made = [lambda: self.rerank_request(dict(ex, mode=mode, timeout_s=t))[1]]
      if self.shared_prefix and hasattr(self.engines[mode], "decoder"):   # shorter than the prefix: no reuse
        opts = self.decode_options(dict(mode=mode, max_new_tokens=1, timeout_s=t))
        made.append(lambda: self._request([self.tids.pad_id], opts))
      for make in made:   # one at a time, each request's deadline from its own start
        req = make()
        self.scheduler.submit(mode, req)
        req.future.result()
    for eng in self.engines.values():   # the counters start after the compiles
      eng.stats = engine_lib.Stats()
