"""The engine's block-causal mode on the tiny SDAR fixture checkpoint: the exact cache's two ways of
writing a finished block agree, rows decode the same batched and alone, and what the mode does not
offer is refused with a RequestError naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import DecodeParams, Engine, RequestError, load_model


@pytest.fixture(scope="module")
def sdar_models(fixtures):
    """The SDAR fixture checkpoints by their trained block size."""
    found = {}
    for config in sorted((fixtures / "block" / "sdar").glob("*/config.json")):
        found[json.loads(config.read_text())["block_size"]] = load_model(Path(config).parent)
    return found


PROMPTS = [[215, 202, 216, 211, 148, 172, 237, 134, 9, 17], [5, 6, 7], [235, 68, 229, 67, 67, 38, 192, 143]]


@pytest.mark.parametrize("policy", ["block-static", "block-dynamic", "cai"])
def test_store_pass_and_ride_along_write_the_same_cache(sdar_models, policy):
    """A finished block's keys/values written by SDAR's store pass or alongside the next block's
    first forward: the same tokens; the store pass costs one forward per block and the prefill."""
    model = next(iter(sdar_models.values()))
    engine = Engine.from_model(model, max_batch=len(PROMPTS))
    base = DecodeParams(policy=policy, gen_length=16, block_length=4, steps=16, threshold=0.5, ignore_eos=True)
    riding = engine.generate(PROMPTS, base)
    storing = engine.generate(PROMPTS, base.with_overrides(store_pass=True))
    for prompt, a, b in zip(PROMPTS, riding, storing, strict=True):
        assert a.generated_ids == b.generated_ids
        blocks = -(-(len(prompt) + 16) // 4) - len(prompt) // 4
        assert b.stats.nfe == a.stats.nfe + blocks + (len(prompt) >= 4)


def test_rows_decode_the_same_batched_and_alone(sdar_models):
    """Rows of different policies, block sizes and prompt tails share steps at different blocks."""
    model = next(iter(sdar_models.values()))
    params = [DecodeParams(policy="cai", gen_length=16, block_length=4, steps=16),
              DecodeParams(policy="block-dynamic", gen_length=16, block_length=8, steps=8, threshold=0.6,
                           store_pass=True),
              DecodeParams(policy="block-sequential", gen_length=16, block_length=4, steps=8, ignore_eos=True),
              DecodeParams(policy="cai", gen_length=16, block_length=8, steps=16, ignore_eos=True)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    batched = Engine.from_model(model, max_batch=3).generate(prompts, params)
    alone = [Engine.from_model(model, max_batch=1).generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
    for a, b in zip(batched, alone, strict=True):
        assert a.generated_ids == b.generated_ids
        assert a.stats.nfe == b.stats.nfe
        assert len(a.generated_ids) <= 16


def test_what_the_mode_does_not_offer_is_refused(sdar_models, llada_model):
    model = next(iter(sdar_models.values()))
    engine = Engine.from_model(model)
    with pytest.raises(RequestError) as err:
        engine.check_score([1, 2, 3], 4)
    assert err.value.param == "echo"
    for knob in ({"cache": "dual"}, {"cfg_scale": 1.0}, {"policy": "dream-entropy"}):
        with pytest.raises(RequestError) as err:
            engine.add_request([1, 2, 3], DecodeParams(gen_length=16, **knob))
        assert err.value.param == next(iter(knob))
    with pytest.raises(RequestError) as err:
        Engine.from_model(llada_model).add_request([1, 2, 3], DecodeParams(gen_length=16, store_pass=True))
    assert err.value.param == "store_pass"
    # the checkpoint's trained block is the default block
    assert engine.default_params(DecodeParams(gen_length=16)).block_length == model.block_size
