"""The block-diffusion cached step on static, slot-indexed buffers (engine.static_forward): the forward
that CUDA graphs capture and torch.compile compiles. Run eagerly it must decode exactly what the
ordinary (packed) cached forward decodes; compiled with fullgraph=True it must compile (no graph
break) and decode the same."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import compiled_code, copies_whole, idle_passes, ordinary_ids

from engine import DecodeParams, Engine, EngineConfig, load_model
from engine.chat import chat_prompt_ids
from engine.errors import SettingError
from engine.loading.tokenizer import load_tokenizer
from engine.static_forward import StaticForwards
from tinymodels.evaluate import held_out_problems

MODELS = Path(__file__).resolve().parents[2] / "models"


def _static_engine(model, max_batch: int, how: str = "eager") -> Engine:  # type: ignore[no-untyped-def]
    engine = Engine.from_model(model, max_batch=max_batch)
    engine.mode.static_forwards = StaticForwards(engine.mode._static_run, how, max_batch, model.device)
    return engine


def _block_checkpoints(fixtures: Path, llada2_dir: Path) -> list[Path]:
    """The SDAR fixture checkpoints and a random LLaDA2 MoE of the fixture's layout (the fixture's own
    config names no mask id)."""
    return [p.parent for p in sorted((fixtures / "block" / "sdar").glob("*/config.json"))] + [llada2_dir]


def _params(i: int, block: int, policy: str) -> DecodeParams:
    """Rows of one policy whose blocks start at different steps; some write finished blocks by
    SDAR's store pass, some let them ride along the next block's first step."""
    return DecodeParams(policy=policy, gen_length=(3 + i % 3) * block, block_length=block, steps=(3 + i % 3) * block,
                        threshold=0.5, editing_threshold=0.3, ignore_eos=True, store_pass=i % 4 == 1)


@pytest.mark.parametrize("policy", ["block-static", "block-dynamic", "cai", "block-edit"])
def test_static_block_forward_decodes_what_the_packed_forward_decodes(fixtures, llada2_dir, policy):
    """Every block fixture checkpoint (SDAR, LLaDA2's MoE), more requests than rows (rows join in freed
    slots while others run), prompts of different lengths (the store grows mid-run, so the static
    buffers are made anew), every pass made run again on idle inputs after each step (what a capture
    warms up on): the same tokens and forwards as the ordinary cached forward."""
    for path in _block_checkpoints(fixtures, llada2_dir):
        model = load_model(path)
        block = Engine.from_model(model).model_block_length
        prompts = ordinary_ids(model, (3, 2 * block + 1, block, 5 * block - 1, 1, 3 * block), seed=11)
        params = [_params(i, block, policy) for i in range(len(prompts))]
        if policy != "block-edit":
            params = [p.with_overrides(store_pass=p.store_pass and model.config.moe is None) for p in params]
        ordinary = Engine.from_model(model, max_batch=4).generate(prompts, params)
        engine = _static_engine(model, 4)
        static = engine.generate(prompts, params, on_progress=idle_passes(engine))
        for a, b in zip(ordinary, static, strict=True):
            assert (a.generated_ids, a.stats.nfe) == (b.generated_ids, b.stats.nfe), path.name
        assert engine.mode.static_forwards.made > 0, "the static forward ran"


def test_the_built_in_block_model_answers_the_same_on_static_buffers():
    """sdar-tiny on held-out chat problems, batched with CAI: the same texts."""
    model, tokenizer = load_model(MODELS / "sdar-tiny"), load_tokenizer(MODELS / "sdar-tiny")
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p.prompt}]) for p in held_out_problems(12, 3)]
    params = DecodeParams(policy="cai", gen_length=32)
    ordinary = Engine.from_model(model, max_batch=8).generate(prompts, params)
    engine = _static_engine(model, 8)
    static = engine.generate(prompts, params)
    assert [r.generated_ids for r in static] == [r.generated_ids for r in ordinary]
    assert engine.mode.static_forwards.made > 0, "the static forward ran"


def test_the_static_block_forward_compiles_whole_and_decodes_the_same(fixtures, llada2_dir):
    """torch.compile(fullgraph=True) of the static forward (a graph break raises): on the smallest
    SDAR fixture, one bucket and the fed lengths of a denoising step and a block's first step, the
    tokens of the eager static forward; the keys and values written in place (no copy of the store)."""
    model = load_model(_block_checkpoints(fixtures, llada2_dir)[0])
    block = model.block_size
    [prompt] = ordinary_ids(model, (block,), seed=3)
    params = DecodeParams(policy="block-static", gen_length=2 * block, block_length=block, steps=2 * block,
                          ignore_eos=True)
    eager = _static_engine(model, 1).generate([prompt], params)
    torch._dynamo.reset()
    compiled = _static_engine(model, 2, how="compile")  # bucket 1 of two slots
    results: list = []
    code = compiled_code(lambda: results.extend(compiled.generate([prompt], params)))
    assert results[0].generated_ids == eager[0].generated_ids
    assert compiled.mode.static_forwards.made > 0
    store = compiled.slots.store
    assert not copies_whole(code, store.keys + store.values)


def test_static_forwards_follow_the_engine_config():
    assert EngineConfig(model="x").static_forwards is None
    assert EngineConfig(model="x", torch_compile=True).static_forwards == "compile"
    assert EngineConfig(model="x", device="cuda").static_forwards == "graph"
    assert EngineConfig(model="x", device="cuda", cuda_graphs=False).static_forwards is None
    with pytest.raises(ValueError, match="torch_compile is not available with tensor_parallel_size > 1"):
        EngineConfig(model="x", torch_compile=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        StaticForwards(lambda x, key: x["ids"], "graph", 4, torch.device("cpu"))


def test_a_float32_moe_compiles_dense_and_keeps_its_eager_steps_under_graphs(llada2_dir):
    """torch's grouped GEMM, the experts' kernel without a host read, takes bfloat16: a float32 MoE
    compiles with the dense kernel (engine.models.moe), and under CUDA graphs' default decodes
    eagerly; quantized experts (one linear pair per expert) refuse --torch-compile naming the flag."""
    model = load_model(llada2_dir)
    assert Engine.from_model(model, torch_compile=True).mode.static_forwards.how == "compile"
    engine = Engine.from_model(model)
    # the mode as CUDA graphs' default makes it (on a CPU, where a graph would be refused)
    assert type(engine.mode)(model, engine.slots, "graph").static_forwards is None
    with pytest.raises(SettingError, match="--torch-compile"):
        Engine.from_model(load_model(llada2_dir, quantization="int8"), torch_compile=True)
