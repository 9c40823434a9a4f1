"""Offline generation over a bare model: `Engine.from_model(...).generate(...)` in one call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

from engine.decoding.params import DecodeParams
from engine.decoding.types import GenerationRequest, GenerationResult
from engine.models.transformer import DiffusionTransformer

Prompt = Union[GenerationRequest, Sequence[int], str]


def generate(model: DiffusionTransformer, prompts: Sequence[Prompt],
             params: Optional[Union[DecodeParams, Sequence[DecodeParams]]] = None,
             max_batch: int = 8, tokenizer: Optional[Any] = None) -> list[GenerationResult]:
    """Decode every prompt with `model` and return the results in order (see `Engine.generate`)."""
    from engine.engine import Engine  # the engine imports the decoding package: import it late

    return Engine.from_model(model, tokenizer, max_batch).generate(prompts, params)
