"""Writes the multiple-choice items the lm-eval task `cai_builtin_add_mc` reads:
`python bench/lm_eval/make_mc_data.py [N] [SEED]`.

Each item is a held-out addition of the built-in task family (the problems `cai-dllm eval` draws,
additions only) with four worked answers: the right one and three corrupted ones, each with one
digit changed (a column's digit or the sum's), at three different places. A model that scores
likelihoods well picks the right one; chance is 25 %."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from tinymodels.tasks import sample

HERE = Path(__file__).resolve().parent
CHOICES = 4


def corrupted(response: str, rng: random.Random, count: int) -> list[str]:
    """`count` copies of `response`, each with one digit replaced, at distinct positions."""
    digits = [i for i, ch in enumerate(response) if ch.isdigit()]
    out = []
    for i in rng.sample(digits, count):
        wrong = rng.choice([d for d in "0123456789" if d != response[i]])
        out.append(response[:i] + wrong + response[i + 1:])
    return out


def items(n: int, seed: int) -> list[dict]:
    rng = random.Random(f"mc:{seed}")
    rows = []
    for problem in sample(n, seed, split="eval", mix={"add": 1.0}):
        choices = [problem.response, *corrupted(problem.response, rng, CHOICES - 1)]
        rng.shuffle(choices)
        rows.append({"prompt": problem.prompt, "choices": choices, "label": choices.index(problem.response)})
    return rows


def main(n: int = 40, seed: int = 0) -> Path:
    out = HERE / f"add_mc_n{n}_seed{seed}.jsonl"
    out.write_text("".join(json.dumps(row) + "\n" for row in items(n, seed)))
    return out


if __name__ == "__main__":
    print(main(*map(int, sys.argv[1:3])))
