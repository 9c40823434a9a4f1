"""The shared block-diffusion transformer (SDAR, LLaDA2): embedding, N pre-norm decoder layers with
block-causal attention, norm, head. Predictions are in place (no logit shift).

Two entry points, both returning raw logits [B, L, vocab]:
- `forward(input_ids, position_ids, block_size=..., mask=...)`: a full forward with no cache. With
  `mask="block_causal"` the token at position p sees every token of blocks <= p // block_size; with
  `mask="additive_01"` it runs LLaDA2.1's official `generate()` mask instead: the same 0/1 block
  matrix *added* to the scores, so every token also sees later blocks (at weight e⁻¹ relative to
  the allowed ones), and a finished block's keys/values change with the current block.
- `forward_cached(input_ids, cache, block_size=...)`: each row's tokens at absolute positions
  `cache.start[r] + arange(L)`, attending block-causally to themselves and to the row's cached
  columns [0, start[r]); their keys/values are written at those columns. The cache is exact (the
  same logits as the full block-causal forward) when it holds whole blocks only, i.e. every call
  starts at a multiple of the block size: a token's keys/values depend on its whole block, so a
  prompt that ends inside a block leaves that block's prompt tokens to the first decoded block, as
  the official decoders do. A block becomes part of the cache when the caller advances `start` past
  it after a forward over its final (clean) tokens; a denoising step leaves `start` alone, and its
  keys/values, which no earlier position ever sees, are overwritten by the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional

import torch
from torch import nn

from engine.models.attention import AttentionFn
from engine.models.block_layers import BlockDecoderLayer, LayerCache, block_causal_mask, make_norm
from engine.models.config import ModelConfig
from engine.models.kv_cache import KVStore
from engine.models.layers import Positions, RotaryEmbedding, select_positions
from engine.models.moe import MOE_KERNELS, GroupedExperts, grouped_mm_available
from engine.special_tokens import SpecialTokens

BlockMask = Literal["block_causal", "additive_01"]


@dataclass
class BlockCache:
    """Where a `forward_cached` call reads and writes keys/values.

    `store` keys/values are [slots, kv_heads, width, head_dim], post-QK-norm and post-RoPE keys and
    raw values, one row per slot, column = absolute position in the slot's sequence. Input row r
    uses store row `rows[r]` (r when None); its cached length is `start[r]`. `width` (a host int,
    at least max(start) + L) bounds the columns attended over; None means the whole store."""

    store: KVStore
    start: torch.Tensor  # [R] long
    rows: Optional[torch.Tensor] = None  # [R] long
    width: Optional[int] = None


class BlockDiffusionTransformer(nn.Module):
    architecture: ClassVar[str] = ""
    display_name: ClassVar[str] = ""

    def __init__(self, config: ModelConfig, special: Optional[SpecialTokens],
                 hf_config: Optional[dict[str, Any]] = None) -> None:
        super().__init__()
        self.config = config
        self.special = special
        self.hf_config = dict(hf_config or {})
        self.attention_backend = "sdpa"
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta)
        self.layers = nn.ModuleList(BlockDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = make_norm(config.hidden_size, config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    @classmethod
    def parse_config(cls, hf_config: dict[str, Any]) -> ModelConfig:
        raise NotImplementedError

    @property
    def logits_shifted(self) -> bool:
        return False

    @property
    def block_size(self) -> Optional[int]:
        """The block the checkpoint was trained with, when its config states one."""
        return self.config.block_size

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def set_attention_kernel(self, name: str, kernel: AttentionFn) -> None:
        self.attention_backend = name
        for layer in self.layers:
            layer.attn.kernel = kernel

    def set_moe_kernel(self, name: Optional[str]) -> None:
        """Force the experts' kernel ("plain" or "grouped_mm"); None picks per device."""
        if name is not None and name not in MOE_KERNELS:
            raise ValueError(f"unknown MoE kernel {name!r}; known: {', '.join(MOE_KERNELS)}")
        if name == "grouped_mm" and not grouped_mm_available():
            raise ValueError("this PyTorch has no torch.nn.functional.grouped_mm")
        for module in self.modules():
            if isinstance(module, GroupedExperts):
                module.kernel = name

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None, *,
                block_size: int, mask: BlockMask = "block_causal",
                logits_at: Optional[Positions] = None,
                hidden_states_out: Optional[list[torch.Tensor]] = None,
                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Raw logits [B, L, vocab] (or at `logits_at`, see `select_positions`) of a full forward over
        tokens at `position_ids` [B|1, L] (default 0..L-1). `hidden_states_out`, when a list, gets
        every layer's input and the normed final state (Hugging Face's `output_hidden_states`).
        `attention_mask`, a bool [B|1, 1, L, L] (True = may attend), replaces the block mask: training
        feeds a noisy and a clean copy of a sequence side by side (tinymodels/block_objective.py)."""
        _check_ids(input_ids, block_size)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise ValueError(f"attention_mask must be bool, got {attention_mask.dtype}")
            return self._run(input_ids, position_ids, attention_mask, None, logits_at, hidden_states_out)
        allowed = block_causal_mask(position_ids, position_ids, block_size)
        if mask == "additive_01":
            attn_mask = allowed.to(self.dtype)
        elif mask == "block_causal":
            attn_mask = allowed
        else:
            raise ValueError(f"unknown block mask {mask!r}; known: block_causal, additive_01")
        return self._run(input_ids, position_ids, attn_mask, None, logits_at, hidden_states_out)

    def forward_cached(self, input_ids: torch.Tensor, cache: BlockCache, *, block_size: int,
                       logits_at: Optional[Positions] = None) -> torch.Tensor:
        """Raw logits [R, L, vocab] of each row's L tokens at positions `cache.start[r] + arange(L)`
        against the row's exact cache (see the module docstring)."""
        _check_ids(input_ids, block_size)
        rows_in, length = input_ids.shape
        store = cache.store
        width = store.width if cache.width is None else cache.width
        device = input_ids.device
        position_ids = cache.start[:, None] + torch.arange(length, device=device)
        columns = torch.arange(width, device=device)
        written = columns[None, :] < (cache.start + length)[:, None]  # [R, width]
        attn_mask = block_causal_mask(position_ids, columns[None], block_size) & written[:, None, None, :]
        rows = cache.rows if cache.rows is not None else torch.arange(rows_in, device=device)
        rows_are_store = cache.rows is None and rows_in == store.batch
        layer_caches = [LayerCache(k, v, position_ids, rows, width, rows_are_store)
                        for k, v in zip(store.keys, store.values, strict=True)]
        return self._run(input_ids, position_ids, attn_mask, layer_caches, logits_at, None)

    def _run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn_mask: torch.Tensor,
             layer_caches: Optional[list[LayerCache]], logits_at: Optional[Positions],
             hidden_states_out: Optional[list[torch.Tensor]]) -> torch.Tensor:
        cos, sin = self.rotary.forward(position_ids)
        x = self.embed.forward(input_ids)
        for i, layer in enumerate(self.layers):
            if hidden_states_out is not None:
                hidden_states_out.append(x)
            x = layer.forward(x, cos, sin, attn_mask, None if layer_caches is None else layer_caches[i])
        if logits_at is not None:
            x = select_positions(x, logits_at)
        x = self.norm.forward(x)
        if hidden_states_out is not None:
            hidden_states_out.append(x)
        return self.lm_head.forward(x)


def _check_ids(input_ids: torch.Tensor, block_size: int) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
