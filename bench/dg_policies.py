"""DiffusionGemma's official stopping rule (`dg-official`) against the convergence-aware policy
(`dg-converge`, engine/decoding/uniform.py) on a DiffusionGemma-format checkpoint: held-out exact
match where the checkpoint is a built-in task model (tinymodels' task family), decoder forwards per
generated token, and tokens/s at batch 1 and 8, both policies in the same run on the same prompts.

    PYTHONPATH=. python bench/dg_policies.py --model models/diffusiongemma-tiny --n 64 \
        --out bench/results/dg_policies.md

Without task data (`--prompts-only`, e.g. on the random fixture checkpoint) it reports forwards and
speed only. Generated tokens only are counted (a response up to its end token, at most max_tokens).
Time it on an idle machine: the figures are wall-clock.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from engine import DecodeParams, Engine, EngineConfig

POLICIES = ("dg-official", "dg-converge")


def _tasks(engine: Engine, model: str, n: int, seed: int) -> list[tuple[list[int], Any]]:
    """(chat prompt ids, problem) of the held-out split of the built-in task mix the model was trained
    on (as tinymodels/dg_evaluate.py asks them)."""
    from tinymodels.dg_evaluate import prompt_ids
    from tinymodels.evaluate import held_out_problems, model_mix

    problems = held_out_problems(n, seed, model_mix(model))
    return [(prompt_ids(engine.model, engine.tokenizer, p, "chat"), p) for p in problems]


def _run(engine: Engine, prompts: list[Any], policy: str, batch: int, max_tokens: int,
         seed: int) -> tuple[list[Any], float, int, int]:
    """Results, seconds, generated tokens and decoder forwards, `batch` requests at a time."""
    canvas = engine.model.canvas_length
    params = [DecodeParams(policy=policy, gen_length=-(-max_tokens // canvas) * canvas, seed=seed + i)
              for i in range(len(prompts))]
    results, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        results += engine.generate(prompts[i:i + batch], params[i:i + batch])
    seconds = time.perf_counter() - start
    tokens = sum(min(len(r.generated_ids), max_tokens) for r in results)
    forwards = sum(r.stats.nfe for r in results)
    return results, seconds, tokens, forwards


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prompts-only", action="store_true", help="random token-id prompts: no accuracy")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    engine = Engine(EngineConfig(model=args.model, max_batch=8, threads=args.threads))
    tasks = None if args.prompts_only else _tasks(engine, args.model, args.n, args.seed)
    rng = random.Random(args.seed)
    vocab = engine.vocab_size
    prompts: list[Any] = ([p for p, _ in tasks] if tasks else
                          [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 16))] for _ in range(args.n)])
    command = sys.argv[1:] if argv is None else argv
    lines = [f"# dg-official vs dg-converge on {args.model}", "",
             f"`PYTHONPATH=. python bench/dg_policies.py {' '.join(command)}`; {args.n} prompts, max_tokens "
             f"{args.max_tokens}, {torch.get_num_threads()} CPU threads, device {engine.model.device}", "",
             "| policy | batch | exact match | decoder forwards / token | tokens/s |",
             "| --- | --- | --- | --- | --- |"]
    for batch in (1, 8):
        for policy in POLICIES:
            results, seconds, tokens, forwards = _run(engine, prompts, policy, batch, args.max_tokens, args.seed)
            accuracy = "-"
            if tasks:
                from tinymodels.tasks import answer_of

                right = sum(answer_of(p.kind, r.text or "") == p.answer
                            for r, (_, p) in zip(results, tasks, strict=True))
                accuracy = f"{right / len(tasks):.1%}"
            # a forward serves every row of its batch: per row, nfe counts the forwards it took part in
            lines.append(f"| {policy} | {batch} | {accuracy} | {forwards / max(tokens, 1):.2f} | "
                         f"{tokens / seconds:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
