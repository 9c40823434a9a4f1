"""The engine's block-causal mode on the tiny SDAR fixture checkpoint: the exact cache's two ways of
writing a finished block agree, the exact cache and the no-cache window forwards give the same
tokens, rows decode the same batched and alone, block-edit streams finished blocks only, and what
the mode does not offer is refused with a RequestError naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cache_views import cache_reads_in_place
from conftest import ordinary_ids

from engine import DecodeParams, Engine, RequestError, load_model
from engine.models.packing import PackedTokens


@pytest.fixture(scope="module")
def sdar_models(fixtures):
    """The SDAR fixture checkpoints by their trained block size, smallest first."""
    found = {}
    for config in sorted((fixtures / "block" / "sdar").glob("*/config.json")):
        found[json.loads(config.read_text())["block_size"]] = load_model(Path(config).parent)
    return dict(sorted(found.items()))


@pytest.fixture(scope="module")
def prompts(sdar_models):
    """Prompts of 10, 3 and 8 tokens of the checkpoints' vocabulary: a prompt's tail falls at
    different places in the blocks."""
    return ordinary_ids(next(iter(sdar_models.values())), (10, 3, 8), seed=5)


@pytest.mark.parametrize("policy", ["block-static", "block-dynamic", "cai"])
def test_store_pass_and_ride_along_write_the_same_cache(sdar_models, prompts, policy):
    """A finished block's keys/values written by SDAR's store pass or alongside the next block's
    first forward: the same tokens; the store pass costs one forward per block and the prefill."""
    block, model = next(iter(sdar_models.items()))
    engine = Engine.from_model(model, max_batch=len(prompts))
    gen_length = 4 * block
    base = DecodeParams(policy=policy, gen_length=gen_length, block_length=block, steps=gen_length, threshold=0.5,
                        ignore_eos=True)
    riding = engine.generate(prompts, base)
    storing = engine.generate(prompts, base.with_overrides(store_pass=True))
    for prompt, a, b in zip(prompts, riding, storing, strict=True):
        assert a.generated_ids == b.generated_ids
        blocks = -(-(len(prompt) + gen_length) // block) - len(prompt) // block
        assert b.stats.nfe == a.stats.nfe + blocks + (len(prompt) >= block)


@pytest.mark.parametrize("policy", ["block-static", "block-dynamic", "block-sequential", "cai", "block-edit"])
def test_the_exact_cache_and_the_window_forward_give_the_same_tokens(sdar_models, prompts, policy):
    """Without a cache each step re-runs the row's whole window (LLaDA2.0's generate()); under the
    block-causal mask the exact cache gives the same logits, so the same tokens and forwards."""
    for block, model in sdar_models.items():
        engine = Engine.from_model(model, max_batch=len(prompts))
        base = DecodeParams(policy=policy, gen_length=4 * block, block_length=block, steps=4 * block, threshold=0.5,
                            editing_threshold=0.3, ignore_eos=True)
        cached = engine.generate(prompts, base)
        windows = engine.generate(prompts, base.with_overrides(cache="none"))
        for a, b in zip(cached, windows, strict=True):
            assert a.generated_ids == b.generated_ids
            assert a.stats.nfe == b.stats.nfe
            assert a.stats.token_edits == b.stats.token_edits


def test_block_edit_streams_finished_blocks_with_the_logprobs_of_their_final_tokens(sdar_models, prompts):
    """An edit changes a token after it was committed: block-edit reports a block's tokens once the
    block has ended, each with the logprobs of the forward that wrote it."""
    block, model = next(iter(sdar_models.items()))
    engine = Engine.from_model(model, max_batch=len(prompts))
    params = DecodeParams(policy="block-edit", gen_length=4 * block, block_length=block, threshold=0.5,
                          editing_threshold=0.0, max_post_steps=3, logprobs=2, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    streamed: dict[str, list] = {i: [] for i in ids}
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.request_id].append(out)
            if out.result is not None:
                results[out.request_id] = out.result
    edits = 0
    for request_id, prompt in zip(ids, prompts, strict=True):
        result = results[request_id]
        outputs = streamed[request_id]
        tokens = [t for out in outputs for t in out.new_token_ids]
        assert tokens == result.generated_ids
        tail = len(prompt) % block
        for out in outputs[:-1]:  # whole blocks (the first one less the prompt's tail), or nothing
            assert len(out.new_token_ids) in (0, block - tail, block, 2 * block - tail, 2 * block)
        logprobs = [lp for out in outputs for lp in out.new_logprobs]
        assert [lp.token_id for lp in logprobs] == tokens == [lp.token_id for lp in result.logprobs]
        assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in logprobs)
        assert model.special.mask_id not in tokens
        edits += result.stats.token_edits
    assert edits > 0  # editing threshold 0: the test sees edits


def test_block_edit_fills_its_block_at_the_step_limit(sdar_models, prompts):
    block, model = next(iter(sdar_models.items()))
    engine = Engine.from_model(model, max_batch=len(prompts))
    gen_length = 4 * block
    params = DecodeParams(policy="block-edit", gen_length=gen_length, block_length=block, threshold=1.0,
                          max_steps_per_block=2, ignore_eos=True)
    for prompt, result in zip(prompts, engine.generate(prompts, params), strict=True):
        blocks = -(-(len(prompt) + gen_length) // block) - len(prompt) // block
        assert result.stats.nfe == 2 * blocks  # one commit, then the limit fills the block
        assert model.special.mask_id not in result.generated_ids and len(result.generated_ids) == gen_length


def test_rows_decode_the_same_batched_and_alone(sdar_models, prompts):
    """Rows of different policies, block sizes and prompt tails share steps at different blocks (one
    cached forward, a window row among them), rows finishing and moving slots as they go; every
    cached forward reads the store in place, and feeding different counts, packs its tokens: the
    layers' MLP runs over the fed tokens alone, never the padding."""
    model = next(iter(sdar_models.values()))
    params = [DecodeParams(policy="cai", gen_length=16, block_length=4, steps=16),
              DecodeParams(policy="block-dynamic", gen_length=16, block_length=8, steps=8, threshold=0.6,
                           store_pass=True),
              DecodeParams(policy="block-sequential", gen_length=16, block_length=4, steps=8, ignore_eos=True),
              DecodeParams(policy="cai", gen_length=16, block_length=8, steps=16, ignore_eos=True),
              DecodeParams(policy="block-edit", gen_length=16, block_length=4, threshold=0.6, editing_threshold=0.2),
              DecodeParams(policy="block-dynamic", gen_length=16, block_length=4, steps=8, cache="none",
                           eos_early_stop=True, block_attention="additive_01")]
    prompts = [prompts[i % len(prompts)] for i in range(len(params))]
    engine = Engine.from_model(model, max_batch=3)
    mlp_tokens, packed_totals = [], []
    mlp, from_counts = model.layers[0].mlp, PackedTokens.from_counts

    def counting_mlp(x):  # type: ignore[no-untyped-def]
        mlp_tokens.append(x.shape[0] * x.shape[1])
        return type(mlp).forward(mlp, x)

    def counting_pack(fed, total, length):  # type: ignore[no-untyped-def]
        packed_totals.append(total)
        assert total == int(fed.sum()) < fed.shape[0] * length
        return from_counts(fed, total, length)

    with cache_reads_in_place(engine) as checked, pytest.MonkeyPatch.context() as patch:
        patch.setattr(mlp, "forward", counting_mlp)
        patch.setattr(PackedTokens, "from_counts", counting_pack)
        batched = engine.generate(prompts, params)
    assert checked[0] > 0
    assert packed_totals and all(total in mlp_tokens for total in packed_totals)
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
    for knob in ({"cache": "dual"}, {"cfg_scale": 1.0}, {"policy": "dream-entropy"},
                 {"store_pass": True, "cache": "none"}):
        with pytest.raises(RequestError) as err:
            engine.add_request([1, 2, 3], DecodeParams(gen_length=16, **knob))
        assert err.value.param == next(iter(knob))
    for knob in ({"store_pass": True}, {"policy": "block-edit"}, {"cache": "exact"},
                 {"block_attention": "additive_01"}, {"eos_early_stop": True}):
        with pytest.raises(RequestError) as err:
            Engine.from_model(llada_model).add_request([1, 2, 3], DecodeParams(gen_length=16, **knob))
        assert err.value.param == next(iter(knob))
    # the checkpoint's trained block is the default block
    assert engine.default_params(DecodeParams(gen_length=16)).block_length == model.block_size


