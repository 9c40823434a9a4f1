"""The shared masked-diffusion transformer: embedding, N pre-norm decoder layers, norm, head.

Contract: `model(input_ids [B, L], attention_mask [B, L] | None, position_ids [B, L] | None)`
returns raw logits [B, L, vocab] (never shifted; `logits_shifted` tells the decoder whether output
i-1 predicts token i). Rows may be left-padded: attention_mask 0 marks pads, which no token attends
to, and positions then count real tokens only, so every real token gets the logits it gets unpadded.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch
from torch import nn

from engine.models.attention import AttentionFn
from engine.models.config import ModelConfig
from engine.models.kv_cache import CacheWrite
from engine.models.layers import DecoderLayer, Positions, RMSNorm, RotaryEmbedding, select_positions
from engine.special_tokens import SpecialTokens


def positions_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each real token among the real tokens of its row (Dream's `tok_idx`).

    Pads get position 1 exactly as Dream's `generation_utils._sample` gives them; they are never
    attended to, so the value only has to be a valid position.
    """
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


class DiffusionTransformer(nn.Module):
    architecture: ClassVar[str] = ""
    display_name: ClassVar[str] = ""

    def __init__(self, config: ModelConfig, special: SpecialTokens,
                 hf_config: Optional[dict[str, Any]] = None) -> None:
        super().__init__()
        self.config = config
        self.special = special
        self.hf_config = dict(hf_config or {})
        self.attention_backend = "sdpa"
        self.quantization = "none"  # engine.quantization's mode of the decoder layers' linear layers
        self.quantized_head = False
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    @classmethod
    def parse_config(cls, hf_config: dict[str, Any]) -> ModelConfig:
        raise NotImplementedError

    @property
    def logits_shifted(self) -> bool:
        return self.config.logits_shifted

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

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, *,
                cache: Optional[CacheWrite] = None,
                logits_at: Optional[Positions] = None,
                hidden_states_out: Optional[list[torch.Tensor]] = None) -> torch.Tensor:
        """Raw logits [B, L, vocab], or [B, K, vocab] at the input positions `logits_at` [B, K], or at
        the first K input positions when `logits_at` is the int K.

        With `cache`, the inputs' keys/values are written into the cache store and attention runs
        over the store's columns, masked by `cache.store.key_mask` (`attention_mask` must be None),
        or, when `cache.attend_to_cache` is False, over the inputs themselves, masked by
        `attention_mask`.
        If `hidden_states_out` is a list, the input of every layer and the normed final state are
        appended to it (Hugging Face's `output_hidden_states` order)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
        key_mask = None
        if cache is not None and cache.attend_to_cache:
            if attention_mask is not None:
                raise ValueError("with a cache, the key mask comes from the cache store")
            store_mask = cache.store.key_mask if cache.rows is None else cache.store.key_mask[cache.rows]
            key_mask = store_mask[:, None, None, :]
        elif attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} does not match "
                                 f"input_ids shape {tuple(input_ids.shape)}")
            key_mask = attention_mask.bool()[:, None, None, :]
            if position_ids is None:
                position_ids = positions_from_attention_mask(attention_mask)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        cos, sin = self.rotary.forward(position_ids)
        x = self.embed.forward(input_ids)
        write_rows = None if cache is None else cache.write_rows()
        # Only some outputs wanted: past its keys and values, the last layer computes those positions
        # alone (its attention queries, MLP, norm and head), the same values at a fraction of the work
        query_at = logits_at if hidden_states_out is None else None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if hidden_states_out is not None:
                hidden_states_out.append(x)
            layer_cache = None if cache is None else (*cache.layer(i), cache.write_index, write_rows, cache.rows,
                                                      cache.attend_to_cache)
            # no hooks: see engine.models.layers
            x = layer.forward(x, cos, sin, key_mask, layer_cache, query_at if i == last else None)
        if logits_at is not None and query_at is None:
            x = select_positions(x, logits_at)
        x = self.norm.forward(x)
        if hidden_states_out is not None:
            hidden_states_out.append(x)
        return self.lm_head.forward(x)
