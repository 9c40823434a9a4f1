"""DiffusionGemma under tensor parallelism (gloo on CPU, this process and spawned workers): its
sliding and full layers' heads split (the full layers' few KV heads replicated past their count,
the shared K=V ones included), the dense and self-conditioning MLPs and the routed experts split,
the vocabulary whole on every rank. Logits through the encoder and decoder passes equal TP1's, each
rank reads only the slices it holds, a size that fits neither KV rule is refused naming both, and
`diffusiongemma-tiny` decodes a seeded request (and a greedy one) at TP SIZE and 2 x SIZE exactly as
at TP1.

Sizes, ids and inputs come from the files: the built-in model (its config, pad id, chat template and
held-out problems) runs in the module's TP group of each size, one after the other (a process holds
one group at a time); the
loader's per-rank reads and the size rules are checked on it and on the parity fixture
(CAI_DLLM_FIXTURES may point at another set of the same layout) without a group. A checkpoint that
SIZE ranks cannot split is skipped, naming the count.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES, REPO
from tp_calls import uniform_passes

from engine import DecodeParams, Engine, EngineConfig, load_model, start_engine
from engine.chat import chat_prompt_ids
from engine.errors import TensorParallelError
from engine.loading.checkpoint import CheckpointFiles
from engine.loading.weights import plan_weights
from engine.models.parallel.group import TensorParallel
from engine.models.parallel.sharding import check_divisible, divisible_sizes, kv_head_counts
from engine.models.registry import model_class_for
from tinymodels.evaluate import held_out_problems, model_mix

SIZE = 2
# float32 at the logits' scale, as tests/engine/test_tensor_parallel.py: the ranks' partial sums add
# in another order than one device's matmul. Gemma's norms after each sum (its sandwich norms) can
# scale that rounding up: on the parity fixture's model TP2 is 1.2e-4 from TP1 (1.5e-5 x the logits'
# std) while TP1's own float32 logits are 1.4e-4 from float64's; on diffusiongemma-tiny 3.0e-5 (0.9e-5
# x std), TP1 3.0e-5 from float64. So the bound is the larger of the other families' and twice TP1's
# own float32 rounding (measured against float64 in the test).
LOGITS_TOLERANCE = 1e-5
ROUNDING_FACTOR = 2.0
CHECKPOINT = FIXTURES / "diffusion_gemma" / "dg_tiny"
BUILTIN = REPO / "models" / "diffusiongemma-tiny"
PROMPTS = 2  # held-out problems asked of the built-in model
GEN_LENGTH = 16  # two canvases of the built-in model's 8 (a commit pass between them)
CANVASES = 3  # decoder passes of the logits check: plain, self-conditioned, after a commit pass
CANVAS_SEED = 0


def _config(checkpoint: Path) -> Any:
    hf = json.loads((checkpoint / "config.json").read_text())
    return model_class_for(hf).parse_config(hf)


def _skip_unless_splittable(checkpoint: Path, size: int = SIZE) -> None:
    try:
        check_divisible(_config(checkpoint), size)
    except TensorParallelError as err:
        pytest.skip(f"{checkpoint.name} cannot be split {size} ways: {err}")


@pytest.fixture(scope="module", params=[SIZE, 2 * SIZE], ids=lambda size: f"tp{size}")
def builtin(request: pytest.FixtureRequest) -> Any:
    """(the TP1 engine, the tensor-parallel engine, held-out prompts, its size) of the built-in model,
    at SIZE and twice SIZE ranks (past the full layers' KV heads: replicated): the one group of this
    module at a time (a process holds one)."""
    if not (BUILTIN / "model.safetensors").is_file():
        pytest.skip(f"the built-in model {BUILTIN.name} is not committed here")
    size = request.param
    _skip_unless_splittable(BUILTIN, size)
    reference = Engine(EngineConfig(model=str(BUILTIN), max_batch=PROMPTS))
    problems = held_out_problems(PROMPTS, seed=0, mix=model_mix(str(BUILTIN)))
    prompts = [chat_prompt_ids(reference.tokenizer, [{"role": "user", "content": p.prompt}]) for p in problems]
    engine = start_engine(EngineConfig(model=str(BUILTIN), tensor_parallel_size=size, max_batch=PROMPTS))
    yield reference, engine, prompts, size
    engine.close()


def _forward_inputs(model: Any, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The prompts left-padded with the checkpoint's pad id (as the official processor pads them),
    and CANVASES canvases of random ids, as a request's canvases start."""
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[model.special.pad_id] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    generator = torch.Generator().manual_seed(CANVAS_SEED)
    canvases = [torch.randint(0, model.config.vocab_size, (len(prompts), model.canvas_length), generator=generator)
                for _ in range(CANVASES)]
    return ids, mask, canvases


def test_logits_at_tp_equal_tp1(builtin: Any) -> None:
    """Encoder, decoder, self-conditioned decoder and a decoder after a commit pass."""
    reference, engine, prompts, _ = builtin
    model = reference.model
    ids, mask, canvases = _forward_inputs(model, prompts)
    want = uniform_passes(model, ids, mask, canvases)
    exact = uniform_passes(load_model(BUILTIN).double(), ids, mask, canvases)
    rounding = (want - exact).abs().max().item()
    [got] = engine.collective_rpc("tp_calls:uniform_forward", ids, mask, canvases)
    assert got.shape == want.shape
    error = (got - want).abs().max().item()
    assert error <= max(LOGITS_TOLERANCE * max(1.0, want.std().item()), ROUNDING_FACTOR * rounding), (error, rounding)


def test_each_rank_holds_its_heads_experts_and_mlp_share_and_the_whole_vocabulary(builtin: Any) -> None:
    reference, engine, _, size = builtin
    config = reference.model.config
    gemma = config.gemma
    whole = {name: tuple(p.shape) for name, p in reference.model.named_parameters()}
    ranks = engine.collective_rpc("tp_calls:shard_shapes", results=True)
    assert len(ranks) == size
    for name, shape in whole.items():
        shapes = [rank[name] for rank in ranks]
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert all(s[0] * size == gemma.num_experts == shape[0] for s in shapes), name
        elif name.endswith("qkv_proj.weight"):
            kind = gemma.attention(int(name.split(".")[1]))
            kv = TensorParallel(0, size).kv_split(kind.num_kv_heads)[1]
            parts = 2 if kind.values_from_keys else 3  # q|k, or q|k|v
            local = (config.num_heads // size + (parts - 1) * kv) * kind.head_dim
            assert all(s[0] == local for s in shapes), name
        elif name.endswith("gate_up_proj.weight"):
            assert all(s[0] * size == shape[0] for s in shapes), name
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert all(s[1] * size == shape[1] for s in shapes), name
        else:  # the embedding (the tied head), norms, the router, scalars: replicated
            assert all(s == shape for s in shapes), name


@pytest.mark.parametrize("checkpoint", [CHECKPOINT, BUILTIN], ids=["fixture", "builtin"])
def test_each_rank_reads_only_the_slices_it_holds(checkpoint: Path) -> None:
    """The loader's plan for every rank reads as many elements as the rank's parameters hold, and
    the ranks' reads of the routed experts are disjoint (nothing is read twice that is split)."""
    if not (checkpoint / "config.json").is_file():
        pytest.skip(f"{checkpoint} is not here")
    _skip_unless_splittable(checkpoint)
    files = CheckpointFiles.open(checkpoint)
    cls = model_class_for(files.config)
    config = cls.parse_config(files.config)
    expert_rows: dict[str, list[tuple[int, int]]] = {}
    for rank in range(SIZE):
        with torch.device("meta"):
            model = cls(config, None, files.config, TensorParallel(rank, SIZE))
        plan = plan_weights(model, files.weight_files())
        read = 0
        for placement in (p for placements in plan.values() for p in placements):
            shape = list(placement.entry.shape)
            if placement.read.rows is not None:
                shape[0] = placement.read.rows[1]
            if placement.read.columns is not None:
                shape[1] = placement.read.columns[1]
            read += torch.Size(shape).numel()
            if placement.param.endswith("experts.gate_up_proj"):
                expert_rows.setdefault(placement.param, []).append(placement.read.rows)
        held = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        assert read == held, (rank, read, held)
    share = config.gemma.num_experts // SIZE
    for param, rows in expert_rows.items():
        assert sorted(rows) == [(rank * share, share) for rank in range(SIZE)], param


def test_divisible_sizes_name_both_kinds_of_kv_heads_and_a_misfit_is_refused_naming_both_rules() -> None:
    config = _config(CHECKPOINT)
    gemma = config.gemma
    counts = kv_head_counts(config)
    assert counts == {"sliding-layer KV heads": gemma.sliding.num_kv_heads,
                      "full-layer KV heads": gemma.full.num_kv_heads}
    sizes = divisible_sizes(config, SIZE)
    assert sizes["routed experts"] == gemma.num_experts and sizes["MLP intermediate size"] == config.intermediate_size
    for what, count in counts.items():  # a KV count is a rule only where the size is no multiple of it
        assert (what in sizes) == (SIZE % count != 0)
    # a size that divides the heads but neither divides nor is a multiple of the sliding layers' KV heads
    kv = 2 * SIZE
    misfit = 3 * SIZE
    odd = replace(config, num_heads=kv * misfit, num_kv_heads=kv,
                  gemma=replace(gemma, sliding=replace(gemma.sliding, num_kv_heads=kv)))
    with pytest.raises(TensorParallelError) as err:
        check_divisible(odd, misfit)
    message = str(err.value)
    assert f"does not divide the model's {kv} sliding-layer KV heads" in message
    assert (f"divides or is a multiple of its {kv} sliding-layer KV heads and its {gemma.full.num_kv_heads} "
            "full-layer KV heads") in message


# ---- decoding through the engine -----------------------------------------------------------------

# a sampling temperature scales the uniform schedule; 0 (greedy) keeps it, and still draws the canvases
@pytest.mark.parametrize("sampling", [{"temperature": 0.7, "seed": 7}, {"temperature": 0.0, "seed": 3}],
                         ids=["seeded", "greedy"])
def test_builtin_gives_tp1_tokens(builtin: Any, sampling: dict[str, Any]) -> None:
    reference, engine, prompts, _ = builtin
    params = [DecodeParams(gen_length=GEN_LENGTH, ignore_eos=True, **{**sampling, "seed": sampling["seed"] + i})
              for i in range(len(prompts))]
    want = [r.generated_ids for r in reference.generate(prompts, params)]
    assert [r.generated_ids for r in engine.generate(prompts, params)] == want
    assert len(set(engine.collective_rpc("engine.executor.calls:state_digest", results=True))) == 1


def test_an_unseeded_greedy_request_draws_alike_on_every_rank(builtin: Any) -> None:
    """Its canvases start random whatever the temperature: rank 0 gives it a seed for every rank, so
    every rank's generator is in the same state after a step (the tokens alone cannot show it: the
    tiny model decodes the same canvas from most noise)."""
    _, engine, prompts, _ = builtin
    engine.add_request(prompts[0], DecodeParams(gen_length=GEN_LENGTH, temperature=0.0, ignore_eos=True))
    engine.step()
    states = engine.collective_rpc("tp_calls:draw_states", results=True)
    while engine.has_unfinished():
        engine.step()
    assert any(state is not None for state in states[0])
    assert all(ranks == states[0] for ranks in states)
    assert len(set(engine.collective_rpc("engine.executor.calls:state_digest", results=True))) == 1
