"""The engine's step API: heterogeneous rows, join/leave, caches, early exit, sampling, telemetry."""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest
import torch
from conftest import generate, ordinary_ids

from engine import Engine, RequestError, load_model
from engine.decoding import DecodeParamError, DecodeParams
from engine.models.kv_cache import write_kv


def _prompts(model: Any, n: int = 8, seed: int = 0) -> list[list[int]]:
    return ordinary_ids(model, (3, 8, 5, 12, 7, 4, 9, 6)[:n], seed)


def _heterogeneous(cache: str) -> list[DecodeParams]:
    return [
        DecodeParams(policy="fixed", gen_length=32, block_length=8, steps=16, cache=cache),
        DecodeParams(policy="threshold", gen_length=16, block_length=8, threshold=0.7, cache=cache),
        DecodeParams(policy="cai", gen_length=32, block_length=8, cache=cache),
        DecodeParams(policy="cai", gen_length=64, block_length=16, gating=False, cache=cache, refresh_interval=4),
        DecodeParams(policy="cai", gen_length=24, block_length=4, theta_e=0.5, cache=cache),
        DecodeParams(policy="fixed", gen_length=16, block_length=16, steps=8, cache=cache),
        DecodeParams(policy="dream-entropy", gen_length=32, block_length=8, steps=32, cache=cache),
        DecodeParams(policy="threshold", gen_length=40, block_length=8, threshold=0.5, cache=cache),
    ]


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("max_batch", [8, 3])
def test_heterogeneous_batch_equals_each_row_alone(llada_model, cache, max_batch):
    """8 rows with different prompt/generation/block lengths, policies and knobs; with max_batch=3
    rows join and leave between steps. Each row gets exactly the tokens it gets alone."""
    prompts, params = _prompts(llada_model), _heterogeneous(cache)
    batched = generate(llada_model, prompts, params, max_batch=max_batch)
    for prompt, p, result in zip(prompts, params, batched, strict=True):
        [alone] = generate(llada_model, [prompt], p)
        assert result.generated_ids == alone.generated_ids
        assert result.stats.nfe == alone.stats.nfe


def test_dream_heterogeneous_batch_with_caches(dream_model):
    prompts = _prompts(dream_model, 4, seed=1)
    params = [DecodeParams(policy="dream-entropy", gen_length=32, block_length=8, steps=32, cache="dual"),
              DecodeParams(policy="cai", gen_length=32, block_length=8, cache="prefix"),
              DecodeParams(policy="threshold", gen_length=16, block_length=8, cache="dual", threshold=0.6),
              DecodeParams(policy="dream-maskgit_plus", gen_length=16, steps=8)]
    batched = generate(dream_model, prompts, params)
    for prompt, p, result in zip(prompts, params, batched, strict=True):
        assert result.generated_ids == generate(dream_model, [prompt], p)[0].generated_ids


def _finished(outputs) -> dict:
    return {o.request_id: o.result for o in outputs if o.finished}


def test_rows_join_between_steps(llada_model):
    engine = Engine.from_model(llada_model, max_batch=4)
    prompts = _prompts(llada_model, 3)
    params = DecodeParams(policy="cai", gen_length=32, block_length=8)
    engine.add_request(prompts[0], params, "a")
    results = {}
    for _ in range(3):
        results.update(_finished(engine.step()))
    engine.add_request(prompts[1], params, "b")
    results.update(_finished(engine.step()))
    engine.add_request(prompts[2], params, "c")
    while engine.has_unfinished():
        results.update(_finished(engine.step()))
    for key, prompt in zip("abc", prompts, strict=True):
        assert results[key].generated_ids == generate(llada_model, [prompt], params)[0].generated_ids


def test_abort_frees_the_row(llada_model):
    engine = Engine.from_model(llada_model, max_batch=2)
    params = DecodeParams(policy="fixed", gen_length=32, block_length=8, steps=32)
    engine.add_request((1, 2, 3), params, "x")
    engine.add_request((4, 5, 6), params, "y")
    engine.add_request((7, 8), params, "z")
    assert [o.request_id for o in engine.step()] == ["x", "y"]  # z waits for a free row
    assert engine.num_running == 2 and engine.num_waiting == 1
    assert engine.abort("x")
    assert {o.request_id for o in engine.step()} == {"y", "z"}  # x left, z took its row
    assert engine.abort("z") and engine.abort("y")
    assert engine.step() == [] and not engine.has_unfinished()
    assert not engine.abort("nope")


