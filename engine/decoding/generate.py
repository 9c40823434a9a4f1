"""Offline generation: a list of requests in, their results out, batched by the runner."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, Optional, Union

from engine.decoding.params import DecodeParams
from engine.decoding.runner import BlockDiffusionRunner
from engine.decoding.types import GenerationRequest, GenerationResult
from engine.models.transformer import DiffusionTransformer
from engine.tokenizer import encode_text

Prompt = Union[GenerationRequest, Sequence[int], str]


def generate(model: DiffusionTransformer, prompts: Sequence[Prompt],
             params: Optional[Union[DecodeParams, Sequence[DecodeParams]]] = None,
             max_batch: int = 8, tokenizer: Optional[Any] = None) -> list[GenerationResult]:
    """Decode every prompt and return the results in order.

    A prompt is token ids, a ready GenerationRequest, or text (needs `tokenizer`; it is encoded as
    is, without a chat template: see `engine.chat.chat_prompt_ids`). `params` is one DecodeParams
    for all prompts or one per prompt. Requests beyond `max_batch` wait and join as rows finish,
    exactly as in the server. With a tokenizer, each result carries its decoded `text`."""
    if params is None or isinstance(params, DecodeParams):
        params = [params or DecodeParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} DecodeParams for {len(prompts)} prompts")
    requests = []
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        if isinstance(prompt, GenerationRequest):
            requests.append(prompt if prompt.request_id else GenerationRequest(prompt.prompt_ids, prompt.params,
                                                                               f"offline-{i}"))
        elif isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer")
            ids = encode_text(tokenizer, prompt)
            requests.append(GenerationRequest(tuple(ids), p, f"offline-{i}"))
        else:
            requests.append(GenerationRequest(tuple(int(t) for t in prompt), p, f"offline-{i}"))
    runner = BlockDiffusionRunner(model, max_batch)
    for request in requests:
        runner.validate(request)  # fail before any work is done
    pending = deque(requests)
    results: dict[str, GenerationResult] = {}
    while pending or runner.num_active:
        while pending and runner.has_capacity:
            runner.add(pending.popleft())
        for result in runner.step():
            results[result.request_id] = result
    ordered = [results[r.request_id] for r in requests]
    if tokenizer is not None:
        for result in ordered:
            result.text = tokenizer.decode(result.response_ids, skip_special_tokens=True)
    return ordered
