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
from tinymodels.evaluate import EvalConfig, default_configs, dual_cache_refresh, evaluate, format_table, hardware
from tinymodels.tasks import sample

VALIDATION_SEED = 99_991


def candidates(architecture: str) -> list[EvalConfig]:
    base: dict[str, Any] = {"gen_length": 128, "block_length": 32, "steps": 128, "policy": "cai", "cache": "dual",
                            "refresh_interval": dual_cache_refresh(architecture)}
    tuned = {"grinding": False, "theta_s": 0.99, "theta_e": 0.9, "cache": "none"}  # the first round's best
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
            ("grinding off, theta_s .99 theta_e .9, no cache", tuned)]
    # second round, around the best of the first: more conservative thresholds, one CAI part off at a time
    rows += [("tuned, theta_s .995 theta_e .95", {**tuned, "theta_s": 0.995, "theta_e": 0.95}),
             ("tuned, theta_e .95", {**tuned, "theta_e": 0.95}),
             ("tuned, warmup 0.3", {**tuned, "warmup": 0.3}),
             ("tuned, position factors off", {**tuned, "position_factors": False}),
             ("tuned, block schedule off", {**tuned, "block_schedule": False}),
             ("tuned, budgets off", {**tuned, "budgets": False})]
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
    parser.add_argument("--only", help="';'-separated candidate names to run (default: all)")
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, device=args.device, max_batch=args.batch_size))
    problems = sample(args.n, VALIDATION_SEED, split="train")
    print(f"# {args.n} validation problems (training split, seed {VALIDATION_SEED}) on {hardware()}, "
          f"model {args.model}")
    rows = candidates(engine.architecture)
    if args.only:
        wanted = [name.strip() for name in args.only.split(";") if name.strip()]
        unknown = sorted(set(wanted) - {c.name for c in rows})
        if unknown:
            parser.error(f"unknown candidates {unknown}; known: {'; '.join(c.name for c in rows)}")
        rows = [c for c in rows if c.name in wanted]
    reports = evaluate(engine, problems, rows, batch_size=args.batch_size)
    print(format_table(reports))


if __name__ == "__main__":
    main()
