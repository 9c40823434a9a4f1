"""LLaDA2.1's decoder (`block-edit`) on hand-built tensors and summaries: the editing rule, its
commits, its prediction over the whole vocabulary, and when its block ends (post steps, the step
limit); the golden runs are in tests/parity/test_block_golden.py."""

from __future__ import annotations

import pytest
import torch

from engine.advance import advance
from engine.decoding import policies as P
from engine.decoding.params import DecodeParamError, DecodeParams
from engine.decoding.registry import PolicyInputs, decide_block_edit, edit_block_ends
from engine.decoding.sampling import predict
from engine.request import Request
from engine.summary import COUNTS, RowSummary

MASK = 9


def test_an_edit_needs_an_editable_position_a_different_prediction_and_a_confidence_above_the_threshold():
    tokens = torch.tensor([[1, 2, 3, 4, 5, MASK]])
    x0 = torch.tensor([[1, 7, 7, MASK, 7, 7]])
    conf = torch.tensor([[0.99, 0.99, 0.5, 0.8, 0.99, 0.99]])
    editable = torch.tensor([[True, True, True, True, False, False]])
    edits = P.token_edits(conf, x0, tokens, editable, torch.tensor([0.5]))
    # 0: the same token; 1: edited; 2: at the threshold (strict); 3: edited to the mask id (masked
    # again, as the official decoder does); 4: not editable (a prompt position); 5: masked (a commit's job)
    assert edits.tolist() == [[False, True, False, True, False, False]]
    assert not P.token_edits(conf, x0, tokens, editable, torch.tensor([1.0])).any()  # 1.0: editing off
    assert P.token_edits(conf, x0, tokens, editable, torch.tensor([0.0])).tolist() == [
        [False, True, True, True, False, False]]


def _inputs(conf, tokens, x0, quota, threshold, editing_threshold, generated=None, step=None,
            max_steps_per_block=1000) -> PolicyInputs:
    candidates = tokens == MASK
    generated = torch.ones_like(candidates) if generated is None else generated
    rows = conf.shape[0]
    zeros = torch.zeros(rows, dtype=torch.long)
    knobs = {"threshold": torch.tensor(threshold), "editing_threshold": torch.tensor(editing_threshold),
             "max_steps_per_block": torch.full((rows,), max_steps_per_block)}
    return PolicyInputs(conf=conf, candidates=candidates, x0=x0, unmasked=torch.where(x0 == MASK, 0, x0),
                        tokens=tokens, editable=~candidates & generated, step=zeros if step is None else step,
                        block=zeros, quota=torch.tensor(quota), block_length=zeros, steps_per_block=zeros,
                        num_blocks=zeros, knobs=knobs, words={}, state={})


def test_one_forward_commits_masks_and_edits_tokens_together():
    tokens = torch.tensor([[MASK, MASK, MASK, 4, 5],   # two masks above 0.7: both committed, 4 -> 8 edited
                           [MASK, MASK, MASK, 4, 5]])  # none above 0.95: the quota (2) best, 8 not edited
    x0 = torch.tensor([[1, 2, 3, 8, 5], [1, 2, 3, 8, 5]])
    conf = torch.tensor([[0.8, 0.9, 0.3, 0.6, 0.99], [0.8, 0.9, 0.3, 0.6, 0.99]])
    decision = decide_block_edit(_inputs(conf, tokens, x0, [1, 2], [0.7, 0.95], [0.5, 0.9]))
    assert decision.commit.tolist() == [[True, True, False, False, False], [True, True, False, False, False]]
    assert decision.edit.tolist() == [[False, False, False, True, False], [False] * 5]


def test_a_prompt_position_of_the_block_is_never_edited():
    tokens = torch.tensor([[3, 4, MASK]])
    x0 = torch.tensor([[7, 7, 7]])
    conf = torch.tensor([[0.99, 0.99, 0.99]])
    generated = torch.tensor([[False, True, True]])  # the prompt's tail fills position 0
    decision = decide_block_edit(_inputs(conf, tokens, x0, [1], [0.5], [0.5], generated))
    assert decision.edit.tolist() == [[False, True, False]]


def test_block_edit_rows_may_predict_the_mask_and_other_rows_never_do():
    logits = torch.zeros(2, 3, 12)
    logits[:, :, MASK] = 5.0
    logits[:, :, 2] = 4.0
    x0, unmasked = predict(logits, [], MASK, mask_rows=torch.tensor([True, False]))
    assert x0.tolist() == [[MASK] * 3, [2] * 3]
    assert unmasked.tolist() == [[2] * 3, [2] * 3]  # what a block at its step limit is filled with
    generator = torch.Generator().manual_seed(0)
    sampled, _ = predict(logits, [(0, generator, 1e-6)], MASK, mask_rows=torch.tensor([True, False]))
    assert sampled[0].tolist() == [MASK] * 3  # a near-zero temperature samples the argmax


