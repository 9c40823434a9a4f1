"""The uniform-noise policies (engine/decoding/uniform.py) on hand-built tensors: the official entropy
bound and stop rule, and dg-converge's settling, relaxed thresholds and grinding cut."""

from __future__ import annotations

from typing import Optional

import torch

from engine.decoding import uniform as U


def _knobs(rows: int = 1, **kw: float) -> dict[str, torch.Tensor]:
    values = {"max_denoising_steps": 4, "entropy_bound": 0.1, "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1,
              "confidence_threshold": 0.005, "adaptive_stop": True, "settle_steps": 2, "canvas_relax": 0.5,
              "eta": 0.015, "patience": 2, "temperature": 0.0, **kw}
    return {name: torch.tensor([v] * rows) for name, v in values.items()}


def test_the_temperature_runs_from_t_max_and_never_reaches_t_min():
    knobs = _knobs(4)
    temps = U.temperature(torch.arange(4), knobs)
    official = [0.4 + (0.8 - 0.4) * (torch.tensor(n, dtype=torch.int32) / 4) for n in (4, 3, 2, 1)]
    assert temps.dtype == torch.float32 and temps.tolist() == [float(t) for t in official]


def test_a_requests_temperature_scales_the_whole_schedule_and_1_or_0_leave_it():
    steps = torch.arange(4)
    schedule = U.temperature(steps, _knobs(4))
    assert torch.equal(U.temperature(steps, _knobs(4, temperature=1.0)), schedule)
    assert torch.allclose(U.temperature(steps, _knobs(4, temperature=0.5)), 0.5 * schedule)
    assert torch.allclose(U.temperature(steps, _knobs(4, temperature=1.5)), 1.5 * schedule)


def test_the_entropy_bound_keeps_the_lowest_entropies_whose_smaller_ones_fit():
    entropy = torch.tensor([[0.5, 0.01, 0.04, 0.2, 0.06]])
    # ascending 0.01, 0.04, 0.06, 0.2, 0.5: sums before each 0, 0.01, 0.05, 0.11 > 0.1
    assert U.entropy_bound_accept(entropy, torch.tensor([0.1])).tolist() == [[False, True, True, False, True]]
    # the lowest is always kept, even above the bound
    assert U.entropy_bound_accept(torch.tensor([[3.0, 2.0]]), torch.tensor([0.1])).tolist() == [[False, True]]


def test_the_entropy_is_categoricals():
    scaled = torch.randn(2, 3, 7)
    expected = torch.distributions.Categorical(logits=scaled).entropy()
    assert torch.equal(U.entropy(scaled), expected)


def test_the_official_stop_needs_stability_and_confidence_and_the_switch():
    stable, mean = torch.tensor([1, 0, 1, 1]), torch.tensor([0.001, 0.001, 0.01, 0.001])
    assert U.official_stop(stable, mean, _knobs(4)).tolist() == [True, False, False, True]
    assert not U.official_stop(stable, mean, _knobs(4, adaptive_stop=False)).any()
    assert U.official_stop(torch.zeros(1, dtype=torch.long), mean[:1], _knobs(1, stability_threshold=0)).all()


def _inputs(settled: Optional[torch.Tensor] = None, flat_steps: Optional[torch.Tensor] = None,
            **kw) -> U.CanvasInputs:
    """dg-converge's row state (`settled`, Box 7's counter) by the names its registry entry declares."""
    settled = torch.zeros(1, 3, dtype=torch.long) if settled is None else settled
    flat_steps = torch.tensor([0]) if flat_steps is None else flat_steps
    base = dict(entropy=torch.tensor([[0.01, 0.5, 0.5]]), canvas_in=torch.tensor([[5, 6, 7]]),
                sampled=torch.tensor([[5, 8, 9]]), renoise=torch.tensor([[1, 2, 3]]), stable=torch.tensor([0]),
                canvas_index=torch.tensor([0]), knobs=_knobs(), accepted_before=torch.tensor([0]),
                state={"settled": settled, "low_yield": flat_steps})
    return U.CanvasInputs(**{**base, **kw})


def test_official_keeps_accepted_samples_and_renoises_the_rest():
    d = U.decide_official(_inputs())  # entropies 0.01, 0.5, 0.5: the sums before them 0, 0.01, 0.51
    assert d.next_canvas.tolist() == [[5, 8, 3]] and d.accepted.tolist() == [[True, True, False]]
    assert not d.done.any()


def test_a_settled_position_keeps_its_token_and_takes_no_entropy_budget():
    # position 1 has kept its accepted sample for settle_steps steps: it is frozen, its entropy is not
    # counted, so position 2 fits the bound beside position 0
    x = _inputs(entropy=torch.tensor([[0.01, 0.5, 0.05]]), settled=torch.tensor([[1, 2, 0]]),
                sampled=torch.tensor([[5, 8, 9]]))
    d = U.decide_converge(x)
    assert d.accepted.tolist() == [[True, True, True]]
    assert d.next_canvas.tolist() == [[5, 6, 9]]  # the frozen position keeps 6, not the sample 8
    assert d.state is not None and d.state["settled"].tolist() == [[2, 3, 0]]  # 5 == 5 counts; 9 != 7 restarts


def test_the_confidence_threshold_relaxes_over_four_canvas_tiers():
    relaxed = U.relaxed_confidence(torch.full((6,), 0.01), torch.arange(6), torch.full((6,), 0.5))
    assert torch.allclose(relaxed, torch.tensor([0.01, 0.015, 0.02, 0.025, 0.025, 0.025]))
    x = _inputs(entropy=torch.full((1, 3), 0.006), stable=torch.tensor([1]), canvas_index=torch.tensor([2]))
    assert U.decide_converge(x).done.all() and not U.decide_official(x).done.any()


def test_the_grinding_cut_fires_when_the_accepted_set_stops_growing_with_a_stable_argmax():
    counter, fired = U.grinding(torch.ones(2, 4, dtype=torch.bool), torch.tensor([4, 2]), torch.tensor([1, 1]),
                                torch.tensor([0.015, 0.015]), torch.tensor([2, 2]))
    assert counter.tolist() == [2, 0] and fired.tolist() == [True, False]
    grinding = dict(entropy=torch.full((1, 3), 0.01), accepted_before=torch.tensor([3]), flat_steps=torch.tensor([1]))
    d = U.decide_converge(_inputs(stable=torch.tensor([1]), **grinding))
    assert d.done.all() and d.grinding_exit is not None and d.grinding_exit.all()
    assert not U.decide_converge(_inputs(stable=torch.tensor([0]), **grinding)).done.any()  # argmax still moving
