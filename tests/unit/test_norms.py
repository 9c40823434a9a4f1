"""The layers' RMSNorm paths on hand-built tensors: the fewer-operations forms give PyTorch's
`F.rms_norm` (the golden formula's kernel) bit for bit, and the queries' and keys' QK-norm in one
pass gives what the two norms give apart."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.layers import Attention, RMSNorm, normalized

EPS = 1e-6


@pytest.mark.parametrize("shape", [(1, 7, 128), (3, 16, 64), (1, 104, 6, 32), (2, 5, 3, 8)])
def test_normalized_and_rms_norm_give_f_rms_norm_bit_for_bit(shape: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=generator) * 3
    weight = torch.randn(shape[-1], generator=generator)
    norm = RMSNorm(shape[-1], EPS)
    norm.weight.data.copy_(weight)
    expected = F.rms_norm(x, (shape[-1],), weight, EPS)
    assert torch.equal(normalized(x, EPS) * weight, expected)
    assert torch.equal(norm.forward(x), expected)
    assert torch.equal(normalized(x, EPS), F.rms_norm(x, (shape[-1],), None, EPS))


def _attention(heads: int, kv_heads: int, head_dim: int) -> Attention:
    config = ModelConfig(architecture="sdar", hidden_size=heads * head_dim, num_layers=1, num_heads=heads,
                         num_kv_heads=kv_heads, intermediate_size=8, vocab_size=11, rms_norm_eps=EPS,
                         rope_theta=10000.0, qkv_bias=False, tie_word_embeddings=False, rope_in_float32=True,
                         logits_shifted=False, max_position_embeddings=64, qk_norm=True,
                         norm_scale_in_float32=True)
    return Attention(config, 0)


def test_qk_norm_in_one_pass_gives_the_two_norms_bit_for_bit() -> None:
    heads, kv_heads, head_dim = 4, 2, 8
    attention = _attention(heads, kv_heads, head_dim)
    generator = torch.Generator().manual_seed(0)
    assert attention.q_norm is not None and attention.k_norm is not None
    attention.q_norm.weight.data.copy_(torch.randn(head_dim, generator=generator))
    attention.k_norm.weight.data.copy_(torch.randn(head_dim, generator=generator))
    # a slice of a q|k|v view, as the layer hands it over (not contiguous)
    qkv = torch.randn(2, 5, heads + 2 * kv_heads, head_dim, generator=generator) * 2
    qk = qkv[:, :, :heads + kv_heads]
    together = attention._qk_normed(qk, heads, kv_heads)
    apart = torch.cat((attention.q_norm.forward(qk[:, :, :heads]), attention.k_norm.forward(qk[:, :, heads:])), dim=2)
    assert torch.equal(together, apart)
    expected_q = F.rms_norm(qk[:, :, :heads], (head_dim,), attention.q_norm.weight, EPS)
    assert torch.equal(together[:, :, :heads], expected_q)


def test_qk_norm_in_bfloat16_keeps_each_norms_own_cast() -> None:
    heads, kv_heads, head_dim = 2, 1, 8
    attention = _attention(heads, kv_heads, head_dim).to(torch.bfloat16)
    qk = torch.randn(1, 3, heads + kv_heads, head_dim).to(torch.bfloat16)
    assert attention.q_norm is not None and attention.k_norm is not None
    apart = torch.cat((attention.q_norm.forward(qk[:, :, :heads]), attention.k_norm.forward(qk[:, :, heads:])), dim=2)
    assert torch.equal(attention._qk_normed(qk, heads, kv_heads), apart)
