"""The uniform-noise mode (DiffusionGemma) in the engine, on the fixture checkpoint: a seeded request's
tokens do not depend on its batch-mates, one device-to-host read per step, whole canvases committed
and streamed, the cut at gen_length, logprobs of the committed tokens, abort, the knobs it refuses
and the defaults it reads from the checkpoint. Few denoising steps per canvas keep it fast."""

from __future__ import annotations

import pytest
import torch
from conftest import FIXTURES, ordinary_ids

from engine import load_model
from engine.decoding.params import DecodeParams
from engine.engine import Engine
from engine.errors import RequestError
from engine.host_reads import count_host_reads

CHECKPOINT = FIXTURES / "diffusion_gemma" / "dg_tiny"


@pytest.fixture(scope="module")
def model():
    return load_model(CHECKPOINT)


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    """Prompts of 7, 10 and 3 tokens of the checkpoint's vocabulary, each opening with its bos id (as
    the fixture's golden runs' prompts do)."""
    return [[model.special.bos_id, *ids] for ids in ordinary_ids(model, (6, 9, 2), seed=11)]


def _params(seed: int, **kw) -> DecodeParams:
    return DecodeParams(gen_length=kw.pop("gen_length", 16), max_denoising_steps=kw.pop("max_denoising_steps", 6),
                        seed=seed, **kw)


def test_the_checkpoint_decides_the_defaults(model, prompts) -> None:
    engine = Engine.from_model(model, max_batch=1)
    params = engine.resolve(prompts[0], DecodeParams(gen_length=8)).params
    generation = model.generation_config
    assert params.policy == "dg-official" and params.block_length == model.canvas_length
    assert params.max_denoising_steps == generation["max_denoising_steps"]
    assert params.entropy_bound == generation["sampler_config"]["entropy_bound"]
    assert (params.t_min, params.t_max) == (generation["t_min"], generation["t_max"])
    assert params.confidence_threshold == generation["confidence_threshold"] and params.adaptive_stop


@pytest.mark.parametrize(("knob", "value"), [("top_p", 0.9), ("top_k", 5), ("min_p", 0.1), ("block_length", None),
                                             ("policy", "cai"), ("cfg_scale", 1.0), ("t_min", None)])
def test_what_the_mode_does_not_have_is_refused_naming_the_knob(model, prompts, knob, value) -> None:
    """(block_length: any other than the checkpoint's canvas length; t_min: above the checkpoint's t_max.)"""
    engine = Engine.from_model(model, max_batch=1)
    value = {"block_length": model.canvas_length // 2,
             "t_min": model.generation_config["t_max"] + 0.1}.get(knob, value)
    with pytest.raises(RequestError) as err:
        engine.resolve(prompts[0], DecodeParams(gen_length=8, **{knob: value}))
    assert err.value.param == ("t_max" if knob == "t_min" else knob)


