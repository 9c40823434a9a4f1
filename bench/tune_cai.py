"""Tune CAI's knobs on a validation split, never on the held-out problems the benchmark reports.

Validation problems are drawn from the *training* split with a seed training never uses for a
whole batch (disjoint from the held-out split by construction: a problem's split is a hash of its
operands). Each candidate is full CAI (dual cache, early exit) with some knobs changed; the table
is what picks the "tuned" row of docs/benchmarks.md, which is then run once on the held-out set.

    python bench/tune_cai.py --model models/llada-tiny --n 500
"""

from __future__ import annotations

import argparse
from typing import Any

from engine import Engine, EngineConfig
from engine.builtin.evaluate import EvalConfig, default_configs, dual_cache_refresh, evaluate, format_table, hardware
from engine.builtin.tasks import sample

VALIDATION_SEED = 99_991


def candidates(architecture: str) -> list[EvalConfig]:
    base: dict[str, Any] = {"gen_length": 128, "block_length": 32, "steps": 128, "policy": "cai", "cache": "dual",
                            "refresh_interval": dual_cache_refresh(architecture)}
    rows = [("paper defaults", {}),
            ("gate off", {"gating": False}),
            ("budgets off", {"budgets": False}),
            ("grinding off", {"grinding": False}),
            ("budgets+grinding off", {"budgets": False, "grinding": False}),
            ("theta_s 0.95", {"theta_s": 0.95}),
            ("theta_s 0.95 theta_e 0.8", {"theta_s": 0.95, "theta_e": 0.8}),
            ("theta_s 0.95 theta_e 0.8 budgets off", {"theta_s": 0.95, "theta_e": 0.8, "budgets": False}),
            ("theta_fb 0.6", {"theta_fb": 0.6}),
            ("grinding off, theta_s .99 theta_e .9", {"grinding": False, "theta_s": 0.99, "theta_e": 0.9}),
            ("grinding off, no cache", {"grinding": False, "cache": "none"}),
            ("grinding off, theta_s .99 theta_e .9, no cache", {"grinding": False, "theta_s": 0.99, "theta_e": 0.9,
                                                                 "cache": "none"})]
    benchmark = {c.name: c for c in default_configs(architecture)}
    references = [EvalConfig(f"{label} (reference)", benchmark[name].params)
                  for label, name in (("fixed+exit", "fixed+exit"), ("Fast-dLLM", "threshold 0.9 dual (Fast-dLLM)"))]
    return [EvalConfig(name, {**base, **knobs}) for name, knobs in rows] + references


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, device=args.device, max_batch=args.batch_size))
    problems = sample(args.n, VALIDATION_SEED, split="train")
    print(f"# {args.n} validation problems (training split, seed {VALIDATION_SEED}) on {hardware()}, "
          f"model {args.model}")
    reports = evaluate(engine, problems, candidates(engine.architecture), batch_size=args.batch_size)
    print(format_table(reports))


if __name__ == "__main__":
    main()
