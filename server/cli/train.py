"""`cai-dllm train`: train a built-in tiny model on the task family."""

from __future__ import annotations

import argparse
from typing import Any

from server.cli.args import fail, task_mix


def add_parser(sub: Any) -> None:
    tr = sub.add_parser("train", help="train a built-in tiny model on the task family",
                        description="Flags left out take the built-in recipe: the defaults of "
                                    "tinymodels.train_config.TrainConfig (docs/models.md).")
    from tinymodels.tasks import format_mix
    from tinymodels.train_config import ARCHS, OPTIMIZERS, TrainConfig

    recipe = TrainConfig()
    train_flags: dict[str, tuple[type, str]] = {
        "arch": (str, "checkpoint format"), "d_model": (int, "hidden size"), "layers": (int, "decoder layers"),
        "heads": (int, "attention heads"), "mlp_hidden": (int, "MLP hidden size (diffusion_gemma: the dense MLP's)"),
        "rope_theta": (float, "RoPE base (the 8B models' bases are for head dims of 128)"),
        "batch_size": (int, "examples a step"), "steps": (int, "optimizer steps"), "lr": (float, "peak learning rate"),
        "warmup": (int, "warm-up steps"), "weight_decay": (float, "decoupled weight decay"),
        "optimizer": (str, "muon: Muon on the hidden weight matrices, AdamW on the rest"),
        "seed": (int, "examples, masks and initial weights"),
        "micro_batches": (int, "length-sorted groups per step, each its own canvas"),
        "full_canvas_share": (float, "share of groups given a full canvas"),
        "long_canvas": (int, "a full canvas is drawn from gen_length to this many tokens"),
        "max_extra_fill": (int, "most end tokens after the longest response"),
        "prefix_mask_share": (float, "share of examples masked only after a random cut in the canvas"),
        "plain_prompt_share": (float, "share of examples prompted with the bare problem text, not the chat template"),
        "init_from": (str, "start from this checkpoint's weights (same shapes) instead of random ones"),
        "block_size": (int, "sdar, llada2: the training block (llada2: the engine's LLaDA2 default, 32)"),
        "canvas_length": (int, "diffusion_gemma: the canvas (block) the decoder denoises"),
        "sliding_window": (int, "diffusion_gemma: the sliding layers' window"),
        "full_every": (int, "diffusion_gemma: every N-th layer is a full-attention layer (the last always is)"),
        "full_head_dim": (int, "diffusion_gemma: the full layers' head dim (one KV head, values = keys)"),
        "experts": (int, "diffusion_gemma, llada2: routed experts per layer"),
        "experts_per_token": (int, "diffusion_gemma, llada2: experts each token is routed to"),
        "expert_hidden": (int, "diffusion_gemma, llada2: each expert's hidden size"),
        "self_conditioning_share": (float, "diffusion_gemma: share of examples trained with self-conditioning"),
        "encoder_loss_weight": (float, "diffusion_gemma: weight of the encoder's next-token loss"),
        "shared_experts": (int, "llada2: always-on shared experts per MoE layer"),
        "dense_layers": (int, "llada2: first layers with a dense MLP (first_k_dense_replace)"),
        "expert_groups": (int, "llada2: expert groups of the router (n_group)"),
        "expert_groups_per_token": (int, "llada2: groups a token's experts are chosen from (topk_group)"),
        "router_bias_rate": (float, "llada2: step of the experts' load-balancing bias a training step"),
        "edit_noise": (float, "llada2: LLaDA2.1's editing objective, share of visible tokens made random"),
    }
    choices = {"arch": ARCHS, "optimizer": OPTIMIZERS}
    tr.add_argument("--out", required=True, help="the checkpoint directory to write")
    for name, (kind, text) in train_flags.items():
        tr.add_argument("--" + name.replace("_", "-"), type=kind, default=getattr(recipe, name), help=text,
                        choices=choices.get(name))
    tr.add_argument("--mix", type=task_mix, help=f"task kinds and their weights, KIND=WEIGHT,... "
                                                  f"(default: {format_mix(recipe.mix)})")
    tr.add_argument("--device", default="cpu", help="where the arithmetic runs (examples and masks are the same)")
    tr.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    tr.add_argument("--max-minutes", type=float, help="stop (and save) after this long (default: no limit)")
    tr.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    tr.add_argument("--snapshot", metavar="DEST",
                    help="only write the model of OUT's last saved training state to DEST (a mid-run look)")
    tr.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import fields
    from pathlib import Path

    import torch

    from tinymodels.train import TrainConfig, train

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.snapshot:
        from tinymodels.train import snapshot

        try:
            log = snapshot(Path(args.out), Path(args.snapshot))
        except FileNotFoundError as err:
            return fail(err)
        print(f"snapshot of step {log['step']} written to {args.snapshot}")
        return 0
    # flags left out keep TrainConfig's defaults, the built-in recipe (one place for them)
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)
                            if getattr(args, f.name, None) is not None})
    log = train(config, Path(args.out), resume=args.resume, max_minutes=args.max_minutes, device=args.device)
    last = log["losses"][-1][1] if log["losses"] else float("nan")
    print(f"trained {log['step']} steps in {log['seconds'] / 60:.1f} min; final loss {last:.4f}; saved to {args.out}")
    return 0
