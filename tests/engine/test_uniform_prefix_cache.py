"""The prefix cache across requests (engine.prefix_cache) for DiffusionGemma (engine.uniform_mode), on
the fixture checkpoint (window 16, longer than a canvas) and on the short-window one of
tests/data/diffusion_gemma_short_window (window 6, shorter than a canvas and than the prompts): seeded
requests give the same tokens (and logprobs, to float32 rounding) with the cache on and off, at
batch 1 and 3; a repeated prompt restores its whole blocks of `canvas_length` (the whole prompt when it
is whole blocks: its prefill then encodes nothing); a chat's next turn restores the previous turn's
prompt and committed answer; a tiny budget evicts and still gives the same tokens. Every size and id
comes from the checkpoint."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from conftest import FIXTURES

from engine import DecodeParams, Engine, load_model
from engine.models.diffusion_gemma import DiffusionGemmaModel

SHORT_WINDOW = Path(__file__).resolve().parents[1] / "data" / "diffusion_gemma_short_window" / "dg_tiny"
LOGPROB_TOLERANCE = 1e-4  # float32 rounding of a prefill in other chunks (as for the block families)
STEPS = 6  # denoising steps per canvas: CI's time


@pytest.fixture(scope="module", params=["fixture", "short_window"])
def model(request) -> DiffusionGemmaModel:
    path = FIXTURES / "diffusion_gemma" / "dg_tiny" if request.param == "fixture" else SHORT_WINDOW
    loaded = load_model(path)
    assert isinstance(loaded, DiffusionGemmaModel)
    return loaded


def _prompts(model: DiffusionGemmaModel, count: int, seed: int = 0) -> list[list[int]]:
    """Prompts sharing a prefix of two and a half canvases (bos first), then tails of other lengths; no
    end or pad id."""
    special = model.special
    barred = {*special.end_ids, special.pad_id, special.bos_id}
    vocab = [t for t in range(model.config.vocab_size) if t not in barred]
    rng = random.Random(seed)
    canvas = model.canvas_length
    shared = [special.bos_id, *rng.choices(vocab, k=canvas * 5 // 2)]
    return [shared + rng.choices(vocab, k=1 + i * 3 % (2 * canvas)) for i in range(count)]


def _params(model: DiffusionGemmaModel, seed: int = 7, **kw) -> DecodeParams:
    return DecodeParams(gen_length=2 * model.canvas_length, max_denoising_steps=STEPS, seed=seed, logprobs=2, **kw)


def _same(a, b) -> None:
    assert a.generated_ids == b.generated_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < LOGPROB_TOLERANCE


@pytest.mark.parametrize("batch", [1, 3])
def test_the_cache_on_and_off_give_the_same_tokens(model, batch) -> None:
    prompts = _prompts(model, batch + 1)
    params = _params(model)
    off = Engine.from_model(model, max_batch=batch).generate(prompts, params)
    engine = Engine.from_model(model, max_batch=batch, enable_prefix_caching=True)
    first, second = engine.generate(prompts, params), engine.generate(prompts, params)
    for a, b, c in zip(off, first, second, strict=True):
        _same(a, b)
        _same(a, c)
    canvas = model.canvas_length
    assert all(r.stats.cached_tokens == len(r.prompt_ids) // canvas * canvas > 0 for r in second)
    cache = engine.prefix_cache
    assert cache.queries == 2 * sum(map(len, prompts)) and cache.hits >= sum(r.stats.cached_tokens for r in second)


def test_a_prompt_of_whole_canvases_is_restored_whole(model) -> None:
    """Nothing of it is encoded again: the decoder reads the restored cache alone."""
    canvas = model.canvas_length
    prompt = _prompts(model, 1)[0][:2 * canvas]
    params = _params(model)
    engine = Engine.from_model(model, max_batch=1, enable_prefix_caching=True)
    first, second = engine.generate([prompt], params)[0], engine.generate([prompt], params)[0]
    assert (first.stats.cached_tokens, second.stats.cached_tokens) == (0, len(prompt))
    _same(first, second)


def test_a_chat_turn_restores_the_previous_turn_and_its_answer(model) -> None:
    """Turn 2's prompt is turn 1's prompt, its answer and a new message: the blocks of everything turn 1
    encoded (its prompt and every committed canvas but the last) are restored, as far as the cache
    could read them (a sliding window shorter than a canvas loses the block that straddles the
    prompt's end)."""
    canvas = model.canvas_length
    engine = Engine.from_model(model, max_batch=1, enable_prefix_caching=True)
    prompt, follow_up = _prompts(model, 2)
    # every canvas decoded whatever the fixture's end ids and the seed: an end token in the answer would end
    # turn 1 early (ignore_eos keeps it in the answer, a plain token of turn 2's prompt)
    params = _params(model, ignore_eos=True)
    answer = engine.generate([prompt], params)[0]
    assert len(answer.generated_ids) == params.gen_length, "every canvas but the last is encoded"
    turn2 = prompt + answer.generated_ids + follow_up[-3:]
    result = engine.generate([turn2], params)[0]
    encoded = len(prompt) + params.gen_length - canvas
    prompt_blocks = len(prompt) // canvas * canvas
    straddles = len(prompt) % canvas and canvas > model.gemma.retained
    expected = prompt_blocks if straddles else min(encoded // canvas * canvas, len(turn2) // canvas * canvas)
    assert result.stats.cached_tokens == expected > 0
    if not straddles:
        assert expected > prompt_blocks
    _same(Engine.from_model(model, max_batch=1).generate([turn2], params)[0], result)


def test_a_tiny_budget_evicts_and_gives_the_same_tokens(model) -> None:
    prompts = _prompts(model, 4, seed=1)
    params = _params(model)
    off = Engine.from_model(model, max_batch=2).generate(prompts, params)
    probe = Engine.from_model(model, max_batch=1, enable_prefix_caching=True)
    probe.generate(prompts[:1], params)
    block_bytes = probe.prefix_cache.bytes_held // len(probe.prefix_cache.blocks)
    engine = Engine.from_model(model, max_batch=2, enable_prefix_caching=True,
                               prefix_cache_gb=2 * block_bytes / (1 << 30))
    for _ in range(2):
        for a, b in zip(off, engine.generate(prompts, params), strict=True):
            _same(a, b)
        assert engine.prefix_cache.bytes_held <= 2 * block_bytes and len(engine.prefix_cache.blocks) <= 2


def test_the_default_is_on(model) -> None:
    assert Engine.from_model(model, enable_prefix_caching=None).prefix_cache is not None
