"""The step API (`Engine.add_request / step / abort / has_unfinished`): one host read per step,
per-step deltas, and the output path fed by them (streamed text identical to the whole response)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import DecodeParams, Engine, load_model
from engine.chat import chat_prompt_ids
from engine.decoding.decide import POLICIES
from engine.host_reads import count_host_reads
from server.output import ChoiceOutput
from tinymodels.evaluate import held_out_problems

ALL_POLICIES = sorted(POLICIES)


@pytest.fixture(scope="module")
def tiny_engine_parts():
    from engine.loading.tokenizer import load_tokenizer

    path = Path(__file__).resolve().parents[1] / "models" / "llada-tiny"
    return load_model(path), load_tokenizer(path)


@pytest.fixture(scope="module")
def held_out_prompts(tiny_engine_parts):
    _, tokenizer = tiny_engine_parts
    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": p.prompt}]) for p in held_out_problems(100, 0)]


def _mixed_params(i: int, cache: str) -> DecodeParams:
    """Every policy, sampling, top-k/top-p and guidance somewhere in the batch."""
    policy = ALL_POLICIES[i % len(ALL_POLICIES)]
    return DecodeParams(policy=policy, gen_length=32, block_length=8 if i % 2 else 16, cache=cache,
                        early_exit=i % 3 != 0, temperature=0.7 if i == 3 else 0.0, seed=i,
                        top_k=5 if i == 2 else None, top_p=0.9 if i == 4 else None,
                        cfg_scale=1.0 if i == 5 and cache == "none" else 0.0)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_one_host_read_per_step_whatever_the_batch(llada_model, dream_model, cache):
    for model in (llada_model, dream_model):
        engine = Engine.from_model(model, max_batch=8)
        for i in range(11):  # more than a batch: rows join while others run
            engine.add_request([1 + i, 2, 3, 4][: 2 + i % 3], _mixed_params(i, cache))
        steps = 0
        while engine.has_unfinished():
            with count_host_reads() as reads:
                outputs = engine.step()
            assert reads.count == 1, reads.by_method
            assert outputs
            steps += 1
        assert steps > 1


def test_rows_in_slot_order_decide_as_gathered_rows(llada_model):
    """A full batch reads and writes its slot state as slices; the same rows gathered by slot index
    (the path of a batch with gaps) decide the same tokens, summary and CAI state, step after step."""
    import copy
    import dataclasses

    from engine.decoding.decide import STEP_FIELDS, DecodeState, StepRows, decide_step

    engine = Engine.from_model(llada_model, max_batch=6)  # two slots stay free
    for i, policy in enumerate(("cai", "cai", "threshold", "cai")):
        engine.add_request([1 + i, 2, 3], DecodeParams(policy=policy, gen_length=16, block_length=8, cache="dual",
                                                       theta_s=0.5 + 0.1 * i))
    _, admitted = engine.scheduler.schedule()
    state = DecodeState(6, llada_model.device)
    for request in admitted:
        state.admit(request)
    rows = StepRows.build(engine.scheduler.running, llada_model.device)
    assert rows.slot_rows == slice(0, 4)
    states = {True: state, False: copy.deepcopy(state)}
    mask_id = llada_model.special.mask_id
    end_ids = torch.tensor(llada_model.special.end_ids)
    generator = torch.Generator().manual_seed(0)
    blocks = {flag: torch.full((4, 8), mask_id) for flag in states}
    for step in range(3):
        logits = torch.randn(4, 8, llada_model.config.vocab_size, generator=generator) * 4
        out = {}
        for flag, decode_state in states.items():
            traits = dataclasses.replace(rows.traits, slot_rows=rows.slot_rows if flag else None)
            step_rows = dataclasses.replace(rows, traits=traits, fields=rows.fields.clone())
            step_rows.fields[:, STEP_FIELDS.index("step")] = step
            step_rows.fields[:, STEP_FIELDS.index("schedule_step")] = step  # every row is in its first block
            out[flag] = decide_step(decode_state, step_rows, logits, blocks[flag], torch.ones(4, 8, dtype=torch.bool),
                                    mask_id, end_ids)
            blocks[flag] = out[flag][0]
        assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])
        assert torch.equal(states[True].first_conf, states[False].first_conf)
        assert torch.equal(states[True].low_yield, states[False].low_yield)


def test_slot_ranges_are_slices_and_gaps_are_not():
    from types import SimpleNamespace

    from engine.request import slot_slice

    def rows(*slots):
        return [SimpleNamespace(slot=s) for s in slots]

    assert slot_slice(rows(0, 1, 2, 3)) == slice(0, 4)
    assert slot_slice(rows(2, 3, 4)) == slice(2, 5)  # what is left of a batch whose first rows finished
    assert slot_slice(rows(5)) == slice(5, 6)
    assert slot_slice(rows(1, 3, 5)) is None
    assert slot_slice(rows(1, 0)) is None  # out of order
    assert slot_slice([]) is None


def test_batch_traits_are_reused_only_for_the_same_rows(llada_model):
    """StepRows.build keeps the last step's host traits while the batch is the same requests, and
    makes new ones when a row joins or leaves (the traits hold the rows' slots and policies)."""
    from engine.decoding.decide import StepRows

    engine = Engine.from_model(llada_model, max_batch=4)
    for i, policy in enumerate(("cai", "threshold", "fixed")):
        engine.add_request([1 + i, 2, 3], DecodeParams(policy=policy, gen_length=16, block_length=8))
    engine.scheduler.schedule()
    running = list(engine.scheduler.running)
    first = StepRows.build(running, llada_model.device)
    again = StepRows.build(running, llada_model.device, first.traits)
    assert again.traits is first.traits
    fewer = StepRows.build(running[1:], llada_model.device, first.traits)
    assert fewer.traits is not first.traits
    assert fewer.traits.policies == frozenset({"threshold", "fixed"}) and fewer.slot_rows == slice(1, 3)
    assert fewer.fields.shape[0] == 2


def test_cai_reads_its_tabulated_schedule_as_cai_step_computes_it(llada_model):
    """The engine tabulates theta_b(t), the quarters and Box 5's tiers once per request; at any
    block and step, with any stored s_i and counter, it commits what `cai_step` decides from scratch."""
    from engine.decoding import policies as P
    from engine.decoding.decide import (
        _BOOL_KNOBS,
        _FLOAT_KNOBS,
        _INT_KNOBS,
        DecodeState,
        StepRows,
        cai_knobs,
        decide_step,
    )
    from engine.decoding.sampling import confidence, predict

    params = [DecodeParams(policy="cai", gen_length=64, block_length=16, steps=64),
              DecodeParams(policy="cai", gen_length=128, block_length=16, steps=64, gating=True,
                           block_schedule_mode="stretch"),
              DecodeParams(policy="cai", gen_length=32, block_length=32, steps=32, position_factors=False,
                           theta_s=0.95),
              DecodeParams(policy="cai", gen_length=64, block_length=8, steps=32, gating=True, warmup=0.5,
                           theta_e=0.3)]
    engine = Engine.from_model(llada_model, max_batch=4)
    for i, p in enumerate(params):
        engine.add_request([1 + i, 2, 3], p)
    _, admitted = engine.scheduler.schedule()
    state = DecodeState(4, llada_model.device)
    for request in admitted:
        state.admit(request)
    requests = engine.scheduler.running
    width, mask_id = 32, llada_model.special.mask_id
    lengths = torch.tensor([r.block_length for r in requests])
    in_block = torch.arange(width)[None, :] < lengths[:, None]
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        for r in requests:
            r.block = int(torch.randint(r.num_blocks, (1,), generator=generator))
            r.step = int(torch.randint(r.steps_per_block, (1,), generator=generator))
        rows = StepRows.build(requests, llada_model.device)
        logits = torch.randn(4, width, llada_model.config.vocab_size, generator=generator) * 3
        done = torch.rand(4, width, generator=generator) < 0.3
        block_tokens = torch.where(done, 5, mask_id)
        state.first_conf[:, :width] = torch.rand(4, width, generator=generator)
        state.low_yield[:] = torch.randint(0, 3, (4,), generator=generator)
        stored, counter = state.first_conf[:, :width].clone(), state.low_yield.clone()
        new_tokens, _ = decide_step(state, rows, logits, block_tokens, in_block, mask_id,
                                    torch.tensor(llada_model.special.end_ids))

        x0 = predict(logits, [], mask_id)
        conf = confidence(logits, x0, torch.zeros(4, dtype=torch.long), {0})
        candidates = (block_tokens == mask_id) & in_block
        step, block = rows.column("step"), rows.column("block")
        i = dict(zip(_INT_KNOBS, state.knobs_i[:, :len(_INT_KNOBS)].unbind(1), strict=True))
        knobs = cai_knobs(dict(zip(_FLOAT_KNOBS, state.knobs_f[:, :len(_FLOAT_KNOBS)].unbind(1), strict=True)), i,
                          dict(zip(_BOOL_KNOBS, state.knobs_b[:, :len(_BOOL_KNOBS)].unbind(1), strict=True)))
        expected = P.cai_step(conf, candidates, step, i["steps_per_block"], block, i["num_blocks"], i["block_length"],
                              P.CaiState(P.box2_first_step_confidence(conf, stored, step), counter), knobs)
        assert torch.equal(new_tokens != block_tokens, expected.commit)
        assert torch.equal(state.low_yield, expected.low_yield)
        assert rows.column("schedule_step").tolist() == [r.block * r.steps_per_block + r.step for r in requests]


def test_the_mask_token_is_never_predicted():
    from engine.decoding.sampling import predict

    logits = torch.tensor([[[0.0, 5.0, 1.0, 2.0], [3.0, 0.0, 1.0, 2.0]]])
    assert predict(logits, [], mask_id=1).tolist() == [[3, 0]]
    generator = torch.Generator().manual_seed(0)
    hot = logits[:, :1].expand(1, 64, 4).contiguous()  # the mask leads at every position
    assert 1 not in predict(hot, [(0, generator, 5.0)], mask_id=1).flatten().tolist()


def test_step_outputs_carry_deltas_work_and_the_result(llada_model):
    engine = Engine.from_model(llada_model, max_batch=4)
    ids = [engine.add_request([5, 6, 7], DecodeParams(policy=p, gen_length=16, block_length=8, cache="dual"))
           for p in ("cai", "fixed", "threshold")]
    streams: dict[str, list[int]] = {i: [] for i in ids}
    results = {}
    while engine.has_unfinished():
        for output in engine.step():
            assert output.fed_tokens > 0 and output.committed >= 0
            streams[output.request_id].extend(output.new_token_ids)
            if output.finished:
                assert output.request_id not in results and output.finish_reason in ("stop", "length")
                results[output.request_id] = output.result
    assert set(results) == set(ids)
    for request_id, result in results.items():
        end = result.end_index
        assert streams[request_id] == (result.generated_ids if end is None else result.generated_ids[:end + 1])
        assert sum(result.stats.tokens_per_step) <= 16


@pytest.mark.slow
@pytest.mark.parametrize("max_batch", [1, 8])
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_streamed_text_equals_the_whole_response(tiny_engine_parts, held_out_prompts, policy, max_batch):
    """100 held-out prompts: the text a stream sends (the output path fed each step's delta, with a
    stop string that can straddle deltas) equals the whole response (fed everything at once) and
    the offline text."""
    model, tokenizer = tiny_engine_parts
    engine = Engine.from_model(model, tokenizer, max_batch=max_batch)
    params = DecodeParams(policy=policy, gen_length=32, block_length=32, steps=16, cache="dual")
    end_ids = set(model.special.end_ids)
    streamed: dict[str, ChoiceOutput] = {}
    sent: dict[str, str] = {}
    results = {}
    for i, prompt in enumerate(held_out_prompts):
        request_id = engine.add_request(prompt, params, f"p{i}")
        streamed[request_id] = ChoiceOutput(i, request_id, prompt, tokenizer, end_ids, stops=[";="])
        sent[request_id] = ""
    while engine.has_unfinished():
        for output in engine.step():
            choice = streamed[output.request_id]
            choice.add(output.new_token_ids)
            if output.finished:
                choice.finish(output.result)
                results[output.request_id] = output.result
            sent[output.request_id] += choice.take()
    for request_id, result in results.items():
        whole = ChoiceOutput(0, request_id, [], tokenizer, end_ids, stops=[";="])
        whole.add(result.generated_ids)
        whole.finish(result)
        assert sent[request_id] == whole.text == whole.take()
        assert streamed[request_id].finish_reason == whole.finish_reason
        text = tokenizer.decode(result.response_ids, skip_special_tokens=True)  # the offline text
        assert text.startswith(whole.text) and (whole.stopped_by_string or text == whole.text)


@pytest.mark.slow
def test_compiled_decide_step_gives_the_same_tokens(llada_model):
    """EngineConfig.compile_decide: every policy, rows joining and leaving (the batch size changes),
    the same tokens and telemetry as the eager decide step; a sampling row takes the eager path."""
    for model in (llada_model,):  # each new mix of policies compiles anew: one model keeps CI short
        prompts = [[1 + i, 2, 3, 4][: 2 + i % 3] for i in range(10)]
        params = [_mixed_params(i, "dual") for i in range(10)]
        eager = Engine.from_model(model, max_batch=4).generate(prompts, params)
        compiled = Engine.from_model(model, max_batch=4, compile_decide=True).generate(prompts, params)
        for a, b in zip(eager, compiled, strict=True):
            assert a.generated_ids == b.generated_ids and a.finish_reason == b.finish_reason
            assert a.stats.as_dict() | {"wall_time": 0} == b.stats.as_dict() | {"wall_time": 0}
