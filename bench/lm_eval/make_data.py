"""Writes the held-out problems the lm-eval task reads: `python bench/lm_eval/make_data.py [N] [SEED]`.

The same problems `cai-dllm eval --n N --seed SEED` draws, one JSON object per line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tinymodels.evaluate import held_out_problems

HERE = Path(__file__).resolve().parent


def main(n: int = 100, seed: int = 0) -> Path:
    out = HERE / f"heldout_n{n}_seed{seed}.jsonl"
    rows = [{"prompt": p.prompt, "answer": p.answer, "kind": p.kind} for p in held_out_problems(n, seed)]
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


if __name__ == "__main__":
    print(main(*map(int, sys.argv[1:3])))
