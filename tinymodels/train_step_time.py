"""CPU cost of one training step for several model shapes (what sized the built-in models' recipe).

Each shape runs 16 steps of the real training step (`tinymodels.train.train_step`) on
the configured threads; the mean of the last 12 is reported with the steps that fit in 45 minutes.

    python -m tinymodels.train_step_time --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from tinymodels.train import TrainConfig, build_model, make_optimizer, train_step

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
        optimizer = make_optimizer(model, config)
        seconds = 0.0
        for step in range(WARMUP + TIMED):
            started = time.perf_counter()
            train_step(model, optimizer, config, step)
            if step >= WARMUP:
                seconds += time.perf_counter() - started
        per_step = seconds / TIMED
        params = sum(p.numel() for p in model.parameters())
        print(f"{arch} d{d_model} L{layers} mlp{mlp}: {1000 * per_step:.0f} ms/step, {params / 1e6:.2f}M params "
              f"-> {45 * 60 / per_step:.0f} steps in 45 min", flush=True)


if __name__ == "__main__":
    main()
