"""A task family with exact-match answers, for training and measuring the built-in models.

Three kinds, each a problem text and a reference response in which later tokens depend on earlier
ones:
- `add`: a+b, operands zero-padded to 5 digits, worked one column at a time from the right
  (digit + digit + carry = two-digit column sum, whose tens digit is the next carry), then the
  6-digit sum: "00457+00038" -> "7+8+0=15;5+3+1=09;4+0+0=04;0+0+0=00;0+0+0=00;=000495";
- `sub`: a-b with a >= b, the same shape with borrows: each column reads
  digit - digit - borrow = (next borrow)(result digit), then the 5-digit difference:
  "00457-00038" -> "7-8-0=19;5-3-1=01;4-0-0=04;0-0-0=00;0-0-0=00;=00419";
- `running`: the running total of 6-14 labelled single digits, each item the label, the digit
  (copied from the prompt) and the three-digit total so far,
  e.g. "sum a3 b5 c2 d7 e0 f9" -> "a3=003,b5=008,c2=010,d7=017,e0=017,f9=026".
  Copying the digit next to its total makes every total a sum of two numbers at fixed distances
  (the previous total, the digit), as the columns of `add` are: with the total alone, a model of
  this size had 0 % of running totals right after 3,500 steps (docs/models.md).
Difficulty is graded: the longer operand of `add`/`sub` has 1-5 significant digits, `running` has
6-14 terms. Answers run from 41 to 97 characters, a third of the 128-token canvas to most of it.
Every field has a fixed width, so whatever a token depends on sits at a fixed distance from it (or
is found by its label): what a small model has to learn is the arithmetic.

Splits, by construction: a problem's canonical key hashes to a bucket 0-9; bucket 0 is the held-out
evaluation split, bucket 1 the validation split (for calibrating decoding knobs, `cai-dllm
calibrate`), the rest is training. A stream of one split never yields a problem of another.
The independent grader is `tinymodels.checker`, which works from the problem text alone.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

KINDS = ("add", "sub", "running")
DEFAULT_MIX = {"add": 0.35, "sub": 0.35, "running": 0.3}
SPLITS = ("train", "validation", "eval")
SPLIT_BUCKETS = 10
_BUCKET_SPLIT = {0: "eval", 1: "validation"}
WIDTH = 5  # add/sub operand digits
MAX_LEVEL = WIDTH  # significant digits of the longer operand
RUNNING_LABELS = "abcdefghijklmn"
RUNNING_MIN_TERMS = 6
RUNNING_WIDTH = 3
MAX_RESPONSE_CHARS = 110  # leaves room for the end token in a 128-token canvas


@dataclass(frozen=True)
class Problem:
    kind: str
    key: str  # canonical operands: what the split hashes
    prompt: str
    response: str

    @property
    def answer(self) -> str:
        return answer_of(self.kind, self.response) or ""


def answer_of(kind: str, response: str) -> Optional[str]:
    """The part of a response that is graded: the result for `add`/`sub`, the whole sequence of
    totals for `running`. None when the response does not parse."""
    text = response.strip()
    if kind in ("add", "sub"):
        if "=" not in text:
            return None
        value = text.rsplit("=", 1)[1]
        return value if value.isdigit() else None
    if kind == "running":
        parts = text.split(",")
        ok = bool(text) and all(len(p) > 3 and p[0].isalpha() and p[1].isdigit() and p[2] == "="
                                and p[3:].isdigit() for p in parts)
        return text if ok else None
    raise ValueError(f"unknown task kind {kind!r}; known: {', '.join(KINDS)}")


def split_of(kind: str, key: str) -> str:
    digest = hashlib.sha256(f"{kind}:{key}".encode()).digest()
    return _BUCKET_SPLIT.get(int.from_bytes(digest[:8], "little") % SPLIT_BUCKETS, "train")


def is_held_out(kind: str, key: str) -> bool:
    return split_of(kind, key) == "eval"


def _columns(a: int, b: int) -> tuple[list[int], list[int]]:
    """Both operands' digits, units first."""
    return list(map(int, f"{a:0{WIDTH}d}"[::-1])), list(map(int, f"{b:0{WIDTH}d}"[::-1]))


def add_problem(a: int, b: int) -> Problem:
    xs, ys = _columns(a, b)
    columns, carry = [], 0
    for x, y in zip(xs, ys, strict=True):
        total = x + y + carry
        columns.append(f"{x}+{y}+{carry}={total:02d}")
        carry = total // 10
    prompt = f"{a:0{WIDTH}d}+{b:0{WIDTH}d}"
    return Problem("add", f"{a}+{b}", prompt, ";".join(columns) + f";={a + b:0{WIDTH + 1}d}")


def sub_problem(a: int, b: int) -> Problem:
    if a < b:
        raise ValueError(f"sub needs a >= b, got {a}-{b}")
    xs, ys = _columns(a, b)
    columns, borrow = [], 0
    for x, y in zip(xs, ys, strict=True):
        digit = x - y - borrow
        next_borrow = int(digit < 0)
        columns.append(f"{x}-{y}-{borrow}={next_borrow}{digit % 10}")
        borrow = next_borrow
    prompt = f"{a:0{WIDTH}d}-{b:0{WIDTH}d}"
    return Problem("sub", f"{a}-{b}", prompt, ";".join(columns) + f";={a - b:0{WIDTH}d}")


def running_problem(digits: Sequence[int]) -> Problem:
    if not RUNNING_MIN_TERMS <= len(digits) <= len(RUNNING_LABELS):
        raise ValueError(f"running needs {RUNNING_MIN_TERMS}-{len(RUNNING_LABELS)} terms, got {len(digits)}")
    totals, running = [], 0
    for label, d in zip(RUNNING_LABELS, digits, strict=False):
        running += d
        totals.append(f"{label}{d}={running:0{RUNNING_WIDTH}d}")
    terms = " ".join(f"{label}{d}" for label, d in zip(RUNNING_LABELS, digits, strict=False))
    return Problem("running", "".join(map(str, digits)), f"sum {terms}", ",".join(totals))


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1)


def make_problem(kind: str, rng: random.Random) -> Problem:
    if kind in ("add", "sub"):
        level = rng.randint(1, MAX_LEVEL)
        a, b = _operand(rng, level), _operand(rng, rng.randint(1, level))
        if rng.random() < 0.5:
            a, b = b, a
        if kind == "add":
            return add_problem(a, b)
        return sub_problem(max(a, b), min(a, b))
    if kind == "running":
        count = rng.randint(RUNNING_MIN_TERMS, len(RUNNING_LABELS))
        return running_problem([rng.randint(0, 9) for _ in range(count)])
    raise ValueError(f"unknown task kind {kind!r}; known: {', '.join(KINDS)}")


def problems(seed: int, split: str, mix: Optional[dict[str, float]] = None) -> Iterator[Problem]:
    """An endless, reproducible stream of problems of one split ("train", "validation" or "eval")."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    mix = mix or DEFAULT_MIX
    kinds: Sequence[str] = list(mix)
    weights = [mix[k] for k in kinds]
    rng = random.Random(f"{split}:{seed}")
    while True:
        kind = rng.choices(kinds, weights)[0]
        problem = make_problem(kind, rng)
        if split_of(problem.kind, problem.key) == split:
            yield problem


def sample(n: int, seed: int, split: str = "eval", mix: Optional[dict[str, float]] = None) -> list[Problem]:
    stream = problems(seed, split, mix)
    return [next(stream) for _ in range(n)]
