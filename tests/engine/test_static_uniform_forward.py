"""The uniform-noise decoder pass (DiffusionGemma) on static, slot-indexed buffers (engine.static_forward):
the forward CUDA graphs capture and torch.compile compiles. Run eagerly, each of its passes must give
the ordinary decoder pass's logits for the rows that take part, while idle slots (free, or stale from
an earlier request) write nothing a row reads; compiled with fullgraph=True it must compile whole and
decode the same. Its experts run by the `dense` kernel when compiled in float32 (engine.models.moe)."""

from __future__ import annotations

import pytest
import torch
from conftest import FIXTURES, compiled_code, copies_whole, ordinary_ids

from engine import load_model
from engine.decoding.params import DecodeParams
from engine.engine import Engine
from engine.host_reads import count_host_reads
from engine.models.moe import GroupedExperts
from engine.static_forward import StaticForwards
from engine.uniform_mode import ENCODE

CHECKPOINT = FIXTURES / "diffusion_gemma" / "dg_tiny"


@pytest.fixture(scope="module")
def model():
    return load_model(CHECKPOINT)


def _static_engine(model, max_batch: int, how: str = "eager") -> Engine:  # type: ignore[no-untyped-def]
    engine = Engine.from_model(model, max_batch=max_batch)
    engine.mode.static_forwards = StaticForwards(engine.mode._static_run, how, max_batch, model.device)
    return engine


def _prompts(model, lengths: tuple[int, ...]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [[model.special.bos_id, *ids] for ids in ordinary_ids(model, lengths, seed=5)]


def _params(i: int, canvas: int) -> DecodeParams:
    """Rows of different lengths and step counts, so that canvases start at different steps."""
    return DecodeParams(gen_length=(1 + i % 3) * canvas, max_denoising_steps=3 + i % 4, seed=i, ignore_eos=True)


def test_every_static_decoder_pass_gives_the_ordinary_logits(model):
    """More requests than rows (rows join freed slots, whose stale caches stay behind), prompts long
    enough to grow the store mid-run: at every step, the static pass's logits of the rows that take
    part are the ordinary pass's over the rows' exact width; the tokens are the ordinary engine's."""
    canvas = model.canvas_length
    prompts = _prompts(model, (2, 3 * canvas + 1, canvas, 5, 6 * canvas - 1, 1))
    params = [_params(i, canvas) for i in range(len(prompts))]
    ordinary = Engine.from_model(model, max_batch=3).generate(prompts, params)
    engine = _static_engine(model, 3)
    static_forward, slots, compared = engine.mode.static_forwards.forward, engine.slots, []

    def checked(key, buffers, owner, at, rows):  # type: ignore[no-untyped-def]
        if key[-1] == ENCODE:  # a commit pass: test_static_commit_passes_cache_what_the_ordinary_ones_cache
            return static_forward(key, buffers, owner, at, rows)
        width = int(slots.store.length[at].max()) + canvas
        expected = model.decode(rows["canvas"], slots.store, rows=at, self_conditioning=rows["soft"], width=width)
        logits = static_forward(key, buffers, owner, at, rows)
        # float32 rounding only: more columns (all masked) and idle rows change the sums' order
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        compared.append(key)
        return logits

    engine.mode.static_forwards.forward = checked
    static = engine.generate(prompts, params)
    assert [r.generated_ids for r in static] == [r.generated_ids for r in ordinary]
    assert len({key[1] for key in compared}) > 1, "passes over more than one column count"
    assert engine.mode.static_forwards.made > 1


def test_static_commit_passes_cache_what_the_ordinary_ones_cache(model):
    """The two engines in lockstep, more requests than rows: after every step each running row's cache
    (every layer's keys and values of its positions, ring included, its key mask and length) is the
    ordinary engine's, though idle slots ran through every static commit pass."""
    canvas = model.canvas_length
    prompts = _prompts(model, (2, 2 * canvas + 1, canvas, 5, 3 * canvas - 1))
    engines = [Engine.from_model(model, max_batch=3), _static_engine(model, 3)]
    for engine in engines:
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, _params(i, canvas), f"r{i}")
    commits = 0
    while engines[0].has_unfinished():
        for engine in engines:
            engine.step()
        rows = [{r.request_id: r.slot for r in engine.scheduler.running} for engine in engines]
        assert rows[0] == rows[1]
        ordinary, static = (engine.slots.store for engine in engines)
        for slot in rows[0].values():
            length = int(ordinary.length[slot])
            assert length == int(static.length[slot])
            assert torch.equal(ordinary.attendable[slot, :length], static.attendable[slot, :length])
            for layer, sliding in enumerate(ordinary.sliding):
                seen = slice(None) if sliding else slice(0, length)
                for a, b in ((ordinary.keys, static.keys), (ordinary.values, static.values)):
                    torch.testing.assert_close(b[layer][slot, :, seen], a[layer][slot, :, seen], atol=1e-5, rtol=0)
        commits = sum(1 for key in engines[1].mode.static_forwards.keys if key[-1] == ENCODE)
    assert not engines[1].has_unfinished()
    assert commits > 0, "a commit pass ran on static buffers"


