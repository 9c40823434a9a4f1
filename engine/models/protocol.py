"""`DiffusionModel`: what the engine asks of every family's model, whatever its layers (the masked
and block-diffusion transformers, engine/models/transformer.py; DiffusionGemma's encoder-decoder,
engine/models/diffusion_gemma.py). A decoding mode (engine/mode.py) calls its own family's
forwards; everything else reads only this."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, ClassVar, Optional, Protocol

import torch

from engine.models.attention import AttentionFn
from engine.models.config import ModelConfig
from engine.models.kv_cache import SlotStore
from engine.models.parallel.group import TensorParallel, VocabShard
from engine.special_tokens import SpecialTokens


class DiffusionModel(Protocol):
    architecture: ClassVar[str]  # the family's key (engine/models/registry.py)
    display_name: ClassVar[str]
    config: ModelConfig  # the whole model's, on a tensor-parallel rank too
    special: Optional[SpecialTokens]  # None only where a checkpoint's ids are not needed (inspect)
    hf_config: dict[str, Any]
    tp: TensorParallel
    attention_backend: str
    quantization: str  # engine.quantization's mode of the decoder layers' linear layers
    quantized_head: bool

    def __init__(self, config: ModelConfig, special: Optional[SpecialTokens],
                 hf_config: Optional[dict[str, Any]] = None, tp: TensorParallel = ...) -> None: ...

    @classmethod
    def parse_config(cls, hf_config: dict[str, Any]) -> ModelConfig: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def block_size(self) -> Optional[int]:
        """The block (a uniform-noise model's canvas) the checkpoint states, if any."""

    @property
    def logits_shifted(self) -> bool: ...

    def set_attention_kernel(self, name: str, kernel: AttentionFn) -> None: ...

    def new_cache(self, slots: int, width: int) -> SlotStore:
        """An empty cache for `slots` rows of `width` positions."""

    def local_logits(self) -> AbstractContextManager[Optional[VocabShard]]:
        """Forwards inside it return a tensor-parallel rank's vocabulary shard (yielded; None: the
        whole vocabulary) for the decide step to reduce (engine/decoding/vocab_parallel.py)."""
