"""CAI's formulas (paper Boxes 3-6, Algorithm 1) at hand-computed points, on hand-built confidences."""

from __future__ import annotations

import math

import pytest
import torch

from engine.decoding import policies as P


def t(*values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def knobs(batch: int = 1, **overrides) -> P.CaiKnobs:
    values = dict(theta_s=0.9, theta_e=0.7, warmup=0.15, block_schedule=True, block_decay=0.1, stretch=False,
                  position_factors=True, budgets=True, grinding=True, eta=0.015, eta_denominator=64.0,
                  patience=4, theta_fb=0.4, grinding_fill=False, min_commit=1)
    values.update(overrides)
    dtypes = {bool: torch.bool, int: torch.long, float: torch.float32}
    return P.CaiKnobs(**{k: torch.full((batch,), v, dtype=dtypes[type(v)]) for k, v in values.items()})


# --- Box 3: adaptive cosine schedule -------------------------------------------------------------


@pytest.mark.parametrize("step,expected", [
    (0, 0.9), (9, 0.9),  # warm-up: t < wT = 9.6
    (10, 0.7 + 0.1 * (1 + math.cos(math.pi * (10 - 9.6) / (64 - 9.6)))),
    (37, 0.7 + 0.1 * (1 + math.cos(math.pi * (37 - 9.6) / 54.4))),
    (63, 0.7 + 0.1 * (1 + math.cos(math.pi * (63 - 9.6) / 54.4))),
])
def test_cosine_schedule(step, expected):
    theta = P.box3_adaptive_threshold(t(step, dtype=torch.long), t(64, dtype=torch.long), t(0.9), t(0.7), t(0.15))
    assert theta.item() == pytest.approx(expected, abs=1e-6)


def test_schedule_reaches_theta_e_at_T():
    theta = P.box3_adaptive_threshold(t(64, dtype=torch.long), t(64, dtype=torch.long), t(0.9), t(0.7), t(0.15))
    assert theta.item() == pytest.approx(0.7, abs=1e-6)


def test_schedule_midpoint_is_mean_of_thresholds():
    # u = 1/2 -> cos = 0 -> theta_e + alpha = (theta_s + theta_e) / 2; T = 20, w = 0 -> t = 10
    theta = P.box3_adaptive_threshold(t(10, dtype=torch.long), t(20, dtype=torch.long), t(0.9), t(0.5), t(0.0))
    assert theta.item() == pytest.approx(0.7, abs=1e-6)


# --- Box 4: block-specific end thresholds --------------------------------------------------------


def test_block_end_thresholds_paper_values():
    blocks = t(0, 1, 2, 3, dtype=torch.long)
    out = P.box4_block_end_threshold(t(0.7), blocks, t(4, dtype=torch.long), t(0.1), torch.tensor(False),
                              torch.tensor(True))
    assert out.tolist() == pytest.approx([0.7, 0.6, 0.5, 0.4])


def test_block_end_thresholds_beyond_four_blocks():
    blocks = torch.arange(8)
    clamp = P.box4_block_end_threshold(t(0.7), blocks, t(8, dtype=torch.long), t(0.1), torch.tensor(False),
                                torch.tensor(True))
    assert clamp.tolist() == pytest.approx([0.7, 0.6, 0.5, 0.4, 0.4, 0.4, 0.4, 0.4])
    stretch = P.box4_block_end_threshold(t(0.7), blocks, t(8, dtype=torch.long), t(0.1), torch.tensor(True),
                                  torch.tensor(True))
    assert stretch.tolist() == pytest.approx([0.7, 0.7, 0.6, 0.6, 0.5, 0.5, 0.4, 0.4])


def test_block_schedule_off_keeps_theta_e():
    out = P.box4_block_end_threshold(t(0.7), t(3, dtype=torch.long), t(4, dtype=torch.long), t(0.1),
                              torch.tensor(False), torch.tensor(False))
    assert out.item() == pytest.approx(0.7)


# --- Box 5: position factors, clipping, budgets ----------------------------------------------------


def test_position_quarters_scale_with_block_length():
    q64 = P.block_quarter(64, t(64, dtype=torch.long))[0]
    assert q64[[0, 15, 16, 31, 32, 47, 48, 63]].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    q32 = P.block_quarter(32, t(32, dtype=torch.long))[0]
    assert q32[[7, 8, 15, 16, 23, 24]].tolist() == [0, 1, 1, 2, 2, 3]


def test_position_factors_and_clipping():
    quarter = t(0, 1, 2, 3, dtype=torch.long)[None]
    on, off = torch.tensor([True]), torch.tensor([False])
    got = P.box6_position_thresholds(t(0.8), quarter, on)[0]
    assert got.tolist() == pytest.approx([0.64, 0.72, 0.84, 0.88])
    high = P.box6_position_thresholds(t(0.95), quarter, on)[0]
    assert high.tolist() == pytest.approx([0.76, 0.855, 0.98, 0.98])  # 0.9975, 1.045 clipped to 0.98
    low = P.box6_position_thresholds(t(0.2), quarter, on)[0]
    assert low.tolist() == pytest.approx([0.2, 0.2, 0.21, 0.22])  # 0.16, 0.18 clipped up to 0.20
    assert P.box6_position_thresholds(t(0.95), quarter, off)[0].tolist() == pytest.approx([0.95] * 4)


def test_budgets_paper_cases():
    # positions 0, 20, 40, 50 in a 64-block, 64 steps; cases evaluated top to bottom
    quarter = P.block_quarter(64, t(64, dtype=torch.long))[:, [0, 20, 40, 50]]

    def budgets(*first_conf: float, enabled: bool = True) -> list[int]:
        return P.box5_token_budget(t(*first_conf)[None], quarter, t(64, dtype=torch.long),
                                   torch.tensor([enabled]))[0].tolist()

    assert budgets(0.9, 0.9, 0.9, 0.9) == [8, 8, 32, 64]
    assert budgets(0.1, 0.1, 0.1, 0.1) == [64, 64, 64, 64]
    assert budgets(0.4, 0.4, 0.4, 0.4) == [32, 32, 32, 64]
    # s exactly 0.5 is not > 0.5; s exactly 0.25 is not < 0.25
    assert budgets(0.5, 0.25, 0.51, 0.51) == [32, 32, 32, 64]
    assert budgets(0.9, 0.1, 0.4, 0.4, enabled=False) == [P.NEVER] * 4  # gating off: never reached


def test_budgets_scale_with_steps_per_block():
    assert P.budget_levels(t(64, 32, 8, 4, dtype=torch.long)).tolist() == [[8, 32, 64], [4, 16, 32],
                                                                             [1, 4, 8], [1, 2, 4]]


# --- Algorithm 1 / Box 6: one step at a time -----------------------------------------------------


def _step(conf, candidates, step, state, k, steps=64, block=0, num_blocks=4, block_length=None):
    width = conf.shape[1]
    return P.cai_step(conf, candidates, t(step, dtype=torch.long), t(steps, dtype=torch.long),
                      t(block, dtype=torch.long), t(num_blocks, dtype=torch.long),
                      t(block_length or width, dtype=torch.long), state, k)


def test_commit_by_position_aware_threshold():
    # step 0: theta_b = 0.9 -> thresholds 0.72 / 0.81 / 0.945 / 0.98 by quarter (8-token block)
    conf = t(0.75, 0.70, 0.85, 0.80, 0.95, 0.94, 0.99, 0.97)[None]
    cand = torch.ones_like(conf, dtype=torch.bool)
    state = P.CaiState(first_conf=conf, low_yield=t(0, dtype=torch.long))
    d = _step(conf, cand, 0, state, knobs())
    assert d.commit[0].tolist() == [True, False, True, False, True, False, True, False]
    assert not d.forced.any()


def test_budget_forces_commit_at_step_B():
    # easy tokens (s > 0.5, first half of a 64-block): budget 8 of 64 steps
    first = t(0.9, 0.9)[None]
    conf = t(0.3, 0.3)[None]
    cand = torch.ones_like(conf, dtype=torch.bool)
    state = P.CaiState(first_conf=first, low_yield=t(0, dtype=torch.long))
    before = _step(conf, cand, 7, state, knobs(min_commit=0, grinding=False), block_length=64)
    assert not before.commit.any()
    at = _step(conf, cand, 8, state, knobs(min_commit=0, grinding=False), block_length=64)
    assert at.commit.all() and at.forced.all()
    gated_off = _step(conf, cand, 8, state, knobs(min_commit=0, budgets=False, grinding=False), block_length=64)
    assert not gated_off.commit.any()


def test_grinding_triggers_after_exactly_K_low_yield_steps():
    # eta = commits / 64: one commit (1.56 %) is not low yield, zero commits are.
    conf = t(0.5, 0.3, 0.1)[None]
    cand = torch.ones_like(conf, dtype=torch.bool)
    state = P.CaiState(first_conf=t(0.1, 0.1, 0.1)[None], low_yield=t(0, dtype=torch.long))
    k = knobs(min_commit=0, patience=4)
    for step in range(3):
        d = _step(conf, cand, 20 + step, state, k, block_length=64)
        assert not d.commit.any() and not d.grinding_exit.any()
        assert d.low_yield.item() == step + 1
        state = P.CaiState(first_conf=state.first_conf, low_yield=d.low_yield)
    d = _step(conf, cand, 23, state, k, block_length=64)
    assert d.grinding_exit.item()
    # only tokens above theta_fb = 0.4 are forced; the counter restarts
    assert d.commit[0].tolist() == [True, False, False]
    assert d.forced[0].tolist() == [True, False, False]
    assert d.low_yield.item() == 0


def test_grinding_exit_fill_commits_everything():
    conf = t(0.5, 0.3, 0.1)[None]
    cand = torch.ones_like(conf, dtype=torch.bool)
    state = P.CaiState(first_conf=t(0.1, 0.1, 0.1)[None], low_yield=t(3, dtype=torch.long))
    d = _step(conf, cand, 23, state, knobs(min_commit=0, grinding_fill=True), block_length=64)
    assert d.grinding_exit.item() and d.commit.all()


def test_productive_step_resets_low_yield_counter():
    conf = t(0.99, 0.1)[None]
    cand = torch.ones_like(conf, dtype=torch.bool)
    state = P.CaiState(first_conf=conf, low_yield=t(3, dtype=torch.long))
    d = _step(conf, cand, 30, state, knobs(eta_denominator=2.0), block_length=64)
    assert d.commit[0].tolist() == [True, False]
    assert d.low_yield.item() == 0 and not d.grinding_exit.any()


def test_gating_off_never_forces_grinding():
    conf = t(0.5, 0.3)[None]
    cand = torch.ones_like(conf, dtype=torch.bool)
    state = P.CaiState(first_conf=conf, low_yield=t(10, dtype=torch.long))
    d = _step(conf, cand, 30, state, knobs(min_commit=0, grinding=False, budgets=False), block_length=64)
    assert not d.commit.any() and not d.grinding_exit.any()


def test_block_never_ends_with_masks():
    conf = t(0.01, 0.02, 0.03)[None]
    cand = torch.ones_like(conf, dtype=torch.bool)
    state = P.CaiState(first_conf=conf, low_yield=t(0, dtype=torch.long))
    d = _step(conf, cand, 63, state, knobs(min_commit=0, budgets=False, grinding=False))
    assert d.commit.all() and d.forced.all()


def test_min_commit_commits_the_best_token():
    conf = t(0.2, 0.6, 0.3)[None]
    cand = torch.ones_like(conf, dtype=torch.bool)
    state = P.CaiState(first_conf=conf, low_yield=t(0, dtype=torch.long))
    assert _step(conf, cand, 0, state, knobs(min_commit=1)).commit[0].tolist() == [False, True, False]
    assert not _step(conf, cand, 0, state, knobs(min_commit=0)).commit.any()


def test_rows_with_different_knobs_in_one_call():
    conf = t(0.75, 0.75)[None].repeat(2, 1)
    cand = torch.ones_like(conf, dtype=torch.bool)
    state = P.CaiState(first_conf=conf, low_yield=t(0, 0, dtype=torch.long))
    k = knobs(batch=2, min_commit=0)
    k.position_factors = t(True, False, dtype=torch.bool)
    d = P.cai_step(conf, cand, t(0, 0, dtype=torch.long), t(64, 64, dtype=torch.long), t(0, 0, dtype=torch.long),
                   t(4, 4, dtype=torch.long), t(2, 2, dtype=torch.long), state, k)
    # row 0: position factor 0.8 -> threshold 0.72 in the first quarter; row 1: plain 0.9
    assert d.commit[0, 0].item() and not d.commit[1].any()


# --- baselines -----------------------------------------------------------------------------------


def test_fixed_quota_matches_llada_schedule():
    # M = 10 masked over 4 steps -> 3, 3, 2, 2
    quota = [P.fixed_quota(10, 4, step) for step in range(4)]
    assert quota == [3, 3, 2, 2]


def test_threshold_commit_keeps_the_best_below_threshold():
    conf = t(0.3, 0.5, 0.95, 0.2)[None]
    cand = t(True, True, False, True, dtype=torch.bool)[None]
    assert P.threshold_commit(conf, cand, t(0.9), t(1, dtype=torch.long))[0].tolist() == [False, True, False, False]
    assert P.threshold_commit(conf, cand, t(0.25), t(1, dtype=torch.long))[0].tolist() == [True, True, False, False]


def test_dream_quota_truncates_like_int():
    fractions = P.dream_transfer_fractions(32, 1e-3)
    # with as many steps as tokens, Dream's first step commits nothing (int truncation)
    quota = P.dream_quota(32, fractions[0], last_step=False)
    assert quota == 0
    last = P.dream_quota(5, fractions[-1], last_step=True)
    assert last == 5


def test_rank_breaks_ties_by_position():
    conf = t(0.5, 0.5, 0.9)[None]
    cand = torch.ones_like(conf, dtype=torch.bool)
    assert P.commit_best(conf, cand, t(2, dtype=torch.long))[0].tolist() == [True, False, True]
