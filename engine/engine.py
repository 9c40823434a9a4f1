"""`Engine`: a loaded model, its tokenizer and batched decoding, built from an `EngineConfig`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

from engine.config import EngineConfig
from engine.decoding.generate import Prompt, generate
from engine.decoding.params import DecodeParams, resolve_defaults
from engine.decoding.runner import BlockDiffusionRunner
from engine.decoding.types import GenerationResult
from engine.errors import CheckpointError
from engine.loader import load_model
from engine.tokenizer import load_tokenizer


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model = load_model(config.model, device=config.device, dtype=config.dtype,
                                use_flash_attn=config.use_flash_attn)
        self.tokenizer: Optional[Any]
        try:
            self.tokenizer = load_tokenizer(config.model)
        except CheckpointError:
            self.tokenizer = None  # token-id prompts still work

    @property
    def architecture(self) -> str:
        return self.model.config.architecture

    def default_params(self, params: Optional[DecodeParams] = None) -> DecodeParams:
        """`params` (or the defaults) with this model's defaults filled in."""
        return resolve_defaults(params or DecodeParams(), self.architecture)

    def new_runner(self) -> BlockDiffusionRunner:
        return BlockDiffusionRunner(self.model, self.config.max_batch)

    def generate(self, prompts: Sequence[Prompt],
                 params: Optional[Union[DecodeParams, Sequence[DecodeParams]]] = None) -> list[GenerationResult]:
        return generate(self.model, prompts, params, max_batch=self.config.max_batch, tokenizer=self.tokenizer)