def test_abort_of_a_waiting_request_is_immediate(llada_model):
    engine = Engine.from_model(llada_model, max_batch=1)
    params = DecodeParams(policy="fixed", gen_length=8, block_length=8, steps=8)
    engine.add_request((1, 2), params, "a")
    engine.add_request((3, 4), params, "b")
    assert engine.abort("b") and engine.num_waiting == 1  # only "a" is left
    with pytest.raises(ValueError, match="already"):
        engine.add_request((1, 2), params, "a")


def _most_generated_token(model: Any) -> int:
    """The token the model generates most often on the test prompts (an ordinary id, none of its
    special ones)."""
    special = model.special
    results = generate(model, _prompts(model), DecodeParams(policy="fixed", gen_length=64, block_length=8, steps=64,
                                                            early_exit=False))
    counts = torch.bincount(torch.tensor([t for r in results for t in r.generated_ids]),
                            minlength=model.config.vocab_size)
    counts[[special.mask_id, *special.end_ids]] = 0
    return int(counts.argmax())


@pytest.fixture(scope="module")
def llada_eos_common(tmp_path_factory, fixtures, llada_model):
    """The tiny LLaDA with the token it generates most often declared as eos, so rows end early."""
    path = tmp_path_factory.mktemp("llada-eos") / "llada"
    shutil.copytree(fixtures / "llada_tiny", path)
    generation = json.loads((path / "generation_config.json").read_text())
    generation["eos_token_id"] = _most_generated_token(llada_model)
    (path / "generation_config.json").write_text(json.dumps(generation))
    return load_model(path)


@pytest.mark.parametrize("policy", ["fixed", "threshold", "cai"])
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_early_exit_is_lossless_and_saves_forwards(llada_eos_common, policy, cache):
    prompts = _prompts(llada_eos_common)
    base = DecodeParams(policy=policy, gen_length=64, block_length=8, steps=64, cache=cache)
    with_exit = generate(llada_eos_common, prompts, base)
    without = generate(llada_eos_common, prompts, base.with_overrides(early_exit=False))
    saved = 0
    for a, b in zip(with_exit, without, strict=True):
        if a.end_index is None:
            assert a.generated_ids == b.generated_ids
            continue
        assert a.finish_reason == "stop" and a.generated_ids[-1] == llada_eos_common.special.eos_id
        assert b.generated_ids[:len(a.generated_ids)] == a.generated_ids
        assert a.stats.nfe <= b.stats.nfe
        saved += b.stats.nfe - a.stats.nfe
        # blocks skipped by early exit count as saved steps
        assert a.stats.steps_saved == a.stats.fixed_step_budget - sum(a.stats.steps_per_block)
    assert saved > 0
    assert any(r.end_index is not None for r in with_exit)


def test_temperature_sampling_is_seeded_and_batch_independent(llada_model):
    prompts = _prompts(llada_model, 4)
    params = [DecodeParams(policy="cai", gen_length=16, block_length=8, temperature=1.0, seed=s) for s in range(4)]
    first = generate(llada_model, prompts, params)
    again = generate(llada_model, prompts, params)
    alone = [generate(llada_model, [p], [q])[0] for p, q in zip(prompts, params, strict=True)]
    assert [r.generated_ids for r in first] == [r.generated_ids for r in again] == [r.generated_ids for r in alone]
    greedy = generate(llada_model, prompts, DecodeParams(policy="cai", gen_length=16, block_length=8))
    assert [r.generated_ids for r in first] != [r.generated_ids for r in greedy]
    other_seed = generate(llada_model, prompts[:1], params[1])
    assert other_seed[0].generated_ids != first[0].generated_ids


def test_telemetry(llada_model):
    [result] = generate(llada_model, _prompts(llada_model, 1), DecodeParams(policy="cai", gen_length=32, block_length=8,
                                                                           steps=32, early_exit=False))
    stats = result.stats
    assert len(stats.steps_per_block) == 4
    assert stats.nfe == sum(stats.steps_per_block) == len(stats.tokens_per_step)
    assert sum(stats.tokens_per_step) == 32
    assert stats.fixed_step_budget == 32 and stats.steps_saved == 32 - stats.nfe
    # every token of every block is masked at its block's first step
    assert sum(stats.first_step_confidence_bands) == 32
    assert stats.wall_time > 0
    assert set(stats.as_dict()) >= {"nfe", "steps_saved", "forced_commits", "grinding_exits"}


