"""The transformer every family is built from: embedding, N pre-norm decoder layers, norm, head.

`DiffusionTransformer` is the masked-diffusion model (LLaDA, Dream): bidirectional attention.
Contract: `model(input_ids [B, L], attention_mask [B, L] | None, position_ids [B, L] | None)`
returns raw logits [B, L, vocab] (never shifted; `logits_shifted` tells the decoder whether output
i-1 predicts token i). Rows may be left-padded: attention_mask 0 marks pads, which no token attends
to, and positions then count real tokens only, so every real token gets the logits it gets unpadded.
The block-diffusion families (SDAR, LLaDA2) share its layers and `run_layers` and differ in the
mask and the cache their forwards build (`block_transformer.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from engine.models.attention import AttentionFn
from engine.models.config import ModelConfig
from engine.models.kv_cache import CacheWrite, KVStore
from engine.models.layers import Attention, Positions, RotaryEmbedding, SwiGLU, make_norm, select_positions
from engine.models.moe import SparseMoe
from engine.models.parallel.group import SINGLE, TensorParallel, VocabShard
from engine.special_tokens import SpecialTokens


def positions_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each real token among the real tokens of its row (Dream's `tok_idx`).

    Pads get position 1 exactly as Dream's `generation_utils._sample` gives them; they are never
    attended to, so the value only has to be a valid position.
    """
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.attn_norm = make_norm(config.hidden_size, config)
        self.attn = Attention(config, index, tp)
        self.mlp_norm = make_norm(config.hidden_size, config)
        moe = config.moe
        self.mlp: nn.Module = (SparseMoe(config.hidden_size, moe, tp)
                               if moe is not None and index >= moe.first_dense_layers
                               else SwiGLU(config.hidden_size, config.intermediate_size, tp))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor],
                cache: Optional[CacheWrite] = None, query_at: Optional[Positions] = None) -> torch.Tensor:
        """The layer's output at every position, or at `query_at` only (every position still
        writes its keys and values): what a last layer needs when only some logits are wanted."""
        attended = self.attn.forward(self.attn_norm.forward(x), cos, sin, mask, cache, query_at)
        x = (x if query_at is None else select_positions(x, query_at)) + attended
        return x + self.mlp.forward(self.mlp_norm.forward(x))


