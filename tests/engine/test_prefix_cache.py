"""The prefix cache across requests (engine.prefix_cache) on the block-diffusion fixture checkpoints
and the bundled sdar-tiny: the same tokens (and logprobs, to float32 rounding: a row's forward
feeds fewer tokens) with the cache on and off for every block policy, at batch 1 and 8; a repeated
prompt restores its whole blocks; a chat's next turn restores the first turn's prompt and answer;
a tiny budget evicts and still gives the same tokens; a masked-diffusion model refuses it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from conftest import FIXTURES
from fixture_checkpoints import block_fixture

from engine import DecodeParams, Engine, load_model
from engine.decoding.registry import POLICIES

REPO = Path(__file__).resolve().parents[2]
BLOCK_POLICIES = sorted(name for name, policy in POLICIES.items() if "block" in policy.modes)
LOGPROB_TOLERANCE = 1e-4  # float32 rounding of forwards of other shapes (as batched vs alone)


# every block-diffusion fixture checkpoint, as (family, checkpoint folder)
CHECKPOINTS = [(p.parts[-3], p.parts[-2]) for p in sorted(FIXTURES.glob("block/*/*/config.json"))]


@pytest.fixture(scope="module", params=CHECKPOINTS, ids=["/".join(c) for c in CHECKPOINTS])
def named_model(request, tmp_path_factory):
    family, name = request.param
    return name, load_model(block_fixture(family, tmp_path_factory.mktemp(name), name))


@pytest.fixture
def model(named_model):
    return named_model[1]


def _prompts(model, count: int, seed: int = 0) -> list[list[int]]:
    """Prompts sharing a prefix of two and a half blocks, then tails of different lengths."""
    special = model.special
    barred = {special.mask_id, *special.end_ids}
    vocab = [t for t in range(min(model.config.vocab_size, 256)) if t not in barred]
    rng = random.Random(seed)
    block = model.block_size or 4
    shared = rng.choices(vocab, k=block * 5 // 2)
    return [shared + rng.choices(vocab, k=1 + i % (2 * block)) for i in range(count)]


def _params(model, policy: str, **knobs) -> DecodeParams:
    block = model.block_size or 4
    return DecodeParams(policy=policy, gen_length=2 * block, block_length=block, steps=4, threshold=0.5,
                        editing_threshold=0.3, max_steps_per_block=3, logprobs=2, ignore_eos=True, **knobs)


def _same(a, b) -> None:
    assert a.generated_ids == b.generated_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < LOGPROB_TOLERANCE
        assert [t for t, _ in x.top] == [t for t, _ in y.top]


@pytest.mark.parametrize("batch", [1, 8])
def test_the_cache_on_and_off_give_the_same_tokens(named_model, batch):
    """Every block policy on the fixtures at batch 8; CAI and one more at batch 1 (CI's time)."""
    _on_and_off(named_model[1], batch, BLOCK_POLICIES if batch == 8 else ["cai", "block-edit"])


@pytest.mark.parametrize("batch", [1, 8])
def test_the_bundled_sdar_model_gives_the_same_tokens_with_the_cache(batch):
    """The trained model (its confidences decide its commits, unlike the fixtures' random weights),
    CAI only: the other tests here run on the fixtures (CI's time)."""
    _on_and_off(load_model(REPO / "models" / "sdar-tiny"), batch, ["cai"])


def _on_and_off(model, batch: int, policies: list[str]) -> None:
    prompts = _prompts(model, batch + 1)
    for policy in policies:
        params = _params(model, policy)
        off = Engine.from_model(model, max_batch=batch).generate(prompts, params)
        engine = Engine.from_model(model, max_batch=batch, enable_prefix_caching=True)
        first, second = engine.generate(prompts, params), engine.generate(prompts, params)
        for a, b, c in zip(off, first, second, strict=True):
            _same(a, b)
            _same(a, c)
        assert all(r.stats.cached_tokens == len(r.prompt_ids) // params.block_length * params.block_length
                   for r in second)


def test_a_repeated_prompt_restores_its_whole_blocks_and_a_partial_block_is_computed(model):
    block = model.block_size or 4
    engine = Engine.from_model(model, max_batch=2, enable_prefix_caching=True)
    prompt = _prompts(model, 1)[0]
    params = _params(model, "cai", store_pass=True)
    first = engine.generate([prompt], params)[0]
    second = engine.generate([prompt], params)[0]
    whole = len(prompt) // block * block
    assert (first.stats.cached_tokens, second.stats.cached_tokens) == (0, whole)
    assert second.stats.nfe == first.stats.nfe - 1  # no store pass over a restored prompt
    cache = engine.prefix_cache
    assert cache.queries == 2 * len(prompt) and cache.hits == whole


def test_a_chat_turn_restores_the_previous_turn_and_its_answer(model):
    """Turn 2's prompt is turn 1's prompt, its answer and a new message: every block turn 1 made
    final (all but its last) is restored."""
    block = model.block_size or 4
    engine = Engine.from_model(model, max_batch=1, enable_prefix_caching=True)
    prompt, follow_up = _prompts(model, 2)
    params = _params(model, "block-dynamic")
    answer = engine.generate([prompt], params)[0]
    turn2 = prompt + answer.generated_ids + follow_up[-3:]
    written = -(-(len(prompt) + params.gen_length) // block) * block - block  # turn 1's final blocks
    result = engine.generate([turn2], params)[0]
    assert result.stats.cached_tokens == min(written, len(turn2) // block * block) > len(prompt) // block * block
    _same(Engine.from_model(model, max_batch=1).generate([turn2], params)[0], result)


def test_a_tiny_budget_evicts_and_gives_the_same_tokens(model):
    prompts = _prompts(model, 6, seed=1)
    params = _params(model, "cai")
    off = Engine.from_model(model, max_batch=3).generate(prompts, params)
    probe = Engine.from_model(model, max_batch=1, enable_prefix_caching=True)
    probe.generate(prompts[:1], params)
    block_bytes = probe.prefix_cache.bytes_held // len(probe.prefix_cache.blocks)
    engine = Engine.from_model(model, max_batch=3, enable_prefix_caching=True,
                               prefix_cache_gb=3 * block_bytes / (1 << 30))
    for _ in range(2):
        for a, b in zip(off, engine.generate(prompts, params), strict=True):
            _same(a, b)
        assert engine.prefix_cache.bytes_held <= 3 * block_bytes and len(engine.prefix_cache.blocks) <= 3


def test_a_burst_of_identical_prompts_caches_each_block_once(model):
    block = model.block_size or 4
    engine = Engine.from_model(model, max_batch=8, enable_prefix_caching=True)
    prompt = _prompts(model, 1)[0]
    params = _params(model, "block-static")
    burst = engine.generate([prompt] * 8, params)
    assert len({tuple(r.generated_ids) for r in burst}) == 1 and all(r.stats.cached_tokens == 0 for r in burst)
    blocks = len(engine.prefix_cache.blocks)
    later = engine.generate([prompt] * 3, params)
    assert len(engine.prefix_cache.blocks) == blocks
    assert [r.generated_ids for r in later] == [burst[0].generated_ids] * 3
    assert all(r.stats.cached_tokens == len(prompt) // block * block for r in later)


def test_masked_diffusion_refuses_it_and_a_window_forward_skips_it(llada_model, model):
    with pytest.raises(ValueError, match="bidirectional"):
        Engine.from_model(llada_model, enable_prefix_caching=True)
    assert Engine.from_model(llada_model, enable_prefix_caching=None).prefix_cache is None
    engine = Engine.from_model(model, enable_prefix_caching=True)
    prompt = _prompts(model, 1)[0]
    for _ in range(2):
        result = engine.generate([prompt], _params(model, "cai", cache="none"))[0]
        assert result.stats.cached_tokens == 0
    assert not engine.prefix_cache.blocks


def test_the_default_is_on_for_block_diffusion(model):
    assert Engine.from_model(model, enable_prefix_caching=None).prefix_cache is not None


def test_a_row_finished_in_its_first_step_caches_its_own_prompt(model):
    """A row admitted and finished in one step leaves its slot to the row above it (the slots stay
    compact): its prompt's blocks are cached from its own keys and values, read before the move."""
    block = model.block_size or 4
    quick_prompt = _prompts(model, 1, seed=3)[0][:2 * block]
    other_prompt = _prompts(model, 1, seed=4)[0]
    # its whole answer is one block, all committed by the first forward (every confidence is above 0)
    quick = DecodeParams(policy="block-dynamic", threshold=0.0, gen_length=block, block_length=block,
                         logprobs=2, ignore_eos=True)
    engine = Engine.from_model(model, max_batch=2, enable_prefix_caching=True)
    first = engine.generate([quick_prompt, other_prompt], [quick, _params(model, "block-dynamic")])
    assert first[0].stats.nfe == 1 < first[1].stats.nfe
    again = engine.generate([quick_prompt], quick)[0]
    assert again.stats.cached_tokens == len(quick_prompt)
    _same(Engine.from_model(model, max_batch=1).generate([quick_prompt], quick)[0], again)