def test_cai_saves_steps_against_fixed(llada_model):
    prompts = _prompts(llada_model)
    fixed = generate(llada_model, prompts, DecodeParams(policy="fixed", gen_length=32, block_length=8, steps=32))
    cai = generate(llada_model, prompts, DecodeParams(policy="cai", gen_length=32, block_length=8, steps=32))
    assert sum(r.stats.nfe for r in cai) < sum(r.stats.nfe for r in fixed)


def test_request_validation(llada_model):
    engine = Engine.from_model(llada_model)
    outside = llada_model.config.vocab_size  # the first id past the vocabulary
    with pytest.raises(RequestError, match="empty"):
        engine.add_request((), DecodeParams())
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request((1, outside), DecodeParams())
    with pytest.raises(RequestError, match="context"):
        engine.add_request((1,), DecodeParams(gen_length=-(-(engine.max_model_len + 1) // 64) * 64, block_length=64))
    assert not engine.has_unfinished()
    with pytest.raises(RequestError, match="vocabulary"):  # a batch fails before any work is done
        engine.generate([[1, 2], [1, outside]], DecodeParams(gen_length=8))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("field,value", [
    ("policy", "nope"), ("gen_length", 0), ("block_length", 0), ("steps", 3), ("theta_s", 1.5),
    ("temperature", -1.0), ("cache", "disk"), ("warmup", 1.0), ("patience", 0), ("top_p", 0.0),
    ("eta", float("nan")), ("gating", "yes"), ("min_commit", 2),
])
def test_decode_params_errors_name_the_parameter(field, value):
    with pytest.raises(DecodeParamError) as err:
        DecodeParams(**{"gen_length": 32, "block_length": 8, field: value})
    assert err.value.param == field


def test_cfg_requires_no_cache():
    with pytest.raises(DecodeParamError, match="cfg_scale"):
        DecodeParams(cfg_scale=1.0, cache="dual")


def test_unknown_parameter_is_named():
    with pytest.raises(DecodeParamError) as err:
        DecodeParams.from_dict({"policy": "cai", "thresh": 0.5})
    assert err.value.param == "thresh"


def test_masked_diffusion_decodes_whole_blocks_of_the_canvas(llada_model):
    """LLaDA's decoders cut the canvas into whole blocks: a block that does not divide gen_length is
    refused by the masked mode, naming it (block diffusion takes it: tests/engine/test_block_engine.py)."""
    DecodeParams(gen_length=32, block_length=7)  # a valid knob on its own
    with pytest.raises(RequestError) as err:
        Engine.from_model(llada_model).add_request([1, 2, 3], DecodeParams(gen_length=32, block_length=7))
    assert err.value.param == "block_length" and err.value.code == "invalid_decoding"


def test_gating_default_comes_from_the_model(llada_model, dream_model):
    assert Engine.from_model(llada_model).default_params().gating is True
    assert Engine.from_model(dream_model).default_params().gating is False
    assert Engine.from_model(dream_model).default_params(DecodeParams(gating=True)).gating is True


def test_engine_facade(fixtures):
    from engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=str(fixtures / "dream_tiny"), max_batch=2))
    assert engine.tokenizer is None and engine.architecture == "dream"
    assert engine.default_params().gating is False
    results = engine.generate([[1, 2, 3], [4, 5], [6]], DecodeParams(gen_length=8, policy="threshold"))
    assert [len(r.generated_ids) <= 8 for r in results] == [True] * 3
    with pytest.raises(ValueError, match="max_batch"):
        EngineConfig(model="x", max_batch=0)


def test_deltas_only_add_final_tokens_and_end_as_the_result(llada_model):
    engine = Engine.from_model(llada_model)
    engine.add_request((5, 6, 7), DecodeParams(policy="cai", gen_length=32, block_length=8), "s")
    seen: list[int] = []
    result = None
    while result is None:
        [output] = engine.step()
        assert output.request_id == "s" and llada_model.special.mask_id not in output.new_token_ids
        seen.extend(output.new_token_ids)
        result = output.result
    end = result.end_index
    assert seen == (result.generated_ids if end is None else result.generated_ids[:end + 1])
    assert not engine.has_unfinished()


def test_write_kv_writes_each_rows_columns_and_nothing_else():
    generator = torch.Generator().manual_seed(0)
    store = torch.randn(3, 2, 12, 4, generator=generator)
    new = torch.randn(3, 2, 5, 4, generator=generator)
    write_index = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [2, 5, 3, 9, 6]])
    expected = store.clone()
    for b in range(3):
        for i in range(5):
            expected[b, :, write_index[b, i]] = new[b, :, i]
    write_kv(store, new, write_index, torch.arange(3))
    assert torch.equal(store, expected)
