"""The built-in task family, the held-out split and the character tokenizer."""

from __future__ import annotations

import random

import pytest

from tinymodels import char_tokenizer as chars
from tinymodels.tasks import (
    COLLATZ_STARTS,
    KINDS,
    MAX_RESPONSE_CHARS,
    answer_of,
    is_held_out,
    make_problem,
    problems,
    sample,
)


def _check(problem) -> None:
    """Verify a problem's answer independently of the generator."""
    if problem.kind == "add":
        a, b = map(int, problem.prompt.split("+"))
        assert problem.answer == f"{a + b:05d}" and problem.prompt == f"{a:04d}+{b:04d}"
        # the worked chain: one fixed-width column per digit, from the right, carries consistent
        columns = problem.response.split(";")[:-1]
        assert len(columns) == 4
        carry = 0
        for i, column in enumerate(columns):
            lhs, total = column.split("=")
            terms = list(map(int, lhs.split("+")))
            assert terms == [(a // 10 ** i) % 10, (b // 10 ** i) % 10, carry]
            assert len(total) == 2 and sum(terms) == int(total)
            carry = int(total) // 10
    elif problem.kind == "affine":
        x, rule, _, m, k = problem.prompt.split(" ")
        x = int(x.removeprefix("x="))
        a, b = rule.removeprefix("x->").split("x+")
        values = []
        for i in range(int(k.removeprefix("k="))):
            x = (int(a) * x + int(b)) % int(m)
            values.append(f"x{i + 1}={x}")
        assert problem.answer == ",".join(values)
    elif problem.kind == "collatz":
        start = problem.prompt.split()[1]
        n, values = int(start), []
        assert len(start) == 3
        while n != 1:
            n = 3 * n + 1 if n % 2 else n // 2
            values.append(f"{n:03d}")
        assert problem.answer == ",".join(values)
    elif problem.kind == "running":
        terms = problem.prompt.split()[1:]
        total, expected = 0, []
        for term in terms:
            total += int(term[1:])
            expected.append(f"{term[0]}{total:02d}")
        assert problem.answer == ",".join(expected)
    else:
        raise AssertionError(problem.kind)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_generated_answers_are_correct(split):
    for problem in sample(600, seed=3, split=split):
        _check(problem)
        assert len(problem.response) <= MAX_RESPONSE_CHARS


def test_every_kind_appears_and_lengths_vary():
    batch = sample(1000, seed=0, split="train")
    assert {p.kind for p in batch} == set(KINDS)
    lengths = [len(p.response) for p in batch]
    assert min(lengths) < 32 and max(lengths) > 64  # from a quarter of the 128-token canvas to most of it


def test_held_out_split_never_reaches_training():
    train = sample(3000, seed=1, split="train")
    assert not any(is_held_out(p.kind, p.key) for p in train)
    evaluation = sample(500, seed=1, split="eval")
    assert all(is_held_out(p.kind, p.key) for p in evaluation)
    assert not {(p.kind, p.key) for p in train} & {(p.kind, p.key) for p in evaluation}


def test_held_out_share_is_about_a_tenth():
    rng = random.Random(0)
    drawn = [make_problem(rng.choice(KINDS), rng) for _ in range(4000)]
    share = sum(is_held_out(p.kind, p.key) for p in drawn) / len(drawn)
    assert 0.07 < share < 0.13


def test_streams_are_reproducible():
    assert sample(50, seed=9) == sample(50, seed=9)
    assert sample(50, seed=9) != sample(50, seed=10)
    with pytest.raises(ValueError):
        next(problems(0, "test"))


def test_answer_parsing():
    assert answer_of("add", "7+8+0=15;=00015") == "00015"
    assert answer_of("add", "7+8+0=15;=0001x") is None
    assert answer_of("collatz", "3,10,5") == "3,10,5"
    assert answer_of("running", "a3,b8") == "a3,b8"
    assert answer_of("running", "a3,8") is None
    assert answer_of("affine", "") is None
    assert answer_of("affine", "x1=3,x2=4") == "x1=3,x2=4"
    assert answer_of("affine", "x1=3,4") is None


def test_collatz_starts_fit_the_canvas():
    assert len(COLLATZ_STARTS) > 50
    assert max(len(make_problem("collatz", random.Random(i)).response) for i in range(300)) <= MAX_RESPONSE_CHARS


def test_tokenizer_round_trips_every_character_of_the_task():
    tokenizer = chars.build_tokenizer()
    texts = [p.prompt for p in sample(300, seed=2)] + [p.response for p in sample(300, seed=2)]
    alphabet = "".join(chr(c) for c in range(32, 127)) + "\n"
    for text in [*texts, alphabet]:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert len(ids) == len(text)
        assert chars.special_id(chars.UNK) not in ids
        assert tokenizer.decode(ids) == text


def test_tokenizer_files_and_chat_template(tmp_path):
    from engine import load_tokenizer
    from engine.loading.checkpoint import CheckpointFiles

    chars.write_tokenizer_files(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    tokenizer = load_tokenizer(tmp_path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "12+3"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == chars.render_user_prompt("12+3") == "<|user|>12+3<|assistant|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == chars.special_id(chars.USER) and ids[-1] == chars.special_id(chars.ASSISTANT)
    assert tokenizer.decode(ids[1:-1]) == "12+3"
    tok_config = CheckpointFiles.open(tmp_path).tokenizer_config
    from engine.special_tokens import added_token_ids, end_of_turn_id

    assert end_of_turn_id(tok_config, added_token_ids(tok_config, special_only=True)) == chars.special_id(chars.END)