@pytest.mark.parametrize("prompt_len,gen_length,block", [(8, 30, 8), (10, 27, 8), (10, 20, 32), (3, 5, 4), (12, 1, 8)])
def test_the_canvas_lies_on_the_block_grid_from_position_0_for_any_gen_length(sdar_models, prompt_len, gen_length,
                                                                                 block):
    """As LLaDA2's and SDAR's official decoders lay it out: the first decoded block starts at the block
    boundary before the prompt's end, and the canvas ends at the one past prompt + gen_length,
    whatever gen_length is (a masked-diffusion model refuses a block that does not divide it)."""
    engine = Engine.from_model(next(iter(sdar_models.values())))
    params = engine.resolve(range(1, prompt_len + 1), DecodeParams(gen_length=gen_length, block_length=block)).params
    geometry = engine.mode.geometry(prompt_len, params)
    assert geometry.origin == prompt_len // block * block
    assert geometry.length == -(-(prompt_len + gen_length) // block) * block
    assert params.num_blocks == -(-gen_length // block) and params.steps == params.num_blocks * block


def test_a_canvas_of_the_same_blocks_decodes_the_same_tokens_whatever_gen_length_says(sdar_models):
    """gen_length 4 blocks and 4 blocks less 2 after a one-block prompt lay out the same canvas (5
    blocks, with the largest trained block): the same forwards and tokens, the response cut at
    gen_length; with eos_early_stop, an end token past gen_length (in the last block) ends the row at
    the same step, its response cut there too."""
    block, model = list(sdar_models.items())[-1]
    assert block > 2, "the cut gen_length must end inside the last block"
    [prompt] = ordinary_ids(model, (block,), seed=6)
    engine = Engine.from_model(model)
    whole = 4 * block
    for knobs in ({"ignore_eos": True}, {"eos_early_stop": True}):
        full, cut = (engine.generate([prompt], DecodeParams(policy="block-dynamic", gen_length=n, block_length=block,
                                                            steps=whole, threshold=0.5, **knobs))[0]
                     for n in (whole, whole - 2))
        assert cut.generated_ids == full.generated_ids[:whole - 2]
        assert cut.stats.nfe == full.stats.nfe
    assert engine.default_params(DecodeParams(gen_length=whole - 2)).block_length == block  # the trained block
