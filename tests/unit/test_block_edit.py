"""LLaDA2.1's decoder (`block-edit`) on hand-built tensors and summaries: the editing rule, its
commits, its prediction over the whole vocabulary, and when its block ends (post steps, the step
limit); the golden runs are in tests/test_block_golden.py."""

from __future__ import annotations

import pytest
import torch

from engine.advance import advance
from engine.decoding import policies as P
from engine.decoding.decide import PolicyInputs, decide_block_edit
from engine.decoding.params import DecodeParamError, DecodeParams, with_model_defaults
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


def _inputs(conf, tokens, x0, quota, threshold, editing_threshold, generated=None) -> PolicyInputs:
    candidates = tokens == MASK
    generated = torch.ones_like(candidates) if generated is None else generated
    rows = conf.shape[0]
    zeros = torch.zeros(rows, dtype=torch.long)
    return PolicyInputs(conf=conf, candidates=candidates, x0=x0, tokens=tokens, editable=~candidates & generated,
                        step=zeros, block=zeros, quota=torch.tensor(quota),
                        f={"threshold": torch.tensor(threshold), "editing_threshold": torch.tensor(editing_threshold)},
                        i={}, b={}, first_conf=torch.zeros_like(conf), low_yield=zeros)


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
    x0 = predict(logits, [], MASK, mask_rows=torch.tensor([True, False]))
    assert x0.tolist() == [[MASK] * 3, [2] * 3]
    generator = torch.Generator().manual_seed(0)
    sampled = predict(logits, [(0, generator, 1e-6)], MASK, mask_rows=torch.tensor([True, False]))
    assert sampled[0].tolist() == [MASK] * 3  # a near-zero temperature samples the argmax


def _summary(tokens: list[int], committed: int, edited: int) -> RowSummary:
    still = tokens.count(MASK)
    width = len(tokens)
    first = tokens.index(MASK) if still else width
    values = {"committed": committed, "still_masked": still, "forced": 0, "band_high": 0, "band_low": 0,
              "grinding_exit": 0, "end_pos": width, "first_masked": first, "edited": edited, "end_committed": 0}
    return RowSummary(*(values[name] for name in COUNTS), tokens=tokens, _row=[], _k=0)


def _request(**knobs) -> Request:
    params = DecodeParams(policy="block-edit", gen_length=4, block_length=2, steps=4, cache="exact", **knobs)
    return Request("r", [1, 2], params, MASK, frozenset({99}), 0.0, block_causal=True)


def test_a_block_ends_after_a_clean_forward_that_edits_nothing():
    request = _request(max_post_steps=16)
    assert advance(request, _summary([5, MASK], 1, 0), storing=False) is None
    assert (request.block, request.step) == (0, 1)
    advance(request, _summary([5, 6], 1, 0), storing=False)  # filled: the next forward is a post step
    assert (request.block, request.post_steps) == (0, 1)
    advance(request, _summary([5, 7], 0, 1), storing=False)  # an edit: one more post step
    assert (request.block, request.post_steps) == (0, 2)
    advance(request, _summary([5, 7], 0, 0), storing=False)  # clean, nothing edited: the block ends
    assert (request.block, request.step, request.post_steps) == (1, 0, 0)
    assert request.stats.nfe == 4 and request.stats.steps_per_block == [4]


def test_post_steps_are_spent_before_the_forward_and_masks_may_come_back():
    request = _request(max_post_steps=1)
    advance(request, _summary([5, 6], 2, 0), storing=False)  # filled at once: post step 1 next
    assert (request.block, request.post_steps) == (0, 1)
    advance(request, _summary([5, MASK], 0, 1), storing=False)  # an edit masks position 1 again
    assert (request.block, request.post_steps, request.masked_now) == (0, 1, 1)
    advance(request, _summary([5, 6], 1, 0), storing=False)  # refilled: post step 2 > 1, no forward
    assert request.block == 1 and request.stats.nfe == 3
    zero = _request(max_post_steps=0)
    advance(zero, _summary([5, 6], 2, 0), storing=False)  # no post step at all
    assert zero.block == 1 and zero.stats.nfe == 1


def test_the_step_limit_ends_a_block():
    request = _request(max_steps_per_block=2)
    assert not request.at_step_limit
    advance(request, _summary([MASK, MASK], 0, 0), storing=False)
    assert request.at_step_limit  # the next step fills the block (decide_step), then the block ends
    advance(request, _summary([5, 6], 2, 0), storing=False)
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
    assert with_model_defaults(DecodeParams(), "exact", True).cache == "exact"
    assert with_model_defaults(DecodeParams(block_attention="additive_01"), "exact", True).cache == "none"
    assert with_model_defaults(DecodeParams(), "none", True).cache == "none"
