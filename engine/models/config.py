"""The architecture description every model file is built from.

Both supported families are pre-norm transformers with RMSNorm, rotary embeddings and a SwiGLU
MLP; they differ only in the fields below. Each family parses its own Hugging Face `config.json`
into this one shape (see `llada.py`, `dream.py`), so layers and the loader never read raw configs.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