def test_the_step_limit_fills_the_block_with_tokens_other_than_the_mask():
    tokens = torch.tensor([[MASK, MASK, 4], [MASK, MASK, 4]])
    x0 = torch.tensor([[MASK, 2, MASK], [MASK, 2, MASK]])  # the argmax may be the mask (an edit masks 4 again)
    conf = torch.tensor([[0.1, 0.1, 0.99], [0.1, 0.1, 0.99]])
    decision = decide_block_edit(_inputs(conf, tokens, x0, [1, 1], [0.9, 0.9], [0.5, 0.5],
                                         step=torch.tensor([1, 0]), max_steps_per_block=2))
    # row 0 is at its last allowed forward: every mask is committed with its best other token, and no
    # edit writes the mask; row 1 commits its quota and edits position 2 to the mask
    assert decision.commit.tolist() == [[True, True, False], [True, False, False]]
    assert decision.tokens[0].tolist() == [0, 2, 0] and decision.edit[0].tolist() == [False, False, True]
    assert decision.edit[1].tolist() == [False, False, True] and decision.tokens[1].tolist() == [MASK, 2, MASK]


def _summary(tokens: list[int], committed: int, edited: int) -> RowSummary:
    still = tokens.count(MASK)
    width = len(tokens)
    first = tokens.index(MASK) if still else width
    values = {"committed": committed, "undecided": still, "forced": 0, "band_high": 0, "band_low": 0,
              "grinding_exit": 0, "end_pos": width, "first_undecided": first, "edited": edited, "end_committed": 0}
    return RowSummary(*(values[name] for name in COUNTS), tokens=tokens, _row=[], _k=0)


@pytest.fixture(scope="module")
def block_mode(fixtures):
    """The block-diffusion mode of the tiny SDAR fixture: what advances a block-edit row."""
    from engine import Engine, load_model

    return Engine.from_model(load_model(fixtures / "block" / "sdar" / "sdar_tiny")).mode


def _request(mode, **knobs) -> Request:
    params = DecodeParams(policy="block-edit", gen_length=4, block_length=2, steps=4, cache="exact", gating=True,
                          **knobs)
    return Request("r", [1, 2], params, mode.geometry(2, params), MASK, frozenset({99}), 0.0)


def _advance(mode, request: Request, summary: RowSummary) -> None:
    assert advance(request, summary, mode.plan(request), mode).result is None


def test_a_block_ends_after_a_clean_forward_that_edits_nothing(block_mode):
    request = _request(block_mode, max_post_steps=16)
    _advance(block_mode, request, _summary([5, MASK], 1, 0))
    assert (request.block, request.step) == (0, 1)
    _advance(block_mode, request, _summary([5, 6], 1, 0))  # filled: the next forward is a post step
    assert (request.block, request.post_steps) == (0, 1)
    _advance(block_mode, request, _summary([5, 7], 0, 1))  # an edit: one more post step
    assert (request.block, request.post_steps) == (0, 2)
    _advance(block_mode, request, _summary([5, 7], 0, 0))  # clean, nothing edited: the block ends
    assert (request.block, request.step, request.post_steps) == (1, 0, 0)
    assert request.stats.nfe == 4 and request.stats.steps_per_block == [4]


def test_post_steps_are_spent_before_the_forward_and_masks_may_come_back(block_mode):
    request = _request(block_mode, max_post_steps=1)
    _advance(block_mode, request, _summary([5, 6], 2, 0))  # filled at once: post step 1 next
    assert (request.block, request.post_steps) == (0, 1)
    _advance(block_mode, request, _summary([5, MASK], 0, 1))  # an edit masks position 1 again
    assert (request.block, request.post_steps, request.undecided) == (0, 1, 1)
    _advance(block_mode, request, _summary([5, 6], 1, 0))  # refilled: post step 2 > 1, no forward
    assert request.block == 1 and request.stats.nfe == 3
    zero = _request(block_mode, max_post_steps=0)
    _advance(block_mode, zero, _summary([5, 6], 2, 0))  # no post step at all
    assert zero.block == 1 and zero.stats.nfe == 1


def test_the_step_limit_ends_a_block(block_mode):
    request = _request(block_mode, max_steps_per_block=2)
    assert not edit_block_ends(request, _summary([MASK, MASK], 0, 0), 2)
    _advance(block_mode, request, _summary([MASK, MASK], 0, 0))
    assert request.block == 0  # the next step is the block's last allowed one: it fills the block
    assert edit_block_ends(request, _summary([MASK, MASK], 0, 0), 2)
    _advance(block_mode, request, _summary([5, 6], 2, 0))
    assert request.block == 1


def test_the_decoder_knobs_are_checked():
    for knob, value in (("editing_threshold", 1.5), ("max_post_steps", -1), ("num_to_transfer", 0),
                        ("max_steps_per_block", 0)):
        with pytest.raises(DecodeParamError) as err:
            DecodeParams(policy="block-edit", **{knob: value})
        assert err.value.param == knob
    with pytest.raises(DecodeParamError) as err:
        DecodeParams(block_attention="additive_01", cache="exact")
    assert err.value.param == "block_attention"
    with pytest.raises(DecodeParamError) as err:
        DecodeParams(eos_early_stop=True, early_exit=False)
    assert err.value.param == "eos_early_stop"

    # the cache defaults to the family's (the exact one for block-diffusion models), unless the mask
    # cannot be cached
    assert DecodeParams().with_model_defaults(8, "exact", True).cache == "exact"
    assert DecodeParams(block_attention="additive_01").with_model_defaults(32, "exact", True).cache == "none"
    assert DecodeParams().with_model_defaults(None, "none", True).cache == "none"
