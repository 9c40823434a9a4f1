"""Likelihood scoring (engine.scoring): LLaDA's Monte-Carlo estimator against a brute-force
enumeration of its expectation, the per-token split, seeding, Dream's shift, and the cost limit."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from engine import Engine, RequestError
from engine.decoding import DecodeParams
from engine.scoring import ScoringJob, prompt_logprobs, scoring_cost, split_estimates


def exact_elbo(model, ids: list[int], split: int) -> float:
    """E over l ~ U{1..L} and every l-subset M of the positions from `split` on (uniformly) of
    (L / l) * sum_{i in M} log p(x_i | x with M masked), by enumerating every subset."""
    n = len(ids)
    positions = range(split, n)
    length = n - split
    shift = 1 if model.logits_shifted else 0
    total = 0.0
    with torch.no_grad():
        for count in range(1, length + 1):
            subsets = list(itertools.combinations(positions, count))
            for subset in subsets:
                canvas = torch.tensor([model.special.mask_id if i in subset else t for i, t in enumerate(ids)])
                logp = model(canvas[None]).float().log_softmax(-1)[0]
                value = sum(float(logp[i - shift, ids[i]]) for i in subset)
                total += (length / count) * value / len(subsets) / length
    return total


@pytest.mark.parametrize("which", ["llada_model", "dream_model"])
def test_the_estimate_converges_to_the_enumerated_expectation(which, request):
    model = request.getfixturevalue(which)
    ids = [5, 9, 13, 7, 21, 3]
    split = 3
    exact = exact_elbo(model, ids, split)
    estimates = split_estimates(model, ids, [split], samples=3000, seed=0)
    # 3000 stratified samples of a sum of at most 3 log-probabilities of a tiny random model
    assert float(estimates[0]) == pytest.approx(exact, abs=0.05 * abs(exact) + 0.05)


def test_per_token_values_sum_to_the_estimate_of_every_split(llada_model):
    ids = [5, 9, 13, 7, 21, 3, 11, 2]
    values = prompt_logprobs(llada_model, ids, samples=8, seed=3)
    estimates = split_estimates(llada_model, ids, range(1, len(ids)), samples=8, seed=3)
    assert values[0] is None and len(values) == len(ids)
    for split in range(1, len(ids)):
        assert math.fsum(values[split:]) == pytest.approx(float(estimates[split - 1]), abs=1e-9)


def test_scoring_is_seeded(llada_model):
    ids = [5, 9, 13, 7, 21, 3]
    first = prompt_logprobs(llada_model, ids, samples=4, seed=7)
    assert prompt_logprobs(llada_model, ids, samples=4, seed=7) == first
    assert prompt_logprobs(llada_model, ids, samples=4, seed=8) != first
    # the batching bound changes how rows are grouped into forwards, not the numbers (but for
    # float32 rounding: a matmul's result depends on its batch size in the last bits)
    regrouped = prompt_logprobs(llada_model, ids, samples=4, seed=7, max_forward_tokens=6)
    assert regrouped[0] is None and regrouped[1:] == pytest.approx(first[1:], rel=1e-5)


def test_short_prompts_and_the_cost_limit(llada_model):
    assert prompt_logprobs(llada_model, [5], samples=4) == [None]
    assert scoring_cost(10, 4) == 9 * 4 * 10
    engine = Engine.from_model(llada_model)
    with pytest.raises(RequestError) as err:
        engine.score(list(range(1, 60)) * 40, samples=64)
    assert err.value.param == "score_samples" and err.value.code == "scoring_too_large"
    with pytest.raises(RequestError):
        engine.score([10 ** 6, 3], samples=2)


def test_a_job_in_chunks_between_decode_steps_gives_the_numbers_of_one_call(llada_model):
    ids = [5, 9, 13, 7, 21, 3, 11, 2, 17, 4, 8, 30]
    chunk = 3 * len(ids)  # three rows a forward: many chunks
    engine = Engine.from_model(llada_model)
    engine.add_request([1, 2, 3], DecodeParams(gen_length=16, block_length=8))
    job = ScoringJob(llada_model, ids, samples=6, seed=4, chunk_tokens=chunk)
    assert job.total_tokens == scoring_cost(len(ids), 6)
    fed = chunks = 0
    while not job.done:
        fed += job.advance()
        chunks += 1
        engine.step()  # the model decodes other rows between the chunks, as in the server
    assert chunks == math.ceil((len(ids) - 1) * 6 / 3) and fed == job.total_tokens and job.advance() == 0
    at_once = prompt_logprobs(llada_model, ids, samples=6, seed=4, max_forward_tokens=chunk)
    assert job.logprobs() == at_once  # the same forwards, whenever they run: the same numbers, exactly
    # Engine.score runs the same job back to back with the engine's chunk size
    assert engine.score(ids, 6, seed=4) == prompt_logprobs(llada_model, ids, samples=6, seed=4,
                                                           max_forward_tokens=engine.config.score_chunk_tokens)
