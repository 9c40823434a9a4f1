"""The training recipe's settings (`cai-dllm train` flags take their defaults from here). No torch
import, so the command line can show the defaults at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tinymodels.tasks import DEFAULT_MIX, check_mix

OPTIMIZERS = ("adamw", "muon")
ARCHS = ("llada", "dream", "sdar")


@dataclass(frozen=True)
class TrainConfig:
    arch: str = "llada"  # "llada", "dream" or "sdar" (block diffusion, tinymodels/block_objective.py)
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
    # config.json as the checkpoint's block_size. The masked-diffusion formats ignore it.
    block_size: int = 8

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
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
