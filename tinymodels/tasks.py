"""A task family with exact-match answers, for training and measuring the built-in models.

Four kinds, each a problem text and a reference response in which later tokens depend on earlier
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
- `swap`: five letters and 4-10 labelled swaps of two positions (1-5), each item the label and the
  swap (copied from the prompt) and the letters after it, e.g. "swap cabed A13 B24 C35 D12" ->
  "A13=baced,B24=becad,C35=bedac,D12=ebdac". Given the item before it, an item is a copy with two
  letters exchanged, found by its label as a running total's digit is; but read from the prompt
  alone the k-th item is k swaps composed, and composing permutations of five things is the
  textbook sequential computation that, unlike a sum, does not flatten into a few layers. So at a
  block's first denoising step the items after the first few are genuinely uncertain and become
  certain as the items before them are committed: the uneven first-step confidence of a reasoning
  chain that CAI is built for (the paper's Figure 1c). Sums and running totals are sums, which a
  model this size learns to compute in one pass: 1.2 % of their answer tokens start below 0.5
  confidence (docs/models.md).
Difficulty is graded: the longer operand of `add`/`sub` has 1-5 significant digits, `running` has
6-14 terms, `swap` 4-10 swaps. Answers run from 39 to 99 characters, a quarter of the 128-token
canvas to most of it.
Every field has a fixed width, so whatever a token depends on sits at a fixed distance from it (or
is found by its label): what a small model has to learn is the arithmetic and the swaps.

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

KINDS = ("add", "sub", "running", "swap")
# What the committed built-in models were trained on and are measured on (docs/models.md); `swap`
# joins the default once they are retrained with it (`--mix`, SWAP_MIX).
DEFAULT_MIX = {"add": 0.35, "sub": 0.35, "running": 0.3}
SWAP_MIX = {"add": 0.2, "sub": 0.2, "running": 0.3, "swap": 0.3}
SPLITS = ("train", "validation", "eval")
SPLIT_BUCKETS = 10
_BUCKET_SPLIT = {0: "eval", 1: "validation"}
WIDTH = 5  # add/sub operand digits
MAX_LEVEL = WIDTH  # significant digits of the longer operand
RUNNING_LABELS = "abcdefghijklmn"
RUNNING_MIN_TERMS = 6
RUNNING_WIDTH = 3
SWAP_LETTERS = "abcde"
SWAP_LABELS = "ABCDEFGHIJ"
SWAP_MIN = 4
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
    if kind == "swap":
        items = text.split(",")
        width = len(SWAP_LETTERS)
        ok = bool(text) and all(len(item) == 4 + width and item[0].isupper() and item[1:3].isdigit()
                                and item[3] == "=" and item[4:].islower() for item in items)
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


def swap_problem(letters: str, swaps: Sequence[tuple[int, int]]) -> Problem:
    """`letters` a permutation of SWAP_LETTERS; `swaps` 1-based position pairs, first < second."""
    if sorted(letters) != sorted(SWAP_LETTERS):
        raise ValueError(f"swap needs a permutation of {SWAP_LETTERS!r}, got {letters!r}")
    if not SWAP_MIN <= len(swaps) <= len(SWAP_LABELS):
        raise ValueError(f"swap needs {SWAP_MIN}-{len(SWAP_LABELS)} swaps, got {len(swaps)}")
    state, items = list(letters), []
    for label, (i, j) in zip(SWAP_LABELS, swaps, strict=False):
        if not 1 <= i < j <= len(SWAP_LETTERS):
            raise ValueError(f"a swap is two positions 1-{len(SWAP_LETTERS)}, first < second; got {i}{j}")
        state[i - 1], state[j - 1] = state[j - 1], state[i - 1]
        items.append(f"{label}{i}{j}=" + "".join(state))
    pairs = " ".join(f"{label}{i}{j}" for label, (i, j) in zip(SWAP_LABELS, swaps, strict=False))
    key = letters + ":" + "".join(f"{i}{j}" for i, j in swaps)
    return Problem("swap", key, f"swap {letters} {pairs}", ",".join(items))


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
    if kind == "swap":
        letters = "".join(rng.sample(SWAP_LETTERS, len(SWAP_LETTERS)))
        count = rng.randint(SWAP_MIN, len(SWAP_LABELS))
        positions = range(1, len(SWAP_LETTERS) + 1)
        return swap_problem(letters, [tuple(sorted(rng.sample(positions, 2))) for _ in range(count)])
    raise ValueError(f"unknown task kind {kind!r}; known: {', '.join(KINDS)}")


def check_mix(mix: dict[str, float]) -> None:
    """A mix names known kinds with positive weights (they need not sum to 1)."""
    unknown = [kind for kind in mix if kind not in KINDS]
    if unknown or not mix or any(weight <= 0 for weight in mix.values()):
        raise ValueError(f"a task mix needs positive weights of kinds among {', '.join(KINDS)}, got {mix}")


def parse_mix(text: str) -> dict[str, float]:
    """"add=0.2,sub=0.2,running=0.3,swap=0.3" -> the mix."""
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, sep, weight = part.partition("=")
        if not sep:
            raise ValueError(f"a task mix is KIND=WEIGHT,... with kinds {', '.join(KINDS)}; got {part!r}")
        try:
            mix[kind] = float(weight)
        except ValueError:
            raise ValueError(f"the weight of {kind!r} must be a number, got {weight!r}") from None
    check_mix(mix)
    return mix


def format_mix(mix: dict[str, float]) -> str:
    """The inverse of parse_mix."""
    return ",".join(f"{kind}={weight:g}" for kind, weight in mix.items())


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
