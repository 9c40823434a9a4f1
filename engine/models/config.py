"""The architecture description every model file is built from.

Every supported family is a pre-norm transformer with RMSNorm, rotary embeddings and a SwiGLU
MLP; they differ only in the fields below. Each family parses its own Hugging Face `config.json`
into this one shape (see `llada.py`, `dream.py`, `sdar.py`, `llada2.py`), so layers and the loader
never read raw configs. The fields after `max_position_embeddings` are used by the block-diffusion
families (SDAR, LLaDA2) only; their defaults describe LLaDA and Dream. DiffusionGemma's Gemma4
backbone (sandwich norms, GELU, two attention layer kinds, dense MLP beside routed experts) is
described by `gemma` (`gemma4_config.py`); its base fields give the sliding layers' shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.models.gemma4_config import Gemma4Spec


@dataclass(frozen=True)
class MoeConfig:
    """LLaDA2's mixture of experts: a sigmoid router whose choice (not weights) is biased by
    `expert_bias`, limited to the `topk_group` best of `num_groups` groups of contiguous experts."""

    num_experts: int
    experts_per_token: int
    num_groups: int
    topk_group: int
    expert_intermediate_size: int
    num_shared_experts: int
    routed_scaling_factor: float
    first_dense_layers: int  # layers [0, first_dense_layers) use the dense MLP

    def __post_init__(self) -> None:
        if self.num_experts % self.num_groups:
            raise ValueError(f"num_experts {self.num_experts} is not divisible by n_group {self.num_groups}")
        if not 0 < self.topk_group <= self.num_groups:
            raise ValueError(f"topk_group {self.topk_group} must be in [1, n_group={self.num_groups}]")
        if self.num_experts // self.num_groups < 2:
            raise ValueError("each expert group needs at least 2 experts (its score is its top-2 sum)")
        if not 0 < self.experts_per_token <= self.topk_group * (self.num_experts // self.num_groups):
            raise ValueError(f"num_experts_per_tok {self.experts_per_token} exceeds the experts of "
                             f"{self.topk_group} group(s)")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    # Rows of the embedding and of the output head; may exceed the tokenizer's vocabulary.
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    tie_word_embeddings: bool
    # LLaDA (`rope_full_precision`) rotates q/k in float32; Dream rotates in the activation dtype
    # with float32-computed cos/sin. Identical in float32, different rounding in bf16.
    rope_in_float32: bool
    # Dream predicts token i at output position i-1 (AR-style); LLaDA predicts it in place.
    logits_shifted: bool
    max_position_embeddings: int
    # Qwen3-style configs state head_dim; it need not be hidden_size / num_heads.
    explicit_head_dim: Optional[int] = None
    # RoPE rotates the first head_dim * factor dims of each head (LLaDA2: 0.5), the rest pass through.
    partial_rotary_factor: float = 1.0
    qk_norm: bool = False  # RMSNorm over head_dim on q and k, before RoPE
    # RMSNorm multiplies by its weight in float32 and casts once (SDAR's Triton kernel), instead of
    # casting first (LLaDA, Dream, LLaDA2). Identical in float32.
    norm_scale_in_float32: bool = False
    block_size: Optional[int] = None  # the block a block-diffusion model was trained with
    moe: Optional[MoeConfig] = None
    gemma: Optional[Gemma4Spec] = None  # DiffusionGemma's backbone (diffusion_gemma.py)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.explicit_head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if self.head_dim <= 0 or self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"head_dim {self.head_dim} with partial_rotary_factor {self.partial_rotary_factor} "
                             "must give an even, positive number of rotary dims")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
