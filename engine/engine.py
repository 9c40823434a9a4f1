"""`Engine`: the one entry point. A loaded model, its tokenizer, and decoding as nano-vllm's
schedule -> run -> postprocess:

    request_id = engine.add_request(prompt_ids, params)   # resolved here, once (`resolve`; the server
                                                          # prices it, then `submit`s the same)
    while engine.has_unfinished():
        for output in engine.step():                      # one StepOutput per row
            output.new_token_ids, output.finished, output.result

`step()` = the scheduler admits waiting requests into free slots (`Slots.admit` writes their device
state); the step's `Batch` is built, each row's plan made once by the decoding mode (chosen from the
model's family: `engine/mode.py`); the model runner runs the planned forwards; the decide step (the
policies) commits tokens, written back into the slots once; one device-to-host transfer brings every
row's summary back; the scheduler advances and finishes rows from it (`engine/advance.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import torch

from engine import summary
from engine.batch import Batch
from engine.config import EngineConfig
from engine.cpus import set_threads
from engine.decoding.params import DecodeParamError, DecodeParams
from engine.decoding.types import GenerationResult, RequestStats
from engine.errors import CheckpointError, RequestError, SettingError
from engine.loading.tokenizer import load_tokenizer
from engine.loading.weights import load_model
from engine.model_runner import MODES, ModelRunner
from engine.models.protocol import DiffusionModel
from engine.models.registry import Family, family_of
from engine.prefix_cache import PrefixCache, default_budget_gb
from engine.request import Request, Resolved, StepOutput
from engine.scheduler import Scheduler
from engine.scoring import ScoringJob, scoring_cost
from engine.user_text import encode_prompt_text

Prompt = Union[Sequence[int], str]


class Engine:
    # why a multi-process engine can no longer step (a worker died or hung: engine.executor); a
    # single-process engine has no such failure
    fault: Optional[str] = None

    def __init__(self, config: EngineConfig) -> None:
        """The engine of one device. A tensor-parallel group is started above the engine, by
        `engine.executor.start_engine(config)`, which builds this for `tensor_parallel_size` 1."""
        if config.tensor_parallel_size > 1:
            raise SettingError("--tensor-parallel-size", f"Engine(config) runs on one device; "
                               f"engine.start_engine(config) starts a group of {config.tensor_parallel_size}")
        set_threads(config.threads)  # process-wide: before any work
        model = load_model(config.model, device=config.device, dtype=config.dtype,
                           use_flash_attn=config.use_flash_attn, quantization=config.quantization,
                           quantize_head=config.quantize_head)
        tokenizer: Optional[Any]
        try:
            tokenizer = load_tokenizer(config.model)
        except CheckpointError:
            tokenizer = None  # token-id prompts still work
        self._setup(config, model, tokenizer)

    @classmethod
    def from_model(cls, model: DiffusionModel, tokenizer: Optional[Any] = None, max_batch: int = 8,
                   cuda_graphs: bool = False, torch_compile: bool = False,
                   enable_prefix_caching: Optional[bool] = False, prefix_cache_gb: Optional[float] = None) -> Engine:
        """An engine over an already loaded model (tests, training, benchmarks). Prefix caching is off
        unless asked for, so that repeated runs of the same prompts measure the same work."""
        engine = cls.__new__(cls)
        config = EngineConfig(model="", device=str(model.device), dtype=str(model.dtype).removeprefix("torch."),
                              max_batch=max_batch, cuda_graphs=cuda_graphs, torch_compile=torch_compile,
                              quantization=model.quantization, quantize_head=model.quantized_head,
                              enable_prefix_caching=enable_prefix_caching, prefix_cache_gb=prefix_cache_gb)
        engine._setup(config, model, tokenizer)
        return engine

    def _setup(self, config: EngineConfig, model: DiffusionModel, tokenizer: Optional[Any]) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = config.max_batch
        self.max_model_len = min(config.max_model_len or model.config.max_position_embeddings,
                                 model.config.max_position_embeddings)
        self._end_ids = torch.tensor(model.special.end_ids, device=model.device)
        self._end_set = frozenset(model.special.end_ids)
        self._ids = itertools.count()
        self.prefix_cache = self._make_prefix_cache(config)
        self._build_step()

    def _make_prefix_cache(self, config: EngineConfig) -> Optional[PrefixCache]:
        """The prefix cache across requests, where asked for and the decoding mode allows it."""
        if config.enable_prefix_caching is False:
            return None
        if not MODES[self.family.mode].prefix_caching:
            if config.enable_prefix_caching:
                raise SettingError("--enable-prefix-caching",
                                   f"{self.model.display_name} decodes by {self.family.mode} diffusion, whose "
                                   f"attention is bidirectional over the whole canvas, so a prompt's keys and values "
                                   f"depend on every token after it and none computed for one request is exact for "
                                   f"another; serve it without the flag (its per-request caches are the decoding "
                                   f"knob `cache`)")
            return None
        gb = config.prefix_cache_gb if config.prefix_cache_gb is not None else default_budget_gb(self.model.device)
        return PrefixCache(int(gb * (1 << 30)))

    def close(self) -> None:
        """Stop what the engine started (a tensor-parallel group's workers); nothing here."""

    def reset(self) -> None:
        """Drop every request, waiting or running (after a failed step)."""
        self._build_step()

    def _build_step(self) -> None:
        """The step's state, empty: slots, scheduler, decoding mode and runner."""
        mode = MODES[self.family.mode]  # the decoding mode of the model's family: the same for every reset
        self.slots = mode.slots_class(self.model, self.max_batch, mode.row_state(self.model))
        self.scheduler = self._make_scheduler()
        self.mode = mode(self.model, self.slots, self.config.static_forwards)
        self.runner = ModelRunner(self.mode, self.slots)

    def _make_scheduler(self) -> Scheduler:
        return Scheduler(self.max_batch, self.model.device, self.slots.move)

    @property
    def architecture(self) -> str:
        return self.model.config.architecture

    @functools.cached_property
    def family(self) -> Family:
        """The model family's facts (engine/models/registry.py)."""
        return family_of(self.model)

    @property
    def model_block_length(self) -> Optional[int]:
        """The block a request that names none decodes with, when the model decides it: for a
        block-diffusion model the block it was trained with (SDAR's `block_size`), else its family's
        (the official decoders' 32: LLaDA2's config names none); None for masked-diffusion models,
        whose default block follows the canvas (DecodeParams.effective_block_length)."""
        default = self.family.default_block
        return None if default is None else (self.model.block_size or default)

    def default_params(self, params: Optional[DecodeParams] = None) -> DecodeParams:
        """`params` (or the defaults) with this model's defaults filled in."""
        family = self.family
        params = (params or DecodeParams()).with_model_defaults(self.model_block_length, family.default_cache,
                                                                family.gating, family.default_policy)
        return self.mode.with_defaults(params)

    # ------------------------------------------------------------------ the step API

    @functools.cached_property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: the tokenizer's vocabulary where one is loaded (the embedding
        may have more rows, padding that no text encodes to), else the embedding's rows."""
        rows = self.model.config.vocab_size
        return rows if self.tokenizer is None else min(rows, len(self.tokenizer))

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """RequestError unless the prompt is non-empty token ids of this model's vocabulary, without the
        mask token (the decoder would fill a prompt's mask as part of the answer: a block-diffusion
        row's first block holds the prompt's tail; text never encodes to it, engine/user_text.py)."""
        vocab = self.vocab_size
        if not prompt_ids:
            raise RequestError("prompt_ids must not be empty (a text prompt may encode to no token)",
                               code="empty_prompt")
        bad = next((t for t in prompt_ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        mask = self.model.special.mask_id
        at = next((i for i, t in enumerate(prompt_ids) if int(t) == mask), None)
        if at is not None:
            raise RequestError(f"prompt token {at} is the mask token (id {mask}), which marks the positions the "
                               f"model decodes; a prompt may not hold it", code="mask_token_in_prompt")

    def resolve(self, prompt_ids: Sequence[int], knobs: Union[DecodeParams, Mapping[str, Any], None] = None,
                max_tokens: Optional[int] = None) -> Resolved:
        """The request as it will run, resolved once (any thread): the prompt checked; the knobs (a
        `decoding` mapping, or DecodeParams as they stand) with this model's defaults filled; given as
        a mapping, its canvas is the mode's for `max_tokens` (`DecodingMode.canvas`; 0 decodes nothing:
        the prompt and knobs are checked, not the context, which a scored prompt may fill); its
        geometry. RequestError naming the knob that is wrong."""
        ids = tuple(int(t) for t in prompt_ids)
        self.check_prompt(ids)
        try:
            if not isinstance(knobs, DecodeParams):
                knobs = dict(knobs or {})
                if knobs.get("block_length") is None and self.model_block_length:
                    knobs["block_length"] = self.model_block_length  # the block max_tokens rounds up to
                knobs["gen_length"] = self.mode.canvas(knobs, max_tokens, self.max_model_len - len(ids))
                knobs = DecodeParams.from_dict(knobs)
            params = self.default_params(knobs)
        except DecodeParamError as err:  # a knob out of range, or in conflict with this model's defaults
            raise RequestError(str(err), param=err.param, code="invalid_decoding") from err
        except TypeError as err:  # a knob of the wrong type
            raise RequestError(f"invalid decoding knobs: {err}", param="decoding", code="invalid_decoding") from err
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise RequestError(f"at most {self.config.max_logprobs} top logprobs per token can be returned "
                               f"(--max-logprobs), got {params.logprobs}", param="logprobs", code="invalid_decoding")
        self.mode.check(params)  # a knob, cache or policy that this model's decoding mode does not have
        geometry = self.mode.geometry(len(ids), params)
        if geometry.length > self.max_model_len and max_tokens != 0:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                               f"has {len(ids)} and the generation canvas {params.gen_length} "
                               f"({geometry.length} in all)", param="gen_length", code="context_length_exceeded")
        return Resolved(ids, params, geometry)

    def add_request(self, prompt_ids: Sequence[int], params: Optional[DecodeParams] = None,
                    request_id: Optional[str] = None, queued_at: Optional[float] = None) -> str:
        """Resolve and queue a request; it joins the batch at the next step with a free row. Thread-safe."""
        return self.submit(self.resolve(prompt_ids, params), request_id, queued_at)

    def submit(self, resolved: Resolved, request_id: Optional[str] = None, queued_at: Optional[float] = None) -> str:
        """Queue a resolved request (`resolve`). Thread-safe."""
        request_id = request_id or f"req-{next(self._ids)}"
        request = Request(request_id, resolved.prompt_ids, resolved.params, resolved.geometry, self.mode.blank,
                          self._end_set, queued_at if queued_at is not None else time.perf_counter())
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Drop a waiting request now, a running one at the next step. Thread-safe."""
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def running_stats(self) -> dict[str, RequestStats]:
        """A copy of every running request's telemetry so far, by id, the steps of its unfinished
        block included (call it on the stepping thread, between steps: a stream cut by a stop string
        reports the steps it took until then)."""
        return {r.request_id: dataclasses.replace(r.stats, steps_per_block=[*r.stats.steps_per_block, r.step]
                                                  if r.step else list(r.stats.steps_per_block))
                for r in self.scheduler.running}

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One denoising iteration of every running row (after admitting waiting requests)."""
        for request in self.scheduler.schedule():
            self.slots.admit(request, self.scheduler.running, self.mode.blank)
            if self.prefix_cache is not None:  # its cached prompt blocks, copied into its slot
                self.prefix_cache.restore(request, self.slots.store)
        if not self.scheduler.running:
            return []
        batch = Batch.build(list(self.scheduler.running), self.mode.plan, self.model.device)
        out = self.runner.run(batch)
        rows = self.slots.rows(batch)
        decided = self.mode.decide(batch, rows, out, self._end_ids)
        self.slots.write_back(batch, out.positions, decided.tokens, decided.state)
        # the step's one device-to-host read
        host = summary.decode(decided.summary.tolist(), batch.width, batch.logprob_k)
        # the blocks this step made final, finished rows' included: read before a finished row's slot
        # takes a row that moves down (Scheduler._release)
        insert = None if self.prefix_cache is None else functools.partial(
            self.prefix_cache.insert, batch.requests, self.slots.store)
        return self.scheduler.postprocess(batch, host, self.mode, before_release=insert)

    # ------------------------------------------------------------------ likelihood

    def check_score(self, prompt_ids: Sequence[int], samples: int) -> None:
        """RequestError unless scoring this prompt fits the model's context and `max_score_tokens`."""
        if not self.mode.scores_likelihood:
            raise RequestError(f"likelihood scoring (echo with logprobs) is not available for {self.mode.name}-"
                               f"diffusion models ({self.model.display_name}): engine.scoring's estimator is LLaDA's, "
                               f"for full-attention masked diffusion; generate without echo instead", param="echo",
                               code="scoring_unsupported")
        self.check_prompt(prompt_ids)
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise RequestError(f"score_samples must be an integer >= 1, got {samples!r}", param="score_samples")
        if len(prompt_ids) > self.max_model_len:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                               f"has {len(prompt_ids)}", code="context_length_exceeded")
        cost = scoring_cost(len(prompt_ids), samples)
        if cost > self.config.max_score_tokens:
            raise RequestError(f"scoring {len(prompt_ids)} tokens with {samples} samples per split feeds the model "
                               f"{cost} tokens, above this server's limit of {self.config.max_score_tokens} "
                               f"(--max-score-tokens); use fewer samples or a shorter prompt",
                               param="score_samples", code="scoring_too_large")

    def scoring_job(self, prompt_ids: Sequence[int], samples: Optional[int] = None, seed: int = 0) -> ScoringJob:
        """A checked likelihood-scoring job of a prompt, as forwards of at most `score_chunk_tokens`
        tokens: the server runs them between decode steps (`ScoringJob.advance`), `score` at once.
        Its masks are drawn here, from the seed: the numbers do not depend on how it is run."""
        ids = [int(t) for t in prompt_ids]
        samples = samples if samples is not None else DecodeParams().score_samples
        self.check_score(ids, samples)
        return ScoringJob(self.model, ids, samples, seed, chunk_tokens=self.config.score_chunk_tokens)

    def score(self, prompt_ids: Sequence[int], samples: Optional[int] = None,
              seed: int = 0) -> list[Optional[float]]:
        """Per-token log-likelihood estimates of a prompt (LLaDA's Monte-Carlo estimator, made
        per-token so that any suffix sums to the estimate for that continuation: engine.scoring).
        None for the first token. Seeded: the same call gives the same numbers. Runs on the calling
        thread; do not call it while another thread steps this engine."""
        return self.scoring_job(prompt_ids, samples, seed).run().logprobs()

    # ------------------------------------------------------------------ offline batches

    def generate(self, prompts: Sequence[Prompt],
                 params: Optional[Union[DecodeParams, Sequence[DecodeParams]]] = None,
                 on_finish: Optional[Callable[[GenerationResult], None]] = None,
                 on_progress: Optional[Callable[[float], None]] = None) -> list[GenerationResult]:
        """Decode every prompt and return the results in order: a loop over add_request and step.

        A prompt is token ids or text (encoded as a completions prompt, without a chat template: see
        `engine.chat.chat_prompt_ids`; the mask token it spells is plain text, engine/user_text.py).
        `params` is one DecodeParams for all prompts or one per prompt. Requests beyond `max_batch`
        wait and join as rows finish, exactly as in the server.
        With a tokenizer, each result carries its decoded `text`. `on_finish(result)` is called as each
        request finishes; `on_progress(done)` after every step, `done` the requests finished so far with
        each unfinished one counted by the share of its canvas committed (a progress bar that moves
        from the first step, when a batch's rows would all finish together)."""
        if params is None or isinstance(params, DecodeParams):
            params = [params or DecodeParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} DecodeParams for {len(prompts)} prompts")
        order: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                if isinstance(prompt, str):
                    if self.tokenizer is None:
                        raise ValueError("text prompts need a tokenizer")
                    prompt = encode_prompt_text(self.tokenizer, prompt, self.model.special.mask_id)
                order.append(self.add_request(prompt, p, f"offline-{i}"))
        except Exception:
            for request_id in order:  # fail before any work is done
                self.abort(request_id)
            raise
        results: dict[str, GenerationResult] = {}
        canvas = {request_id: max(1, p.gen_length) for request_id, p in zip(order, params, strict=True)}
        share: dict[str, float] = {}  # of each unfinished request's canvas, committed so far
        while self.has_unfinished():
            for output in self.step():
                if output.result is not None:
                    results[output.request_id] = output.result
                    share.pop(output.request_id, None)
                    if on_finish is not None:
                        on_finish(output.result)
                elif on_progress is not None:  # a block-diffusion canvas may hold more than gen_length
                    done = share.get(output.request_id, 0.0) + output.committed / canvas[output.request_id]
                    share[output.request_id] = min(done, 0.99)
            if on_progress is not None:
                on_progress(len(results) + sum(share.values()))
        ordered = [results[request_id] for request_id in order]
        if self.tokenizer is not None:
            for result in ordered:
                result.text = self.tokenizer.decode(result.response_ids, skip_special_tokens=True)
        return ordered