class DiffusionTransformer(nn.Module):
    architecture: ClassVar[str] = ""
    display_name: ClassVar[str] = ""
    block_causal: ClassVar[bool] = False  # block diffusion: causal across blocks (block_transformer.py)

    def __init__(self, config: ModelConfig, special: Optional[SpecialTokens],
                 hf_config: Optional[dict[str, Any]] = None, tp: TensorParallel = SINGLE) -> None:
        """`config` is the whole model's; on a tensor-parallel rank (`tp`) the layers hold their
        share of it (`engine.models.parallel`), and the forward still returns the whole vocabulary."""
        super().__init__()
        self.config = config
        self.special = special  # None only where a checkpoint's ids are not needed (inspect)
        self.hf_config = dict(hf_config or {})
        self.tp = tp
        self.attention_backend = "sdpa"
        self.quantization = "none"  # engine.quantization's mode of the decoder layers' linear layers
        self.quantized_head = False
        # Embedding and head are vocabulary-parallel: each rank holds rows [start, start + real) of
        # both, padded to the same count on every rank (all of them on one device)
        self.vocab_start, self.vocab_rows, padded = tp.padded_split(config.vocab_size)
        self.embed = nn.Embedding(padded, config.hidden_size)
        self.embed.tp_split = "vocab"
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = make_norm(config.hidden_size, config)
        self.lm_head = nn.Linear(config.hidden_size, padded, bias=False)
        self.lm_head.tp_split = "vocab"
        self._gather_logits = True  # False inside `local_logits`
        self._vocab = VocabShard(tp, self.vocab_start, self.vocab_rows, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    @classmethod
    def parse_config(cls, hf_config: dict[str, Any]) -> ModelConfig:
        raise NotImplementedError

    @property
    def logits_shifted(self) -> bool:
        return self.config.logits_shifted

    @property
    def block_size(self) -> Optional[int]:
        """The block a block-diffusion checkpoint was trained with, when its config states one."""
        return self.config.block_size

    @property
    def kv_heads(self) -> int:
        """The KV heads whose keys and values this rank stores (all of them on one device)."""
        return self.tp.kv_split(self.config.num_kv_heads)[1]

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, slots: int, width: int) -> KVStore:
        """An empty store for `slots` rows of `width` positions; a free slot's row attends to its
        first column (a dummy row in a batched forward still attends to something)."""
        c = self.config
        store = KVStore.empty(c.num_layers, slots, self.kv_heads, width, c.head_dim, self.dtype, self.device)
        store.key_mask[:, 0] = True
        return store

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
        over the store's columns, masked by the store's key mask (`attention_mask` must be None),
        or, when `cache.attend_to_cache` is False, over the inputs themselves, masked by
        `attention_mask`.
        If `hidden_states_out` is a list, the input of every layer and the normed final state are
        appended to it (Hugging Face's `output_hidden_states` order)."""
        check_input_ids(input_ids)
        key_mask = None
        if cache is not None and cache.attend_to_cache:
            if attention_mask is not None:
                raise ValueError("with a cache, the key mask comes from the cache store")
            key_mask = cache.key_mask()[:, None, None, :]
        elif attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} does not match "
                                 f"input_ids shape {tuple(input_ids.shape)}")
            key_mask = attention_mask.bool()[:, None, None, :]
            if position_ids is None:
                position_ids = positions_from_attention_mask(attention_mask)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return self.run_layers(input_ids, position_ids, key_mask, cache, logits_at, hidden_states_out)

    def run_layers(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: Optional[torch.Tensor],
                   cache: Optional[CacheWrite], logits_at: Optional[Positions],
                   hidden_states_out: Optional[list[torch.Tensor]]) -> torch.Tensor:
        """The layers over tokens at `position_ids` [B|1, L] under `mask` (see `Attention.forward`).
        With a cache of packed tokens (`CacheWrite.packed`), the inputs are given on the padded grid
        and every layer but attention runs over the packed tokens alone."""
        packed = cache.packed if cache is not None else None
        if packed is not None:
            if isinstance(logits_at, int):
                raise ValueError("packed tokens take their logits at [B, K] positions")
            input_ids, position_ids = packed.pack(input_ids), packed.pack(position_ids.expand_as(input_ids))
        if mask is not None and mask.dtype == torch.bool:
            mask = additive_mask(mask, self.dtype)
        cos, sin = self.rotary.forward(position_ids)
        x = self.embed_tokens(input_ids)
        # Only some outputs wanted: past its keys and values, the last layer computes those positions
        # alone (its attention queries, MLP, norm and head), the same values at a fraction of the work.
        # Under a mask with a row per query (block-causal), or over packed tokens, the head takes the
        # positions instead.
        per_query = mask is not None and mask.shape[-2] > 1
        query_at = logits_at if hidden_states_out is None and not per_query and packed is None else None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if hidden_states_out is not None:
                hidden_states_out.append(x)
            # no hooks: see engine.models.layers
            x = layer.forward(x, cos, sin, mask, cache, query_at if i == last else None)
        if packed is not None:  # back on the rows: at their positions, or every position padded
            x = packed.pad(x) if logits_at is None else packed.take(x, logits_at)
        elif logits_at is not None and query_at is None:
            x = select_positions(x, logits_at)
        x = self.norm.forward(x)
        if hidden_states_out is not None:
            hidden_states_out.append(x)
        return self.head(x)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [B, L, hidden]: on a tensor-parallel rank, the rows of its vocabulary shard
        (zero elsewhere), summed over the ranks."""
        if self.tp.size == 1:
            return self.embed.forward(input_ids)
        local = input_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.vocab_rows)
        x = self.embed.forward(local.masked_fill(elsewhere, 0)).masked_fill(elsewhere[..., None], 0)
        return self.tp.all_reduce(x)

    @contextmanager
    def local_logits(self) -> Iterator[Optional[VocabShard]]:
        """Inside it, a tensor-parallel rank's forwards return its vocabulary shard's logits, padding
        columns -inf (engine/decoding/vocab_parallel.py decides on them); yields the shard (None on one
        device, whose logits are whole)."""
        if self.tp.size == 1:
            yield None
            return
        self._gather_logits = False
        try:
            yield self._vocab
        finally:
            self._gather_logits = True

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [..., vocab]: on a tensor-parallel rank, every rank's shard gathered in rank order,
        whose real rows come first (only the last shards hold padding), the padding cut; inside
        `local_logits`, the rank's own shard."""
        logits = self.lm_head.forward(x)
        if self.tp.size == 1:
            return logits
        if not self._gather_logits:
            padding = torch.arange(logits.shape[-1], device=logits.device) >= self.vocab_rows
            return logits.masked_fill(padding, float("-inf"))
        return self._vocab.gather(logits)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool attention mask (True = may attend) as the additive one SDPA makes of it (0 and -inf in
    the queries' dtype): made once a forward rather than by every layer's attention call."""
    return torch.where(allowed, 0.0, float("-inf")).to(dtype)


def check_input_ids(input_ids: torch.Tensor) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
