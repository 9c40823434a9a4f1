"""The training recipe's settings (`cai-dllm train` flags take their defaults from here). No torch
import, so the command line can show the defaults at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tinymodels.tasks import DEFAULT_MIX, check_mix

OPTIMIZERS = ("adamw", "muon")
ARCHS = ("llada", "dream", "sdar", "llada2", "diffusion_gemma")


@dataclass(frozen=True)
class TrainConfig:
    # "llada", "dream", "sdar" (block diffusion, tinymodels/block_objective.py), "llada2" (block
    # diffusion, MoE, tinymodels/llada2_recipe.py) or "diffusion_gemma" (uniform-noise block
    # diffusion, tinymodels/dg_objective.py)
    arch: str = "llada"
    # The built-in models' recipe (docs/models.md). Depth mattered more than width: at a similar CPU
    # cost a step, 6 layers of 128 got 67 % of held-out additions right by step 3,880 where 4 layers
    # of 160 got none by step 4,000 (tinymodels/results/train_sweep_gpu.txt).
    d_model: int = 128
    layers: int = 6
    heads: int = 4
    kv_heads: Optional[int] = None  # Dream: grouped KV heads (default heads // 2)
    mlp_hidden: int = 384
    # The released models' RoPE bases (5e5, 1e6) are for head dims of 128 and long contexts; with a
    # head dim of ~40 they leave only two or three rotating frequencies over a 160-token sequence,
    # too few to tell positions apart: the model then learns which tokens a prompt holds but not
    # where. 1e4 spreads the frequencies over the lengths these tasks use.
    rope_theta: float = 10000.0
    gen_length: int = 128
    batch_size: int = 32
    steps: int = 8000
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 150
    weight_decay: float = 0.1
    seed: int = 0
    checkpoint_every: int = 250
    micro_batches: int = 2
    full_canvas_share: float = 0.25
    # A full canvas is drawn between gen_length and long_canvas tokens. A model answers nothing at
    # canvas lengths it has never seen, so the built-in models are trained with --long-canvas 256
    # to serve max_tokens up to 256 (docs/models.md).
    long_canvas: int = 128
    max_extra_fill: int = 32
    # Share of examples masked only after a random cut in the canvas (a response prefix stays
    # visible): the pattern a one-token-per-step decoder meets when it fills a chain left to right.
    prefix_mask_share: float = 0.0
    # Share of examples given the bare problem text as their prompt (what `/v1/completions` sends)
    # instead of the chat template: both forms are served, so both are trained.
    plain_prompt_share: float = 0.5
    optimizer: str = "adamw"  # or "muon" (tinymodels/optim.py)
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    # Start from this checkpoint's weights (same shapes) instead of random ones: a short look at a
    # new task mix on a model that knows the old one. The built-in models are trained from scratch.
    init_from: Optional[str] = None
    # SDAR: the training block (the block-causal attention's and the mask ratios' unit), written to
    # config.json as the checkpoint's block_size. The masked-diffusion formats ignore it. LLaDA2's
    # config has no block field, so an LLaDA2 model must be trained with the block the engine
    # decodes LLaDA2 with when a request names none (the official generate()'s 32).
    block_size: int = 8
    # DiffusionGemma (tinymodels/dg_objective.py, docs/models.md). `d_model`, `layers`, `heads`,
    # `kv_heads` (the sliding layers'), `mlp_hidden` (the dense MLP beside the experts, and the
    # self-conditioning MLP) and `rope_theta` (the sliding layers') carry over.
    canvas_length: int = 8
    sliding_window: int = 32
    full_every: int = 2  # every second layer is a full-attention layer (the last one always is)
    full_head_dim: int = 64  # the full layers' head dim; one KV head, values = keys (k_eq_v)
    experts: int = 4
    experts_per_token: int = 2
    expert_hidden: int = 96
    # Share of examples whose decoder pass is conditioned on a detached first pass's prediction
    # (the official recipe's self_cond_prob); the rest get no self-conditioning signal.
    self_conditioning_share: float = 0.5
    # Weight of the causal encoder's next-token loss on the clean sequence (official default 1.0).
    encoder_loss_weight: float = 1.0
    # LLaDA2 (tinymodels/llada2_recipe.py). `experts`, `experts_per_token` and `expert_hidden` (the
    # routed experts' and each shared expert's hidden size) carry over; `mlp_hidden` is the dense
    # first layers' MLP.
    shared_experts: int = 1
    dense_layers: int = 1  # first_k_dense_replace
    expert_groups: int = 1  # n_group: the router picks `expert_groups_per_token` groups, then experts in them
    expert_groups_per_token: int = 1  # topk_group
    # The routers' expert_bias is not trained by gradient: after each step it moves by this much
    # towards an even load (up for experts below the mean count, down above it), the auxiliary-loss-
    # free balancing that `moe_router_enable_expert_bias` names. 0 leaves the biases at 0.
    router_bias_rate: float = 1e-3
    # LLaDA2.1's token-to-token editing objective (tinymodels/block_objective.py): each visible
    # response position of a noisy block is replaced by a random ordinary token with this
    # probability, and the loss also covers every visible response position (restore what was
    # replaced, keep what was not), beside the masked positions' loss. 0: LLaDA2.0's objective.
    edit_noise: float = 0.0

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if min(self.canvas_length, self.full_every, self.experts, self.expert_hidden, self.full_head_dim) < 1:
            raise ValueError("canvas_length, full_every, experts, expert_hidden and full_head_dim must be positive")
        if self.sliding_window < 2:
            raise ValueError(f"sliding_window must be at least 2, got {self.sliding_window}")
        if not 1 <= self.experts_per_token <= self.experts:
            raise ValueError(f"experts_per_token must be in 1..experts, got {self.experts_per_token}")
        if not 0.0 <= self.self_conditioning_share <= 1.0:
            raise ValueError(f"self_conditioning_share must be in [0, 1], got {self.self_conditioning_share}")
        if not 1 <= self.micro_batches <= self.batch_size:
            raise ValueError(f"micro_batches must be in 1..batch_size, got {self.micro_batches}")
        if self.long_canvas < self.gen_length:
            raise ValueError(f"long_canvas ({self.long_canvas}) must be at least gen_length ({self.gen_length})")
        if not 0.0 <= self.prefix_mask_share <= 1.0:
            raise ValueError(f"prefix_mask_share must be in [0, 1], got {self.prefix_mask_share}")
        if not 0.0 <= self.plain_prompt_share <= 1.0:
            raise ValueError(f"plain_prompt_share must be in [0, 1], got {self.plain_prompt_share}")
        check_mix(self.mix)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if min(self.shared_experts, self.dense_layers) < 0 or self.expert_groups < 1:
            raise ValueError("shared_experts and dense_layers must be >= 0, expert_groups positive")
        if self.experts % self.expert_groups or not 1 <= self.expert_groups_per_token <= self.expert_groups:
            raise ValueError(f"expert_groups ({self.expert_groups}) must divide experts ({self.experts}) and "
                             f"expert_groups_per_token must be in 1..expert_groups, got {self.expert_groups_per_token}")
        if not 0.0 <= self.edit_noise < 1.0:
            raise ValueError(f"edit_noise must be in [0, 1), got {self.edit_noise}")
        if self.router_bias_rate < 0:
            raise ValueError(f"router_bias_rate must be >= 0, got {self.router_bias_rate}")
        if self.arch in ("diffusion_gemma", "llada2") and self.optimizer != "adamw":
            raise ValueError(f"the {self.arch} recipe trains with adamw only (its experts are stacked weights)")
