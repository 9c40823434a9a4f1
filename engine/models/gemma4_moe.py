"""Gemma4's routed mixture of experts (DiffusionGemma's backbone): a softmax router over the raw
residual stream; its gated-GELU experts are the shared `GroupedExperts` (`engine.models.moe`) in the
checkpoint's stacked layout (two 3-D tensors) with tanh-GELU as the activation.

Router (as the official `DiffusionGemmaTextRouter`): r = RMSNorm_noweight(h) · scale · hidden^(-1/2);
p = softmax(r·Wᵀ) in float32 over every expert; the top k are kept, their weights renormalised to
sum 1 and multiplied by `per_expert_scale[expert]`.
Expert e: gate|up = x·gate_up_proj[e]ᵀ (gate rows first), out = (gelu_tanh(gate)·up)·down_proj[e]ᵀ.
The weighted sum of a token's experts is taken in float32 and cast back, as the official kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.gemma4_ops import rms_norm_unweighted


class Gemma4Router(nn.Module):
    # routing decisions are discrete: a quantized projection could pick other experts
    quantizable = False

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.top_k = top_k
        self.eps = eps
        self.root_size = hidden_size ** -0.5
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden] (the raw residual) -> expert ids [T, k] and float32 weights [T, k]."""
        r = rms_norm_unweighted(h, self.eps) * self.scale * self.root_size
        probabilities = F.softmax(self.proj.forward(r), dim=-1, dtype=torch.float32)
        weights, ids = probabilities.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights * self.per_expert_scale[ids]