def test_the_openai_sampling_defaults_are_the_schedule_and_temperature_scales_it(model, prompts) -> None:
    """temperature 1 (the OpenAI SDKs' default) and 0 decode as the schedule alone, with top_p 1, top_k
    -1/0 and min_p 0 (their neutral values) accepted; another temperature (a scale on every step's T:
    tests/unit/test_uniform_policies.py) decodes otherwise."""
    engine = Engine.from_model(model, max_batch=1)
    plain = engine.generate([prompts[0]], _params(seed=3))[0].generated_ids
    for sampling in ({"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}, {"temperature": 0.0, "top_k": 0}):
        assert engine.generate([prompts[0]], _params(seed=3, **sampling))[0].generated_ids == plain
    assert engine.generate([prompts[0]], _params(seed=3, temperature=0.3))[0].generated_ids != plain


def test_a_seeded_request_gives_the_same_tokens_alone_and_batched(model, prompts) -> None:
    alone = [Engine.from_model(model, max_batch=1).generate([p], _params(seed=7 + i))[0].generated_ids
             for i, p in enumerate(prompts)]
    batched = Engine.from_model(model, max_batch=3).generate(prompts, [_params(seed=7 + i) for i in range(3)])
    assert [r.generated_ids for r in batched] == alone
    other_seed = Engine.from_model(model, max_batch=1).generate([prompts[0]], _params(seed=8))[0]
    assert other_seed.generated_ids != alone[0]  # the seed matters


def test_one_host_read_a_step_and_whole_canvases_stream(model, prompts) -> None:
    """(The experts' plain kernel reads each layer's expert counts: grouped_mm, which reads none, here.)"""
    model.set_moe_kernel("grouped_mm")
    engine = Engine.from_model(model, max_batch=3)
    gen_length = model.canvas_length + model.canvas_length // 2  # a canvas and a half: the second one is cut
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, _params(seed=i, logprobs=2, gen_length=gen_length, ignore_eos=True), f"r{i}")
    streamed: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    results = {}
    while engine.has_unfinished():
        with count_host_reads() as reads:
            outputs = engine.step()
        assert reads.count == 1, reads.by_method
        for out in outputs:
            assert len(out.new_token_ids) in (0, model.canvas_length, gen_length % model.canvas_length)
            streamed[out.request_id] += out.new_token_ids
            if out.result is not None:
                results[out.request_id] = out.result
    model.set_moe_kernel(None)
    for request_id, result in results.items():
        assert streamed[request_id] == result.generated_ids and len(result.generated_ids) == gen_length  # the cut
        assert result.finish_reason == "length" and len(result.stats.steps_per_block) == 2
        assert result.logprobs is not None and len(result.logprobs) == gen_length
        assert all(lp.token_id == t and lp.logprob <= 0 and len(lp.top) == 2
                   for lp, t in zip(result.logprobs, result.generated_ids, strict=True))
        assert all(lp.top[0][1] >= lp.logprob - 1e-6 for lp in result.logprobs)  # the committed token is the argmax


def test_an_end_token_in_a_committed_canvas_ends_the_row(model, prompts) -> None:
    engine = Engine.from_model(model, max_batch=4)
    end_ids = set(model.special.end_ids)
    results = engine.generate(prompts * 2, [_params(seed=s, gen_length=24) for s in range(6)])
    ended = [r for r in results if r.finish_reason == "stop"]
    for r in ended:
        assert r.generated_ids[-1] in end_ids and not end_ids & set(r.generated_ids[:-1])
        assert r.end_index == len(r.generated_ids) - 1
    for r in results:
        assert r.finish_reason == "stop" or not end_ids & set(r.generated_ids)


def test_abort_frees_the_row_at_the_next_step(model, prompts) -> None:
    engine = Engine.from_model(model, max_batch=2)
    engine.add_request(prompts[0], _params(seed=1), "a")
    engine.add_request(prompts[1], _params(seed=2), "b")
    engine.step()
    assert engine.abort("a")
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["b"] and engine.num_running == 1


def test_likelihood_scoring_is_refused(model, prompts) -> None:
    engine = Engine.from_model(model, max_batch=1)
    with pytest.raises(RequestError) as err:
        engine.check_score(prompts[0], 4)
    assert err.value.code == "scoring_unsupported"


def test_dg_converge_runs_beside_the_official_rule_in_one_batch(model, prompts) -> None:
    engine = Engine.from_model(model, max_batch=2)
    official, converge = engine.generate([prompts[0]] * 2, [
        _params(seed=3, max_denoising_steps=24, gen_length=8),
        _params(seed=3, max_denoising_steps=24, gen_length=8, policy="dg-converge", ignore_eos=True)])
    assert official.generated_ids == Engine.from_model(model, max_batch=1).generate(
        [prompts[0]], _params(seed=3, max_denoising_steps=24, gen_length=8))[0].generated_ids
    # (ignore_eos: all 8 tokens whatever the fixture's end ids and the seed)
    assert len(converge.generated_ids) == 8 and torch.tensor(converge.generated_ids).max() < model.config.vocab_size
    assert 1 <= converge.stats.steps <= 24  # its trade-off against the official rule: bench/dg_policies.py
