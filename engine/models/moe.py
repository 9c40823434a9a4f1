"""LLaDA2's mixture-of-experts MLP: a group-limited sigmoid router, routed experts computed over all
routed tokens at once (grouped by expert), and an always-on shared expert.

Router (float32, as the official `LLaDA2MoeGate`): s = sigmoid(x·Wgᵀ); the *choice* uses s +
expert_bias: a group's score is the sum of its two best biased scores, the `topk_group` best groups
stay eligible, and the top `experts_per_token` eligible experts are taken. The *weights* are the
unbiased s of the chosen experts, renormalised and scaled by `routed_scaling_factor`.

Experts: the (token, expert) pairs are sorted by expert, so each expert runs one matmul over its
tokens. Two kernels compute that: `plain` (one matmul pair per expert with tokens; it reads the
per-expert counts on the host, once per MoE layer) and `grouped_mm` (torch's grouped GEMM over the
jagged groups: no host read), taken automatically where PyTorch documents it (CUDA, bf16).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import MoeConfig
from engine.models.layers import FusedLinear, SwiGLU

MOE_KERNELS = ("plain", "grouped_mm")
# The official router divides by (sum of chosen scores + this) when it picks more than one expert.
_WEIGHT_SUM_GUARD = 1e-20
# A group's score is the sum of its best two biased expert scores (fixed in the official router).
_GROUP_SCORE_TOP = 2


def grouped_mm_available() -> bool:
    return hasattr(F, "grouped_mm")


def _grouped_mm_fits(x: torch.Tensor, widths: tuple[int, ...]) -> bool:
    """grouped_mm's kernels need every row stride to be a multiple of 16 bytes."""
    return grouped_mm_available() and all(w * x.element_size() % 16 == 0 for w in widths)


class MoeRouter(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        # A buffer in the official code; a parameter here so the loader fills it like any weight.
        self.expert_bias = nn.Parameter(torch.zeros(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, k], weights [T, k] float32, raw logits [T, E] float32);
        ids in descending biased score, as `torch.topk` orders them."""
        moe = self.moe
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        biased = scores + self.expert_bias
        tokens = biased.shape[0]
        group_scores = biased.view(tokens, moe.num_groups, -1).topk(_GROUP_SCORE_TOP, dim=-1).values.sum(-1)
        best_groups = group_scores.topk(moe.topk_group, dim=-1, sorted=False).indices
        eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        eligible = eligible.repeat_interleave(moe.num_experts // moe.num_groups, dim=1)
        chosen = biased.masked_fill(~eligible, float("-inf")).topk(moe.experts_per_token, dim=-1).indices
        weights = scores.gather(1, chosen)
        if moe.experts_per_token > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + _WEIGHT_SUM_GUARD)
        return chosen, weights * moe.routed_scaling_factor, logits


class GroupedExperts(nn.Module):
    """All routed experts' SwiGLU weights stacked: gate|up rows of expert e at [e·2I, (e+1)·2I), down
    rows at [e·H, (e+1)·H); the loader fills them expert by expert through the shard names."""

    # forward views the stacked weights as [experts, rows, columns], which neither quantization
    # library's weight supports: the routed experts stay in the model dtype (engine.quantization)
    quantizable = False

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.gate_up_proj = FusedLinear(
            hidden_size, {f"{e}.{part}": intermediate_size for e in range(num_experts) for part in ("gate", "up")},
            bias=False)
        self.down_proj = FusedLinear(intermediate_size, {str(e): hidden_size for e in range(num_experts)}, bias=False)
        self.kernel: Optional[str] = None  # None: grouped_mm where PyTorch documents it, else plain

    def kernel_for(self, x: torch.Tensor) -> str:
        if self.kernel is not None:
            return self.kernel
        on_documented_device = (x.is_cuda and x.dtype == torch.bfloat16
                                and torch.cuda.get_device_capability(x.device) >= (8, 0))
        if on_documented_device and _grouped_mm_fits(x, (self.hidden_size, self.intermediate_size)):
            return "grouped_mm"
        return "plain"

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], expert_ids [T, k], weights [T, k] float32 -> Σ_j weights[:, j] · expert_j(x), [T, H]."""
        tokens, top_k = expert_ids.shape
        flat = expert_ids.reshape(-1)
        order = flat.argsort(stable=True)
        grouped = x[order // top_k]  # one row per (token, expert) pair, grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        gate_up = self.gate_up_proj.weight.view(self.num_experts, 2 * self.intermediate_size, self.hidden_size)
        down = self.down_proj.weight.view(self.num_experts, self.hidden_size, self.intermediate_size)
        if self.kernel_for(x) == "grouped_mm":
            out = self._grouped_mm(grouped, counts, gate_up, down)
        else:
            out = self._plain(grouped, counts, gate_up, down)
        per_pair = torch.empty_like(out)
        per_pair[order] = out
        # the weighted sum in float32, then back to the activation dtype (as the official moe_infer)
        return (per_pair.view(tokens, top_k, -1).float() * weights[..., None]).sum(1).to(x.dtype)

    def _plain(self, grouped: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(grouped)
        start = 0
        for expert, count in enumerate(counts.tolist()):  # the host read of this kernel
            if count:
                rows = slice(start, start + count)
                gate, up = F.linear(grouped[rows], gate_up[expert]).split(self.intermediate_size, dim=-1)
                out[rows] = F.linear(F.silu(gate) * up, down[expert])
                start += count
        return out

    def _grouped_mm(self, grouped: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
        ends = counts.cumsum(0).to(torch.int32)
        gate, up = F.grouped_mm(grouped, gate_up.transpose(1, 2), offs=ends).split(self.intermediate_size, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=ends)


class SparseMoe(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.router = MoeRouter(hidden_size, moe)
        self.experts = GroupedExperts(hidden_size, moe.expert_intermediate_size, moe.num_experts)
        self.shared = (SwiGLU(hidden_size, moe.expert_intermediate_size * moe.num_shared_experts)
                       if moe.num_shared_experts > 0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        expert_ids, weights, _ = self.router.forward(flat)
        out = self.experts.forward(flat, expert_ids, weights)
        if self.shared is not None:
            out = out + self.shared.forward(flat)
        return out.view_as(x)
