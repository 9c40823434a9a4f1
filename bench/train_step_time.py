"""CPU cost of one training step for several model shapes (what sized the built-in models' recipe).

Each shape runs 16 steps of the real training step (examples, masks, two micro-batches, AdamW) on
the configured threads; the mean of the last 12 is reported with the steps that fit in 45 minutes.

    python bench/train_step_time.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.builtin.train import (
    TrainConfig,
    build_model,
    encode_examples,
    masked_diffusion_loss,
    micro_batches,
    step_examples,
)

SHAPES = [("llada", 160, 4, 448), ("llada", 128, 6, 384), ("llada", 128, 8, 384), ("llada", 96, 8, 288),
          ("llada", 96, 10, 288), ("llada", 112, 8, 320), ("dream", 128, 6, 384)]
WARMUP, TIMED = 4, 12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for arch, d_model, layers, mlp in SHAPES:
        config = TrainConfig(arch=arch, d_model=d_model, layers=layers, mlp_hidden=mlp)
        model, _ = build_model(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
        seconds = 0.0
        for step in range(WARMUP + TIMED):
            started = time.perf_counter()
            generator = torch.Generator().manual_seed(step)
            optimizer.zero_grad()
            for examples, canvas_length in micro_batches(config, step_examples(config, step), generator):
                ids, attention, canvas = encode_examples(examples, canvas_length)
                part = masked_diffusion_loss(model, ids, attention, canvas, generator, config.gen_length)
                (part * len(examples) / config.batch_size).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if step >= WARMUP:
                seconds += time.perf_counter() - started
        per_step = seconds / TIMED
        params = sum(p.numel() for p in model.parameters())
        print(f"{arch} d{d_model} L{layers} mlp{mlp}: {1000 * per_step:.0f} ms/step, {params / 1e6:.2f}M params "
              f"-> {45 * 60 / per_step:.0f} steps in 45 min", flush=True)


if __name__ == "__main__":
    main()
