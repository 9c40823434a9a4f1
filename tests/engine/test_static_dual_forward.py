"""The masked mode's dual-cache step on static, slot-indexed buffers (engine.static_forward): the
forward that CUDA graphs capture and torch.compile compiles. On CPU it runs eagerly and must decode
exactly what the ordinary cached forward decodes; compiled (fullgraph=True) it must compile whole
and decode the same; on a CUDA machine the captured graphs must too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Optional

import pytest
import torch
from conftest import compiled_code, copies_whole, idle_passes

from engine import DecodeParams, Engine, EngineConfig, load_model
from engine.batch import Batch
from engine.chat import chat_prompt_ids
from engine.loading.tokenizer import load_tokenizer
from engine.static_forward import StaticForwards, batch_buckets
from tinymodels.evaluate import held_out_problems

MODELS = Path(__file__).resolve().parents[2] / "models"


def test_batch_buckets_cover_every_batch_size():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 20)
    for max_batch in range(1, 40):
        buckets = batch_buckets(max_batch)
        assert buckets[-1] == max_batch and list(buckets) == sorted(set(buckets))


def _static_engine(model, max_batch: int, how: str = "eager") -> Engine:  # type: ignore[no-untyped-def]
    engine = Engine.from_model(model, max_batch=max_batch)
    engine.mode.static_forwards = StaticForwards(engine.mode._static_run, how, max_batch, model.device)
    return engine


def test_capture_needs_cuda():
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        EngineConfig(model="x", cuda_graphs=True)


def test_cuda_graphs_default_on_for_one_cuda_rank_only():
    assert not EngineConfig(model="x").uses_cuda_graphs
    assert EngineConfig(model="x", device="cuda").uses_cuda_graphs
    assert not EngineConfig(model="x", device="cuda", cuda_graphs=False).uses_cuda_graphs
    assert not EngineConfig(model="x", device="cuda", tensor_parallel_size=2).uses_cuda_graphs


def _params(i: int) -> DecodeParams:
    """CAI (rows start blocks at different steps, so dual and full forwards share a step), the fixed
    schedule (long runs of dual steps, with refreshes) and Fast-dLLM's threshold, two block lengths."""
    policy = ("cai", "fixed", "threshold")[i % 3]
    return DecodeParams(policy=policy, gen_length=64, block_length=16 if i % 4 else 32, steps=32,
                        cache="prefix" if i % 4 == 1 else "dual", refresh_interval=8 if i % 2 else 0)


def _decode(engine: Engine, prompts: list[list[int]],
            on_progress: Optional[Callable[[float], None]] = None) -> list[tuple[int, ...]]:
    results = engine.generate(prompts, [_params(i) for i in range(len(prompts))], on_progress=on_progress)
    return [tuple(r.generated_ids) for r in results]


@pytest.mark.parametrize("name", ["llada-tiny", "dream-tiny"])
def test_static_dual_forward_decodes_what_the_cached_forward_decodes(name):
    """Held-out prompts of different lengths (the store grows while rows run, so the static buffers
    are made anew), more requests than rows (rows join in freed slots, out of order), and every step
    kind, every pass made run again on idle inputs after each step (what a capture warms up on): the
    same tokens, step by step, as the engine's ordinary dual-cache forward."""
    model, tokenizer = load_model(MODELS / name), load_tokenizer(MODELS / name)
    problems = held_out_problems(20, 1)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p.prompt}]) for p in problems]
    prompts.sort(key=len)  # longer prompts arrive later: the store grows mid-run
    ordinary = _decode(Engine.from_model(model, max_batch=6), prompts)
    engine = _static_engine(model, 6)
    assert _decode(engine, prompts, idle_passes(engine)) == ordinary
    assert engine.mode.static_forwards.made > 0, "the static forward ran"