def test_a_pass_on_idle_inputs_changes_nothing_a_row_reads(model):
    """What a CUDA graph's capture warms up on (StaticForwards.run_idle): after every step, every pass
    made so far, commit passes included, runs once more on idle inputs; each slot's length, key mask,
    ring and full-layer positions below its length stay as they were, and the tokens are those of
    the same engine without the extra passes."""
    canvas = model.canvas_length
    prompts = _prompts(model, (2, 2 * canvas + 1, canvas, 5, 3 * canvas - 1))
    params = [_params(i, canvas) for i in range(len(prompts))]
    plain = _static_engine(model, 3).generate(prompts, params)
    engine = _static_engine(model, 3)
    forwards, store = engine.mode.static_forwards, engine.slots.store

    def idle_passes(done: float) -> None:
        before = {"length": store.length.clone(), "attendable": store.attendable.clone(),
                  "keys": [k.clone() for k in store.keys], "values": [v.clone() for v in store.values]}
        with torch.inference_mode():  # as the step runs
            for key in forwards.keys:
                forwards.run_idle(key)
        assert torch.equal(store.length, before["length"])
        assert torch.equal(store.attendable, before["attendable"])
        for slot, length in enumerate(before["length"].tolist()):
            for layer, sliding in enumerate(store.sliding):
                seen = slice(None) if sliding else slice(0, length)
                for name in ("keys", "values"):
                    assert torch.equal(getattr(store, name)[layer][slot, :, seen], before[name][layer][slot, :, seen])

    idle = engine.generate(prompts, params, on_progress=idle_passes)
    assert [r.generated_ids for r in idle] == [r.generated_ids for r in plain]
    assert any(key[-1] == ENCODE for key in forwards.keys), "a commit pass ran on idle inputs"


def test_one_host_read_a_step_on_static_buffers(model):
    """The static pass adds no read-back: one device-to-host read per step, as the ordinary one (the
    experts by the kernel a compiled pass runs: the plain one reads each layer's expert counts)."""
    engine = _static_engine(model, 2)
    for i, prompt in enumerate(_prompts(model, (4, 9))):
        engine.add_request(prompt, _params(i, model.canvas_length), f"r{i}")
    model.set_moe_kernel("dense")
    try:
        while engine.has_unfinished():
            with count_host_reads() as reads:
                engine.step()
            assert reads.count == 1, reads.by_method
    finally:
        model.set_moe_kernel(None)
    assert engine.mode.static_forwards.made > 0


def test_the_static_passes_compile_whole_and_decode_the_same(model):
    """torch.compile(fullgraph=True) of the decoder and encoder passes (a graph break raises), one
    bucket: the tokens of the eager static passes; the full layers' keys and values written in
    place (no copy of the store; a sliding ring is rewritten whole, from its old columns)."""
    [prompt] = _prompts(model, (3,))
    params = _params(1, model.canvas_length)
    eager = _static_engine(model, 1).generate([prompt], params)
    torch._dynamo.reset()
    compiled = _static_engine(model, 1, how="compile")
    results: list = []
    code = compiled_code(lambda: results.extend(compiled.generate([prompt], params)))
    assert results[0].generated_ids == eager[0].generated_ids
    store = compiled.slots.store
    full = [t for tensors in (store.keys, store.values)
            for t, sliding in zip(tensors, store.sliding, strict=True) if not sliding]
    assert full and not copies_whole(code, full)
    assert any(key[-1] == ENCODE for key in compiled.mode.static_forwards.keys), "an encoder pass compiled"
    assert any(key[-1] != ENCODE for key in compiled.mode.static_forwards.keys), "a decoder pass compiled"


def test_the_dense_kernel_computes_only_this_ranks_experts(model):
    """An expert-parallel rank's share (half the experts, from the second): the dense kernel's sum is
    the plain kernel's, pairs routed to other ranks' experts adding nothing."""
    whole = next(m for m in model.modules() if isinstance(m, GroupedExperts))
    size, hidden, experts = whole.intermediate_size, whole.hidden_size, whole.num_experts
    share = GroupedExperts(hidden, size, experts, first=1, count=experts // 2, activation=whole.activation,
                           stacked=True)
    gate_up, down = whole.stacked_weights()
    share.gate_up_proj.data = gate_up[1:1 + experts // 2].clone()
    share.down_proj.data = down[1:1 + experts // 2].clone()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, hidden, generator=gen)
    top_k = model.gemma.experts_per_token
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(7)])
    weights = torch.rand(7, top_k, generator=gen)
    sums = {}
    for kernel in ("plain", "dense"):
        share.kernel = kernel
        with torch.no_grad():
            sums[kernel] = share.forward(x, ids, weights)
    torch.testing.assert_close(sums["dense"], sums["plain"], atol=1e-6, rtol=0)
    assert sums["dense"].abs().sum() > 0
