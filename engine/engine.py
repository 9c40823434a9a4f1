"""`Engine`: the one entry point. A loaded model, its tokenizer, and decoding as nano-vllm's
schedule -> run -> postprocess:

    request_id = engine.add_request(prompt_ids, params)   # validated and resolved here, once
    while engine.has_unfinished():
        for output in engine.step():                      # one StepOutput per row
            output.new_token_ids, output.finished, output.result

`step()` = the scheduler admits waiting requests into free slots; the model runner builds the
inputs and runs the forwards; the decide step (the policies) commits tokens; one device-to-host
transfer brings every row's summary back; the scheduler advances and finishes rows from it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch

from engine.config import EngineConfig
from engine.decoding.decide import BatchTraits, DecodeState, LogprobColumns, StepRows, decide_step
from engine.decoding.params import DecodeParams, resolve_defaults
from engine.decoding.types import GenerationRequest, GenerationResult
from engine.dual_graphs import DualStepGraphs
from engine.errors import CheckpointError, RequestError
from engine.loading.tokenizer import encode_text, load_tokenizer
from engine.loading.weights import load_model
from engine.model_runner import ModelRunner
from engine.models.transformer import DiffusionTransformer
from engine.request import Request, StepOutput
from engine.scheduler import Scheduler
from engine.scoring import prompt_logprobs, scoring_cost

Prompt = Union[GenerationRequest, Sequence[int], str]


class Engine:
    def __init__(self, config: EngineConfig) -> None:
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
    def from_model(cls, model: DiffusionTransformer, tokenizer: Optional[Any] = None, max_batch: int = 8,
                   compile_decide: bool = False, cuda_graphs: bool = False) -> Engine:
        """An engine over an already loaded model (tests, training, benchmarks)."""
        engine = cls.__new__(cls)
        config = EngineConfig(model="", device=str(model.device), dtype=str(model.dtype).removeprefix("torch."),
                              max_batch=max_batch, compile_decide=compile_decide, cuda_graphs=cuda_graphs,
                              quantization=model.quantization, quantize_head=model.quantized_head)
        engine._setup(config, model, tokenizer)
        return engine

    def _setup(self, config: EngineConfig, model: DiffusionTransformer, tokenizer: Optional[Any]) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = config.max_batch
        self.max_model_len = min(config.max_model_len or model.config.max_position_embeddings,
                                 model.config.max_position_embeddings)
        self._end_ids = torch.tensor(model.special.end_ids, device=model.device)
        self._end_set = frozenset(model.special.end_ids)
        self._ids = itertools.count()
        self.reset()

    def reset(self) -> None:
        """Drop every request, waiting or running (after a failed step)."""
        self.scheduler = Scheduler(self.max_batch)
        graphs = DualStepGraphs(self.model, self.max_batch, capture=True) if self.config.cuda_graphs else None
        self.runner = ModelRunner(self.model, self.max_batch, graphs)
        self.decode_state = DecodeState(self.max_batch, self.model.device, self.config.compile_decide)
        self._device = self.model.device
        self._traits: Optional[BatchTraits] = None  # the last step's, reused while the batch is the same

    @property
    def architecture(self) -> str:
        return self.model.config.architecture

    def default_params(self, params: Optional[DecodeParams] = None) -> DecodeParams:
        """`params` (or the defaults) with this model's defaults filled in."""
        return resolve_defaults(params or DecodeParams(), self.architecture)

    # ------------------------------------------------------------------ the step API

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """RequestError unless the prompt is non-empty token ids of this model's vocabulary."""
        vocab = self.model.config.vocab_size
        if not prompt_ids:
            raise RequestError("prompt_ids must not be empty (a text prompt may encode to no token)",
                               code="empty_prompt")
        bad = next((t for t in prompt_ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")

    def validate(self, prompt_ids: Sequence[int], params: DecodeParams) -> DecodeParams:
        """The request's parameters with the model's defaults filled; RequestError if unusable."""
        self.check_prompt(prompt_ids)
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise RequestError(f"at most {self.config.max_logprobs} top logprobs per token can be returned "
                               f"(--max-logprobs), got {params.logprobs}", param="logprobs", code="invalid_decoding")
        total = len(prompt_ids) + params.gen_length
        if total > self.max_model_len:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                               f"has {len(prompt_ids)} and the generation canvas {params.gen_length} "
                               f"({total} in all)", param="gen_length", code="context_length_exceeded")
        return resolve_defaults(params, self.architecture)

    def add_request(self, prompt_ids: Sequence[int], params: Optional[DecodeParams] = None,
                    request_id: Optional[str] = None, queued_at: Optional[float] = None) -> str:
        """Queue a request; it joins the batch at the next step with a free row. Thread-safe."""
        ids = tuple(int(t) for t in prompt_ids)
        resolved = self.validate(ids, params or DecodeParams())
        request_id = request_id or f"req-{next(self._ids)}"
        request = Request(GenerationRequest(ids, resolved, request_id), resolved, self.model.special.mask_id,
                          self._end_set, queued_at if queued_at is not None else time.perf_counter())
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Drop a waiting request now, a running one at the next step. Thread-safe."""
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """One denoising iteration of every running row (after admitting waiting requests)."""
        _, admitted = self.scheduler.schedule()
        rows = self.scheduler.running
        for request in admitted:
            request.admit(request.slot, self._device)
            self.runner.admit(request, rows)
            self.decode_state.admit(request)
        if not rows:
            return []
        rows = list(rows)
        step_rows = StepRows.build(rows, self._device, self._traits)
        self._traits = step_rows.traits
        inputs = self.runner.run(step_rows)
        new_tokens, summary = decide_step(self.decode_state, step_rows, inputs.logits, inputs.block_tokens,
                                          inputs.in_block, self.model.special.mask_id, self._end_ids)
        self.runner.commit(step_rows, inputs, new_tokens)
        host = summary.tolist()  # the step's one device-to-host transfer
        logprob_k = step_rows.traits.logprob_k
        columns = LogprobColumns(step_rows.width, logprob_k) if logprob_k >= 0 else None
        return self.scheduler.postprocess(rows, host, inputs.fed_tokens, columns)

    # ------------------------------------------------------------------ likelihood

    def check_score(self, prompt_ids: Sequence[int], samples: int) -> None:
        """RequestError unless scoring this prompt fits the model's context and `max_score_tokens`."""
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

    @torch.no_grad()
    def score(self, prompt_ids: Sequence[int], samples: Optional[int] = None,
              seed: int = 0) -> list[Optional[float]]:
        """Per-token log-likelihood estimates of a prompt (LLaDA's Monte-Carlo estimator, made
        per-token so that any suffix sums to the estimate for that continuation: engine.scoring).
        None for the first token. Seeded: the same call gives the same numbers. Runs on the calling
        thread; do not call it while another thread steps this engine."""
        ids = [int(t) for t in prompt_ids]
        samples = samples if samples is not None else DecodeParams().score_samples
        self.check_score(ids, samples)
        return prompt_logprobs(self.model, ids, samples, seed)

    # ------------------------------------------------------------------ offline batches

    def generate(self, prompts: Sequence[Prompt],
                 params: Optional[Union[DecodeParams, Sequence[DecodeParams]]] = None,
                 on_finish: Optional[Callable[[GenerationResult], None]] = None) -> list[GenerationResult]:
        """Decode every prompt and return the results in order: a loop over add_request and step.

        A prompt is token ids, a GenerationRequest, or text (encoded as is, without a chat template:
        see `engine.chat.chat_prompt_ids`). `params` is one DecodeParams for all prompts or one per
        prompt. Requests beyond `max_batch` wait and join as rows finish, exactly as in the server.
        With a tokenizer, each result carries its decoded `text`. `on_finish(result)` is called as each
        request finishes (a progress bar)."""
        if params is None or isinstance(params, DecodeParams):
            params = [params or DecodeParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} DecodeParams for {len(prompts)} prompts")
        order: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                if isinstance(prompt, GenerationRequest):
                    order.append(self.add_request(prompt.prompt_ids, prompt.params, prompt.request_id or None))
                    continue
                if isinstance(prompt, str):
                    if self.tokenizer is None:
                        raise ValueError("text prompts need a tokenizer")
                    prompt = encode_text(self.tokenizer, prompt)
                order.append(self.add_request(prompt, p, f"offline-{i}"))
        except Exception:
            for request_id in order:  # fail before any work is done
                self.abort(request_id)
            raise
        results: dict[str, GenerationResult] = {}
        while self.has_unfinished():
            for output in self.step():
                if output.result is not None:
                    results[output.request_id] = output.result
                    if on_finish is not None:
                        on_finish(output.result)
        ordered = [results[request_id] for request_id in order]
        if self.tokenizer is not None:
            for result in ordered:
                result.text = self.tokenizer.decode(result.response_ids, skip_special_tokens=True)
        return ordered
