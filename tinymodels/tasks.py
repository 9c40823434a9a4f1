"""A task family with exact-match answers, for training and measuring the built-in models.

Four kinds, each a user instruction and a reference response:
- `add`: a+b with 1-4 digit operands, written zero-padded to 4 digits, and a worked chain, one
  column at a time from the right (digit + digit + carry = two-digit column sum, whose tens digit is
  the next carry), then the 5-digit sum: "0457+0038" -> "7+8+0=15;5+3+1=09;4+0+0=04;0+0+0=00;=00495";
- `affine`: x -> (a*x + b) mod m (m = 5 or 7) iterated k <= 9 times, each step labelled,
  e.g. "x=5 x->3x+2 mod 7 k=4" -> "x1=3,x2=4,x3=0,x4=2";
- `collatz`: the trajectory to 1, three digits a value (starts whose values stay below 300),
  e.g. "collatz 006" -> "003,010,005,016,008,004,002,001";
- `running`: the running total of labelled single digits, two digits a total,
  e.g. "sum a3 b5 c2 d7" -> "a03,b08,c10,d17".
In the chained kinds every value depends on the one before it, so later tokens can only be known
once earlier ones are committed; answer lengths range from a few characters to most of a
128-token canvas. Every field has a fixed width, so whatever a token depends on sits at a fixed
distance from it (or is found by its label): a model this small learns such lookups quickly, and
what is left to learn is the arithmetic.

Held-out split, by construction: a problem whose canonical key hashes to 0 mod 10 is never
generated for training (`split="train"`) and is the only kind generated for evaluation.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

KINDS = ("add", "affine", "collatz", "running")
DEFAULT_MIX = {"add": 0.35, "affine": 0.25, "collatz": 0.1, "running": 0.3}
HELD_OUT_MODULUS = 10
MAX_RESPONSE_CHARS = 110  # leaves room for the end token in a 128-token canvas
RUNNING_LABELS = "abcdefghij"
AFFINE_MODULI = (5, 7)
AFFINE_MAX_STEPS = 9  # one-digit step labels keep every step the same width
ADD_WIDTH = 4
COLLATZ_WIDTH = 3
RUNNING_WIDTH = 2
COLLATZ_MAX_VALUE = 300
COLLATZ_MAX_CHARS = 80


@dataclass(frozen=True)
class Problem:
    kind: str
    key: str  # canonical operands: what the held-out split hashes
    prompt: str
    response: str

    @property
    def answer(self) -> str:
        return answer_of(self.kind, self.response) or ""


def answer_of(kind: str, response: str) -> Optional[str]:
    """The part of a response that is graded: the sum for `add`, the whole sequence otherwise.
    None when the response does not parse."""
    text = response.strip()
    if kind == "add":
        if "=" not in text:
            return None
        value = text.rsplit("=", 1)[1]
        return value if value.isdigit() else None
    parts = text.split(",")
    if kind == "running":
        parts = [p[1:] for p in parts if p[:1].isalpha()] if all(p[:1].isalpha() for p in parts) else [""]
    if kind == "affine":
        parts = [p.partition("=")[2] if p.startswith("x") and "=" in p else "" for p in parts]
    return text if text and all(p.isdigit() for p in parts) else None


def is_held_out(kind: str, key: str) -> bool:
    digest = hashlib.sha256(f"{kind}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % HELD_OUT_MODULUS == 0


def _add(a: int, b: int) -> Problem:
    xs, ys = f"{a:0{ADD_WIDTH}d}"[::-1], f"{b:0{ADD_WIDTH}d}"[::-1]
    columns, carry = [], 0
    for x, y in zip(map(int, xs), map(int, ys), strict=True):
        total = x + y + carry
        columns.append(f"{x}+{y}+{carry}={total:02d}")
        carry = total // 10
    prompt = f"{a:0{ADD_WIDTH}d}+{b:0{ADD_WIDTH}d}"
    return Problem("add", f"{a}+{b}", prompt, ";".join(columns) + f";={a + b:0{ADD_WIDTH + 1}d}")


def collatz_trajectory(n: int) -> list[int]:
    out = []
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        out.append(n)
    return out


COLLATZ_STARTS = tuple(s for s in range(2, 200)
                       if len(collatz_trajectory(s)) * (COLLATZ_WIDTH + 1) - 1 <= COLLATZ_MAX_CHARS
                       and max(collatz_trajectory(s)) < COLLATZ_MAX_VALUE)


def make_problem(kind: str, rng: random.Random) -> Problem:
    if kind == "add":
        da, db = rng.randint(1, 4), rng.randint(1, 4)
        return _add(rng.randint(10 ** (da - 1) if da > 1 else 0, 10 ** da - 1),
                    rng.randint(10 ** (db - 1) if db > 1 else 0, 10 ** db - 1))
    if kind == "affine":
        m = rng.choice(AFFINE_MODULI)
        a, b, x, k = (rng.randint(1, m - 1), rng.randint(0, m - 1), rng.randint(0, m - 1),
                      rng.randint(3, AFFINE_MAX_STEPS))
        values, y = [], x
        for i in range(k):
            y = (a * y + b) % m
            values.append(f"x{i + 1}={y}")
        key = f"{x},{a},{b},{m},{k}"
        return Problem("affine", key, f"x={x} x->{a}x+{b} mod {m} k={k}", ",".join(values))
    if kind == "collatz":
        start = rng.choice(COLLATZ_STARTS)
        values = ",".join(f"{v:0{COLLATZ_WIDTH}d}" for v in collatz_trajectory(start))
        return Problem("collatz", str(start), f"collatz {start:0{COLLATZ_WIDTH}d}", values)
    if kind == "running":
        digits = [rng.randint(0, 9) for _ in range(rng.randint(3, len(RUNNING_LABELS)))]
        totals, running = [], 0
        for label, d in zip(RUNNING_LABELS, digits, strict=False):
            running += d
            totals.append(f"{label}{running:0{RUNNING_WIDTH}d}")
        key = "".join(map(str, digits))
        terms = " ".join(f"{label}{d}" for label, d in zip(RUNNING_LABELS, digits, strict=False))
        return Problem("running", key, f"sum {terms}", ",".join(totals))
    raise ValueError(f"unknown task kind {kind!r}; known: {', '.join(KINDS)}")


def problems(seed: int, split: str, mix: Optional[dict[str, float]] = None) -> Iterator[Problem]:
    """An endless, reproducible stream of problems of one split ("train" or "eval")."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    mix = mix or DEFAULT_MIX
    kinds: Sequence[str] = list(mix)
    weights = [mix[k] for k in kinds]
    rng = random.Random(f"{split}:{seed}")
    want_held_out = split == "eval"
    while True:
        kind = rng.choices(kinds, weights)[0]
        problem = make_problem(kind, rng)
        if is_held_out(problem.kind, problem.key) == want_held_out:
            yield problem


def sample(n: int, seed: int, split: str = "eval", mix: Optional[dict[str, float]] = None) -> list[Problem]:
    stream = problems(seed, split, mix)
    return [next(stream) for _ in range(n)]
