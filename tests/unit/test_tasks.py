"""The built-in task family, the held-out split and the character tokenizer."""

from __future__ import annotations

import random

import pytest

from tinymodels import char_tokenizer as chars
from tinymodels.checker import expected_answer, graded_part, is_correct
from tinymodels.tasks import (
    DEFAULT_MIX,
    KINDS,
    MAX_RESPONSE_CHARS,
    SPLITS,
    SWAP_MIX,
    add_problem,
    answer_of,
    is_held_out,
    make_problem,
    parse_mix,
    problems,
    running_problem,
    sample,
    split_of,
    sub_problem,
    swap_problem,
)


def _check_chain(problem) -> None:
    """The worked chain of a sum or difference: one fixed-width column per digit, from the right,
    carries/borrows consistent, checked with Python's arithmetic rather than the generator's."""
    sign = "+" if problem.kind == "add" else "-"
    a, b = map(int, problem.prompt.split(sign))
    columns = problem.response.split(";")[:-1]
    assert len(columns) == 5
    carry = 0
    for i, column in enumerate(columns):
        lhs, total = column.split("=")
        terms = list(map(int, lhs.split(sign)))
        assert terms == [(a // 10 ** i) % 10, (b // 10 ** i) % 10, carry]
        assert len(total) == 2
        if sign == "+":
            assert sum(terms) == int(total)
            carry = int(total) // 10
        else:
            borrow, digit = int(total[0]), int(total[1])
            assert terms[0] - terms[1] - terms[2] + 10 * borrow == digit
            carry = borrow


@pytest.mark.parametrize("split", SPLITS)
def test_generated_answers_agree_with_the_independent_checker(split):
    for problem in sample(600, seed=3, split=split, mix=SWAP_MIX):
        assert is_correct(problem.prompt, problem.response), problem
        assert problem.answer == expected_answer(problem.prompt)
        assert len(problem.response) <= MAX_RESPONSE_CHARS
        if problem.kind in ("add", "sub"):
            _check_chain(problem)


def test_checker_by_hand():
    assert expected_answer("00457+00038") == "000495"
    assert expected_answer("00457-00038") == "00419"
    assert expected_answer("00038-00457") is None
    assert expected_answer("sum a3 b5 c2") == "a3=003,b5=008,c2=010"
    assert expected_answer("457+38") is None and expected_answer("hello") is None
    assert is_correct("00457+00038", "7+8+0=15;=000495")
    assert not is_correct("00457+00038", "7+8+0=15;=000496")
    assert not is_correct("00457+00038", "")
    assert graded_part("00457-00038", "  ") is None and graded_part("00457-00038", "no answer") == "no answer"
    assert add_problem(457, 38).response == "7+8+0=15;5+3+1=09;4+0+0=04;0+0+0=00;0+0+0=00;=000495"
    assert sub_problem(457, 38).response == "7-8-0=19;5-3-1=01;4-0-0=04;0-0-0=00;0-0-0=00;=00419"
    assert running_problem([3, 5, 2, 7, 0, 9]).response == "a3=003,b5=008,c2=010,d7=017,e0=017,f9=026"
    with pytest.raises(ValueError):
        sub_problem(1, 2)
    with pytest.raises(ValueError):
        running_problem([1, 2])
    assert expected_answer("swap cabed A13 B24 C35 D12") == "A13=baced,B24=becad,C35=bedac,D12=ebdac"
    assert swap_problem("cabed", [(1, 3), (2, 4), (3, 5), (1, 2)]).response == "A13=baced,B24=becad,C35=bedac,D12=ebdac"
    assert expected_answer("swap cabed A31 B24") is None  # a swap names its lower position first
    assert expected_answer("swap cabbd A13 B24") is None  # not a permutation
    assert expected_answer("swap cabed B13 A24") is None  # labels run A, B, C, ...
    for bad in (("cabbd", [(1, 2)] * 4), ("cabed", [(1, 2)] * 3), ("cabed", [(2, 1)] * 4), ("cabed", [(1, 2)] * 11)):
        with pytest.raises(ValueError):
            swap_problem(*bad)


def test_every_kind_and_level_appears_and_lengths_span_the_canvas():
    assert {p.kind for p in sample(500, seed=0, split="train")} == set(DEFAULT_MIX)
    batch = sample(2000, seed=0, split="train", mix=SWAP_MIX)
    assert {p.kind for p in batch} == set(KINDS)
    levels = {len(str(max(map(int, p.prompt.replace("-", "+").split("+"))))) for p in batch if p.kind in ("add", "sub")}
    assert levels == {1, 2, 3, 4, 5}  # graded difficulty: 1 to 5 significant digits
    terms = {len(p.prompt.split()) - 1 for p in batch if p.kind == "running"}
    assert terms == set(range(6, 15))
    swaps = {len(p.prompt.split()) - 2 for p in batch if p.kind == "swap"}
    assert swaps == set(range(4, 11))
    lengths = [len(p.response) for p in batch]
    assert min(lengths) <= 40 and max(lengths) > 90  # from a quarter of the 128-token canvas to most of it


def test_splits_are_disjoint_by_construction():
    drawn = {split: sample(2000 if split == "train" else 500, seed=1, split=split, mix=SWAP_MIX) for split in SPLITS}
    for split, batch in drawn.items():
        assert all(split_of(p.kind, p.key) == split for p in batch)
    keys = {split: {(p.kind, p.key) for p in batch} for split, batch in drawn.items()}
    assert not keys["train"] & keys["eval"] and not keys["train"] & keys["validation"]
    assert not keys["validation"] & keys["eval"]
    assert all(is_held_out(p.kind, p.key) for p in drawn["eval"])


def test_held_out_and_validation_shares_are_about_a_tenth_each():
    rng = random.Random(0)
    drawn = [make_problem(rng.choice(KINDS), rng) for _ in range(4000)]
    for split in ("eval", "validation"):
        share = sum(split_of(p.kind, p.key) == split for p in drawn) / len(drawn)
        assert 0.07 < share < 0.13


def test_streams_are_reproducible():
    assert sample(50, seed=9) == sample(50, seed=9)
    assert sample(50, seed=9) != sample(50, seed=10)
    with pytest.raises(ValueError):
        next(problems(0, "test"))


def test_answer_parsing():
    assert answer_of("add", "7+8+0=15;=000015") == "000015"
    assert answer_of("sub", "7-8-0=19;=0001x") is None
    assert answer_of("running", "a3=003,b5=008") == "a3=003,b5=008"
    assert answer_of("running", "a3=003,b008") is None
    assert answer_of("running", "a3=003,5=008") is None
    assert answer_of("running", "") is None
    assert answer_of("swap", "A13=baced,B24=becad") == "A13=baced,B24=becad"
    assert answer_of("swap", "A13=baced,B24=beca") is None
    assert answer_of("swap", "A13=baced,24=becad") is None
    with pytest.raises(ValueError):
        answer_of("collatz", "1")


def test_mix_parsing():
    assert parse_mix("add=0.2, swap=0.8") == {"add": 0.2, "swap": 0.8}
    for bad in ("", "add", "mul=1", "add=x", "add=0", "add=-1"):
        with pytest.raises(ValueError):
            parse_mix(bad)


def test_tokenizer_round_trips_every_character_of_the_task():
    tokenizer = chars.build_tokenizer()
    drawn = sample(300, seed=2, mix=SWAP_MIX)
    texts = [p.prompt for p in drawn] + [p.response for p in drawn]
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


def test_a_model_is_evaluated_on_the_mix_its_training_log_records(tmp_path):
    import json
    from pathlib import Path

    from tinymodels.evaluate import model_mix

    (tmp_path / "training_log.json").write_text(json.dumps({"config": {"mix": SWAP_MIX}}))
    assert model_mix(str(tmp_path)) == SWAP_MIX
    assert model_mix(str(tmp_path / "missing")) == DEFAULT_MIX  # a checkpoint without a training log
    for name in ("llada-tiny", "dream-tiny"):
        model = Path(__file__).resolve().parents[2] / "models" / name
        assert model_mix(str(model)) == json.loads((model / "training_log.json").read_text())["config"]["mix"]
