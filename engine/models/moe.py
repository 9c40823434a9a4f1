"""LLaDA2's mixture-of-experts MLP: a group-limited sigmoid router, routed experts computed over all
routed tokens at once (grouped by expert), and an always-on shared expert.

Router (float32, as the official `LLaDA2MoeGate`): s = sigmoid(x·Wgᵀ); the *choice* uses s +
expert_bias: a group's score is the sum of its two best biased scores, the `topk_group` best groups
stay eligible, and the top `experts_per_token` eligible experts are taken. The *weights* are the
unbiased s of the chosen experts, renormalised and scaled by `routed_scaling_factor`.

Experts: the (token, expert) pairs are sorted by expert, so each expert runs one matmul over its
tokens. Two kernels compute that: `plain` (one matmul pair per expert with tokens; it reads the
per-expert counts on the host, once per MoE layer) and `grouped_mm` (torch's grouped GEMM over the
jagged groups: no host read), taken automatically where PyTorch documents it (CUDA, bf16) and inside
a compiled or captured forward (which cannot read the host), where the weights' dtype and strides
allow it. Where they do not (float32, which torch's grouped GEMM does not compile), a compiled
forward takes `dense`: every expert over every token, each pair's output picked after; no host read
and fixed shapes, at experts / experts_per_token times the expert FLOPs, so it pays only for models
with few experts (the built-in ones).
Quantized experts (`--quantization`) are one quantized linear pair per expert, run as `plain` runs
its matmuls: neither quantization library has a grouped kernel over stacked weights.

Expert parallelism: on a tensor-parallel rank the router runs whole (it is small, and every rank
must route alike), the rank holds an even, contiguous share of the routed experts and computes
only the (token, expert) pairs routed to them, the shared expert is split like a dense MLP, and
one all-reduce sums the routed and shared terms of every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import MoeConfig
from engine.models.layers import FusedLinear, SwiGLU
from engine.models.parallel.group import SINGLE, TensorParallel

MOE_KERNELS = ("plain", "grouped_mm", "dense")
_QUANTIZED_KERNEL = "quantized"  # one quantized linear pair per expert (GroupedExperts.quantize)
# The official router divides by (sum of chosen scores + this) when it picks more than one expert.
_WEIGHT_SUM_GUARD = 1e-20
# A group's score is the sum of its best two biased expert scores (fixed in the official router).
_GROUP_SCORE_TOP = 2


def expert_counts(flat_ids: torch.Tensor, groups: int) -> torch.Tensor:
    """How many (token, expert) pairs each of `groups` experts has, [groups] long. As
    `bincount(minlength=groups)`, which on CUDA reads the largest id back to size its output and so
    waits for the stream; the ids here are known to lie below `groups`."""
    counts = torch.zeros(groups, dtype=torch.long, device=flat_ids.device)
    return counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))


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


class ExpertMLP(nn.Module):
    """One routed expert's SwiGLU weights as two linear layers, the form a quantization library takes."""

    def __init__(self, gate_up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = gate_up
        self.down_proj = down


class GroupedExperts(nn.Module):
    """The routed experts this rank holds (all of them on one device): expert e computes
    gate|up = x·Wgu[e]ᵀ (gate rows first), out = (activation(gate)·up)·Wd[e]ᵀ, with `activation`
    SiLU (LLaDA2's SwiGLU) or tanh-GELU (Gemma4). The weights are stacked in one of two layouts, as
    the checkpoint holds them:
    - one tensor per expert (LLaDA2): fused linears, gate|up rows of local expert e at
      [e·2I, (e+1)·2I), down rows at [e·H, (e+1)·H); the shard names are the global expert ids
      (`{e}.gate`, `{e}`), so the loader fills this rank's experts and skips the others'
      (`engine.models.parallel.sharding`); quantized through `quantize`;
    - `stacked` (Gemma4): the checkpoint's two 3-D tensors `gate_up_proj` [E, 2I, H] and
      `down_proj` [E, H, I], the same memory order (a rank reads its experts' rows of the first
      dimension); they stay in the model dtype under quantization."""

    # quantization (engine.quantization) goes through `quantize`, which splits the stacked weights
    # into one linear pair per expert: neither library's weight can be viewed as [experts, rows, cols]
    quantizes_itself = True

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, first: int = 0,
                 count: Optional[int] = None, activation: Callable[[torch.Tensor], torch.Tensor] = F.silu,
                 stacked: bool = False) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts  # routed experts of the whole model
        self.first = first  # this rank's experts: global ids [first, first + local)
        self.local = num_experts if count is None else count
        self.activation = activation
        self.gate_up_proj: Optional[nn.Module | nn.Parameter]
        self.down_proj: Optional[nn.Module | nn.Parameter]
        if stacked:
            self.quantizes_itself = False
            self.gate_up_proj = nn.Parameter(torch.empty(self.local, 2 * intermediate_size, hidden_size))
            self.down_proj = nn.Parameter(torch.empty(self.local, hidden_size, intermediate_size))
            self.tp_split = "experts"  # the stacked tensors' rows [first, first + local) (sharding.source_slices)
        else:
            ids = range(first, first + self.local)
            self.gate_up_proj = FusedLinear(
                hidden_size, {f"{e}.{part}": intermediate_size for e in ids for part in ("gate", "up")}, bias=False)
            self.down_proj = FusedLinear(intermediate_size, {str(e): hidden_size for e in ids}, bias=False)
            self.gate_up_proj.tp_split = self.down_proj.tp_split = "experts"
        self.quantized: Optional[nn.ModuleList] = None  # ExpertMLP per local expert, once quantized
        self.kernel: Optional[str] = None  # None: grouped_mm where PyTorch documents it, else plain

    def expert_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(out, in) of one expert's gate|up and down linear layers."""
        return (2 * self.intermediate_size, self.hidden_size), (self.hidden_size, self.intermediate_size)

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """gate|up [local, 2I, H] and down [local, H, I], views of the float weights (either layout)."""
        gate_up, down = self.gate_up_proj, self.down_proj
        assert gate_up is not None and down is not None, "quantized: no float weights left"
        if isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter):
            return gate_up, down
        return (gate_up.weight.view(self.local, *self.expert_shapes()[0]),
                down.weight.view(self.local, *self.expert_shapes()[1]))

    def quantize(self, convert: Callable[[nn.Linear], nn.Module]) -> None:
        """Replace the stacked float weights with one `convert`ed linear pair per expert."""
        gate_up, down = (w.data for w in self.stacked_weights())
        experts = []
        for e in range(self.local):
            pair = []
            for weight in (gate_up[e], down[e]):
                linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
                linear.weight = nn.Parameter(weight.clone(), requires_grad=False)
                pair.append(convert(linear))
            experts.append(ExpertMLP(*pair))
        self.gate_up_proj = self.down_proj = None  # frees the stacked float weights
        self.quantized = nn.ModuleList(experts)

    @property
    def static(self) -> bool:
        """Whether a captured forward can run these experts at their cost: by `grouped_mm` (no host
        read), which takes bfloat16 weights whose strides it allows."""
        if self.quantized is not None:
            return False
        weight = self.stacked_weights()[0]
        return weight.dtype == torch.bfloat16 and _grouped_mm_fits(weight, (self.hidden_size, self.intermediate_size))

    @property
    def compiles(self) -> bool:
        """Whether a compiled forward can run these experts: by `grouped_mm` or `dense` (float weights)."""
        return self.quantized is None

    def kernel_for(self, x: torch.Tensor) -> str:
        if self.quantized is not None:
            return _QUANTIZED_KERNEL
        if self.kernel is not None:
            return self.kernel
        # a compiled or captured forward (engine.static_forward) cannot read the counts on the host
        if torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return "grouped_mm" if self.static else "dense"
        on_documented_device = (x.is_cuda and x.dtype == torch.bfloat16
                                and torch.cuda.get_device_capability(x.device) >= (8, 0))
        if on_documented_device and _grouped_mm_fits(x, (self.hidden_size, self.intermediate_size)):
            return "grouped_mm"
        return "plain"

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], expert_ids [T, k] (global), weights [T, k] float32 -> Σ_j weights[:, j] · expert_j(x)
        over the pairs whose expert this rank holds, [T, H]."""
        top_k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        elsewhere = None
        if self.local < self.num_experts:  # pairs of other ranks' experts go to a last group, never run
            flat = flat - self.first
            elsewhere = (flat < 0) | (flat >= self.local)
            flat = flat.masked_fill(elsewhere, self.local)
        kernel = self.kernel_for(x)
        if kernel == "dense":
            return self._weighted_sum(self._dense(x, flat, top_k, elsewhere), weights, x.dtype)
        order = flat.argsort(stable=True)
        grouped = x[order // top_k]  # one row per (token, expert) pair, grouped by expert
        counts = expert_counts(flat, self.local if elsewhere is None else self.local + 1)  # + the never-run group
        if kernel == _QUANTIZED_KERNEL:
            out = self._quantized(grouped, counts)
        else:
            gate_up, down = self.stacked_weights()
            if kernel == "grouped_mm":
                out = self._grouped_mm(grouped, counts[:self.local], gate_up, down)
            else:
                out = self._plain(grouped, counts, gate_up, down)
        if elsewhere is not None:  # rows no expert of this rank computed: their term is another rank's
            out = out.masked_fill(elsewhere[order][:, None], 0)
        per_pair = torch.empty_like(out)
        per_pair[order] = out
        return self._weighted_sum(per_pair, weights, x.dtype)

    @staticmethod
    def _weighted_sum(per_pair: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Σ_j weights[:, j] · per_pair of (token, j) ([T·k, H], token-major): in float32, then back to
        the activation dtype (as the official moe_infer)."""
        tokens, top_k = weights.shape
        return (per_pair.view(tokens, top_k, -1).float() * weights[..., None]).sum(1).to(dtype)

    def _dense(self, x: torch.Tensor, flat: torch.Tensor, top_k: int,
               elsewhere: Optional[torch.Tensor]) -> torch.Tensor:
        """Every local expert over every token ([local, T, H]), then each (token, expert) pair's row,
        [T·k, H] token-major; a pair of another rank's expert (`elsewhere`) is zero."""
        gate_up, down = self.stacked_weights()
        gate, up = torch.matmul(x, gate_up.transpose(1, 2)).split(self.intermediate_size, dim=-1)
        every = torch.matmul(self.activation(gate) * up, down.transpose(1, 2))
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(top_k)
        per_pair = every[flat.clamp(max=self.local - 1), token]
        return per_pair if elsewhere is None else per_pair.masked_fill(elsewhere[:, None], 0)

    def _plain(self, grouped: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(grouped)
        start = 0
        for expert, count in enumerate(counts.tolist()[:self.local]):  # the host read of this kernel
            if count:
                rows = slice(start, start + count)
                gate, up = F.linear(grouped[rows], gate_up[expert]).split(self.intermediate_size, dim=-1)
                out[rows] = F.linear(self.activation(gate) * up, down[expert])
                start += count
        return out

    def _quantized(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        assert self.quantized is not None
        out = torch.empty_like(grouped)
        start = 0
        for expert, count in enumerate(counts.tolist()[:self.local]):  # the host read of this kernel
            if count:
                rows = slice(start, start + count)
                pair = self.quantized[expert]
                gate, up = pair.gate_up_proj.forward(grouped[rows]).split(self.intermediate_size, dim=-1)
                out[rows] = pair.down_proj.forward(self.activation(gate) * up)
                start += count
        return out

    def _grouped_mm(self, grouped: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
        ends = counts.cumsum(0).to(torch.int32)
        gate, up = F.grouped_mm(grouped, gate_up.transpose(1, 2), offs=ends).split(self.intermediate_size, dim=-1)
        return F.grouped_mm(self.activation(gate) * up, down.transpose(1, 2), offs=ends)


class SparseMoe(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.router = MoeRouter(hidden_size, moe)
        first, count = tp.split(moe.num_experts)
        self.experts = GroupedExperts(hidden_size, moe.expert_intermediate_size, moe.num_experts, first, count)
        self.shared = (SwiGLU(hidden_size, moe.expert_intermediate_size * moe.num_shared_experts, tp)
                       if moe.num_shared_experts > 0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        expert_ids, weights, _ = self.router.forward(flat)
        out = self.experts.forward(flat, expert_ids, weights)
        if self.shared is not None:
            out = out + self.shared.partial(flat)
        return self.tp.all_reduce(out).view_as(x)  # every rank's routed and shared terms, one collective
