"""Gemma4's routed mixture of experts (DiffusionGemma's backbone): a softmax router over the raw
residual stream and gated-GELU experts stored as two stacked tensors, as the checkpoint holds them.

Router (as the official `DiffusionGemmaTextRouter`): r = RMSNorm_noweight(h) · scale · hidden^(-1/2);
p = softmax(r·Wᵀ) in float32 over every expert; the top k are kept, their weights renormalised to
sum 1 and multiplied by `per_expert_scale[expert]`.
Expert e: gate|up = x·gate_up_proj[e]ᵀ (gate rows first), out = (gelu_tanh(gate)·up)·down_proj[e]ᵀ.
The weighted sum of a token's experts is taken in float32 and cast back, as the official kernels do.

The (token, expert) pairs are grouped by expert so that each expert runs one matmul over its tokens:
`plain` loops over the experts that have tokens (one host read of the per-expert counts a layer);
`grouped_mm` runs torch's grouped GEMM over the jagged groups (no host read), taken automatically
where PyTorch documents it (CUDA, bf16).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.gemma4_ops import gelu_tanh, rms_norm_unweighted
from engine.models.moe import expert_counts

MOE_KERNELS = ("plain", "grouped_mm")


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


class Gemma4Experts(nn.Module):
    # the stacked 3-D weights are no nn.Linear: they stay in the model dtype under --quantization
    quantizable = False

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.kernel: Optional[str] = None  # None: grouped_mm where PyTorch documents it, else plain

    def kernel_for(self, x: torch.Tensor) -> str:
        if self.kernel is not None:
            return self.kernel
        documented = (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")
                      and torch.cuda.get_device_capability(x.device) >= (8, 0))
        # grouped_mm needs every row stride to be a multiple of 16 bytes
        aligned = all(w * x.element_size() % 16 == 0 for w in (self.hidden_size, self.intermediate_size))
        return "grouped_mm" if documented and aligned else "plain"

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], expert_ids [T, k], weights [T, k] float32 -> Σ_j weights[:, j] · expert_j(x), [T, H]."""
        tokens, top_k = expert_ids.shape
        flat = expert_ids.reshape(-1)
        order = flat.argsort(stable=True)
        grouped = x[order // top_k]  # one row per (token, expert) pair, grouped by expert
        counts = expert_counts(flat, self.num_experts)
        if self.kernel_for(x) == "grouped_mm":
            out = self._grouped_mm(grouped, counts)
        else:
            out = self._plain(grouped, counts)
        per_pair = torch.empty_like(out)
        per_pair[order] = out
        return (per_pair.view(tokens, top_k, -1).float() * weights[..., None]).sum(1).to(x.dtype)

    def _plain(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(grouped)
        start = 0
        for expert, count in enumerate(counts.tolist()):  # the host read of this kernel
            if count:
                rows = slice(start, start + count)
                gate, up = F.linear(grouped[rows], self.gate_up_proj[expert]).split(self.intermediate_size, dim=-1)
                out[rows] = F.linear(gelu_tanh(gate) * up, self.down_proj[expert])
                start += count
        return out

    def _grouped_mm(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ends = counts.cumsum(0).to(torch.int32)
        gate_up = F.grouped_mm(grouped, self.gate_up_proj.transpose(1, 2), offs=ends)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.grouped_mm(gelu_tanh(gate) * up, self.down_proj.transpose(1, 2), offs=ends)
