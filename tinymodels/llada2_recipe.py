"""The LLaDA2-format built-in model's pieces of the training recipe: its config from the training
settings and the routers' load balancing (the objective is SDAR's block diffusion,
tinymodels/block_objective.py, with LLaDA2.1's editing objective as an option; the initial weights,
the optimizer and the loop are tinymodels/train.py's).

The model is LLaDA2's architecture at tiny sizes: fused q|k|v with QK-norm, RoPE on half of each
head, the first `dense_layers` layers a dense SwiGLU MLP and the rest a mixture of experts (routed
experts behind LLaDA2's group-limited sigmoid router, plus always-on shared experts), untied head.
LLaDA2's released config has no block field (its decoders take blocks of 32, the engine's default
for the family); a model trained with another block states it as `block_size`, which the engine
reads (engine/models/llada2.py), and the official code takes as `generate(block_length=...)`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from engine.models.moe import MoeRouter
from engine.models.registry import FAMILIES
from tinymodels import char_tokenizer as chars
from tinymodels.formats import llada2_config
from tinymodels.train_config import TrainConfig

RouterOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_GROUP_SCORE_EXPERTS = 2  # the official router scores a group by its best two experts


def stated_block(config: TrainConfig) -> Optional[int]:
    """The block the config states: none for the family's default block (the released field set),
    else the trained one."""
    return None if config.block_size == FAMILIES["llada2"].default_block else config.block_size


def hf_config(config: TrainConfig) -> dict[str, Any]:
    if config.experts // config.expert_groups < _GROUP_SCORE_EXPERTS:
        raise ValueError(f"each of the {config.expert_groups} expert groups needs at least "
                         f"{_GROUP_SCORE_EXPERTS} experts (the router scores a group by its best two)")
    return llada2_config(
        config.d_model, config.layers, config.heads, config.kv_heads or max(1, config.heads // 2),
        config.d_model // config.heads, config.mlp_hidden, len(chars.vocabulary()), chars.special_id(chars.END),
        config.experts, config.experts_per_token, config.expert_hidden, config.shared_experts, config.dense_layers,
        config.expert_groups, config.expert_groups_per_token, rope_theta=config.rope_theta,
        block_size=stated_block(config))


def edit_vocabulary() -> int:
    """Random tokens of the editing objective are drawn from ids [0, this): the ordinary characters
    (the special tokens follow them in the character vocabulary)."""
    return len(chars.CHARS)


class ExpertLoad:
    """Counts each router's choices over one optimizer step's forwards, then moves every router's
    expert_bias by `rate` towards an even load: +rate for an expert chosen fewer times than the
    layer's mean, -rate for one chosen more (auxiliary-loss-free balancing, the update rule of the
    expert-bias routers LLaDA2's `moe_router_enable_expert_bias` names). A bias only changes which
    experts are chosen, never a routing weight, so it has no gradient."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, MoeRouter)]
        self.counts = [torch.zeros(r.moe.num_experts) for r in self.routers]
        # the layers call `router.forward` directly (no module hooks run), so each router's forward
        # is wrapped on the instance for the step and unwrapped by `update_biases`
        for index, router in enumerate(self.routers):
            router.forward = self._counting(index, router.forward)  # type: ignore[method-assign]

    def _counting(self, index: int, route: Callable[[torch.Tensor], RouterOutput]) -> Callable[..., RouterOutput]:
        def forward(x: torch.Tensor) -> RouterOutput:
            out = route(x)
            chosen = out[0].reshape(-1).detach().cpu()
            self.counts[index] += torch.bincount(chosen, minlength=self.counts[index].numel()).float()
            return out
        return forward

    @torch.no_grad()
    def update_biases(self, rate: float) -> None:
        """Apply the step's update and stop counting."""
        for router, counts in zip(self.routers, self.counts, strict=True):
            router.expert_bias += rate * torch.sign(counts.mean() - counts).to(router.expert_bias)
            del router.forward  # the class's forward again