@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_a_static_cached_step_gives_the_ordinary_steps_logits(llada_model, cache):
    """After every row's full forward, the next (cached) step's logits on static buffers equal the
    ordinary forward's: a prefix step refreshes everything after the block, a dual step nothing."""
    params = DecodeParams(policy="fixed", gen_length=16, block_length=8, steps=16, cache=cache, ignore_eos=True)
    logits = []
    for engine in (Engine.from_model(llada_model, max_batch=4), _static_engine(llada_model, 4)):
        for prompt in ([5, 6, 7], [8, 9], [10, 11, 12, 13]):
            engine.add_request(prompt, params)
        engine.step()
        running = engine.scheduler.running
        assert all(engine.mode.plan(r).kind == cache for r in running)
        logits.append(engine.runner.run(Batch.build(running, engine.mode.plan, llada_model.device)).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_static_dual_forward_leaves_other_slots_caches_alone(llada_model):
    """A static forward over slots [0, bucket) in which only slot 2 takes part changes no key or value
    of another slot but in the scratch column, and slot 2's only at its block and that column."""
    engine = _static_engine(llada_model, 4)
    params = DecodeParams(policy="fixed", gen_length=16, block_length=8, steps=16, cache="dual")
    for prompt in ([5, 6, 7], [8, 9], [10, 11, 12, 13]):
        engine.add_request(prompt, params)
    engine.step()  # every row's full forward: the store holds their caches
    runner = engine.runner
    row = engine.scheduler.running[2]
    assert row.slot == 2
    block = slice(row.block_start, row.block_start + row.block_length)
    with torch.inference_mode():  # the engine's state is made in inference mode (Engine.step)
        for keys in engine.slots.store.keys:
            keys[2, :, block] = 0  # so that the dual forward's writes show
    before = [k.clone() for k in engine.slots.store.keys]
    row.step = 1  # a dual step of slot 2 alone
    inputs = runner.run(Batch.build([row], engine.mode.plan, llada_model.device))
    assert inputs.logits.shape[0] == 1
    scratch = engine.slots.store.width - 1
    assert not engine.slots.store.key_mask[:, scratch].any(), "no row attends the scratch column"
    for old, new in zip(before, engine.slots.store.keys, strict=True):
        assert torch.equal(old[[0, 1, 3], :, :scratch], new[[0, 1, 3], :, :scratch])
        untouched = torch.ones(scratch, dtype=torch.bool)
        untouched[block] = False
        assert torch.equal(old[2][:, :scratch][:, untouched], new[2][:, :scratch][:, untouched])
        assert (new[2][:, block] != 0).all()


def test_the_static_dual_forward_compiles_whole_and_decodes_the_same(llada_model):
    """torch.compile(fullgraph=True) of the dual step (a graph break raises), one bucket and one
    block length: the tokens of the eager static forward; the keys and values written in place (no
    copy of the store)."""
    params = DecodeParams(policy="fixed", gen_length=16, block_length=8, steps=16, cache="dual")
    eager = _static_engine(llada_model, 1).generate([[5, 6, 7]], params)
    torch._dynamo.reset()
    compiled = _static_engine(llada_model, 2, how="compile")  # bucket 1 of two slots
    results: list = []
    code = compiled_code(lambda: results.extend(compiled.generate([[5, 6, 7]], params)))
    assert results[0].generated_ids == eager[0].generated_ids
    assert compiled.mode.static_forwards.made > 0
    store = compiled.slots.store
    assert not copies_whole(code, store.keys + store.values)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_decode_what_the_eager_engine_decodes():
    model = load_model(MODELS / "llada-tiny", device="cuda")
    tokenizer = load_tokenizer(MODELS / "llada-tiny")
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p.prompt}]) for p in held_out_problems(12, 2)]
    prompts.sort(key=len)
    eager = _decode(Engine.from_model(model, max_batch=4), prompts)
    engine = Engine.from_model(model, max_batch=4, cuda_graphs=True)
    assert _decode(engine, prompts) == eager
    assert engine.mode.static_forwards.how == "graph" and engine.mode.static_forwards.made > 0
