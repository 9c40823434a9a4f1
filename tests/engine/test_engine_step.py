"""The step API (`Engine.add_request / step / abort / has_unfinished`): one host read per step,
per-step deltas, and the output path fed by them (streamed text identical to the whole response)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cache_views import cache_reads_in_place
from torch.overrides import TorchFunctionMode

from engine import DecodeParams, Engine, load_model
from engine.batch import Batch
from engine.chat import chat_prompt_ids
from engine.decoding.registry import MASKED, POLICIES
from engine.host_reads import count_host_reads
from server.output import ChoiceOutput
from tinymodels.evaluate import held_out_problems

# the policies masked diffusion serves (block-edit, LLaDA2.1's decoder, is for block-diffusion models
# only: the block tests below run it)
ALL_POLICIES = sorted(name for name, p in POLICIES.items() if MASKED in p.modes)
# the output path does not depend on the policy's rule: the masked-diffusion decoders cover it (the
# block decoders' rules are the rank and threshold rules again; tests/engine/test_block_engine.py runs them)
STREAMED_POLICIES = [p for p in ALL_POLICIES if not p.startswith("block-")]


@pytest.fixture(scope="module")
def tiny_engine_parts():
    from engine.loading.tokenizer import load_tokenizer

    path = Path(__file__).resolve().parents[2] / "models" / "llada-tiny"
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


BLOCK_POLICIES = ["block-dynamic", "block-edit", "block-sequential", "block-static", "cai", "fixed", "threshold"]


def _block_checkpoints(fixtures, tmp_path) -> list[Path]:
    """The block fixtures' checkpoints; a config without a mask id (LLaDA2's: `generate()` takes it
    as an argument) gets the one its golden runs use, and its pad id as eos."""
    import json

    found = []
    for config_file in sorted(fixtures.glob("block/*/*/config.json")):
        config = json.loads(config_file.read_text())
        if "mask_token_id" not in config:
            golden = sorted(config_file.parents[1].glob("golden/*.json"))
            config.update(mask_token_id=json.loads(golden[0].read_text())["settings"]["mask_id"],
                          eos_token_id=config["pad_token_id"])
            dest = tmp_path / config_file.parent.name
            dest.mkdir()
            (dest / "config.json").write_text(json.dumps(config))
            for weights in config_file.parent.glob("*.safetensors"):
                (dest / weights.name).symlink_to(weights)
            found.append(dest)
        else:
            found.append(config_file.parent)
    return found


def test_one_host_read_per_step_on_block_diffusion_models(fixtures, tmp_path, monkeypatch):
    """Rows at different blocks, block sizes, prompt tails, store passes, caches, masks and policies share steps
    with one host read a step, not counting the reads inside a forward (LLaDA2's plain MoE kernel
    reads its experts' token counts: a model-internal sync, see engine/models/moe.py)."""
    for checkpoint in _block_checkpoints(fixtures, tmp_path):
        model = load_model(checkpoint)
        current: dict = {"internal": 0}
        original = model.run_layers

        def run(*args, original=original, current=current, **kwargs):
            before = current["reads"].count
            out = original(*args, **kwargs)
            current["internal"] += current["reads"].count - before
            return out

        monkeypatch.setattr(model, "run_layers", run)
        engine = Engine.from_model(model, max_batch=4)
        for i in range(9):  # more than a batch: rows join while others run
            params = DecodeParams(policy=BLOCK_POLICIES[i % len(BLOCK_POLICIES)], gen_length=16,
                                  block_length=4 if i % 2 else 8, store_pass=i % 3 == 0, ignore_eos=i % 4 == 0,
                                  temperature=0.7 if i == 5 else 0.0, seed=i, threshold=0.5,
                                  cache="none" if i % 3 == 1 else None,  # window forwards, with either mask
                                  block_attention="additive_01" if i % 6 == 1 else "block_causal")
            engine.add_request([1 + i, 2, 3, 4, 5, 6][: 2 + i % 5], params)
        steps = 0
        while engine.has_unfinished():
            with count_host_reads() as reads:
                current.update(reads=reads, internal=0)
                outputs = engine.step()
            assert reads.count - current["internal"] == 1, reads.by_method
            assert outputs
            steps += 1
        assert steps > 1


def test_dual_and_prefix_rows_read_the_store_in_place_and_decode_as_alone(llada_model):
    """Rows joining and leaving (their slots compacted as they go) while others run dual- or
    prefix-cache steps: a cached forward runs over its rows' span of slots, a view of the store, the
    rows at their block's first step inside it feeding nothing; every row decodes as it does alone."""
    engine = Engine.from_model(llada_model, max_batch=3)
    params = [DecodeParams(policy="fixed", gen_length=8 * (1 + i % 3), block_length=8, steps=8 * (1 + i % 3),
                           cache="dual" if i % 2 else "prefix") for i in range(6)]
    prompts = [[1 + i, 2, 3, 4][:2 + i % 3] for i in range(6)]
    with cache_reads_in_place(engine) as checked:
        batched = engine.generate(prompts, params)
    assert checked[0] > 0
    for prompt, p, result in zip(prompts, params, batched, strict=True):
        alone = Engine.from_model(llada_model, max_batch=1).generate([prompt], p)[0]
        assert result.generated_ids == alone.generated_ids


def test_the_running_rows_hold_slots_0_to_n_in_row_order(llada_model):
    engine = Engine.from_model(llada_model, max_batch=4)
    ids = [engine.add_request([1 + i, 2, 3], DecodeParams(policy="fixed", gen_length=16, block_length=8, steps=16))
           for i in range(4)]
    engine.step()
    engine.abort(ids[0])
    engine.abort(ids[2])
    engine.step()
    running = engine.scheduler.running
    assert [r.request_id for r in running] == [ids[3], ids[1]]  # the last row moved into the first hole
    assert [r.slot for r in running] == [0, 1]
    batch = Batch.build(list(running), engine.mode.plan, llada_model.device)
    assert batch.span == slice(0, 2) and batch.fills_span


def test_the_decide_step_commits_what_cai_step_decides(llada_model):
    """Through the slot tables and the knob columns, at any block and step, with any stored s_i and
    counter, the engine's decide step commits what `cai_step` decides from the requests' knobs."""
    from engine.batch import ForwardOutput
    from engine.decoding import policies as P
    from engine.decoding.sampling import confidence, predict

    params = [DecodeParams(policy="cai", gen_length=64, block_length=16, steps=64),
              DecodeParams(policy="cai", gen_length=128, block_length=16, steps=64, gating=True,
                           block_schedule_mode="stretch"),
              DecodeParams(policy="cai", gen_length=32, block_length=32, steps=32, position_factors=False,
                           theta_s=0.95, eta_denominator="block", grinding_exit="fill"),
              DecodeParams(policy="cai", gen_length=64, block_length=8, steps=32, gating=True, warmup=0.5,
                           theta_e=0.3)]
    engine = Engine.from_model(llada_model, max_batch=4)
    for i, p in enumerate(params):
        engine.add_request([1 + i, 2, 3], p)
    for request in engine.scheduler.schedule():
        engine.slots.admit(request, engine.scheduler.running, engine.mode.blank)
    slots = engine.slots
    requests = engine.scheduler.running
    width, mask_id = 32, llada_model.special.mask_id
    lengths = torch.tensor([r.block_length for r in requests])
    in_block = torch.arange(width)[None, :] < lengths[:, None]
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        for r in requests:
            r.block = int(torch.randint(r.num_blocks, (1,), generator=generator))
            r.step = int(torch.randint(r.steps_per_block, (1,), generator=generator))
        batch = Batch.build(list(requests), engine.mode.plan, llada_model.device)
        logits = torch.randn(4, width, llada_model.config.vocab_size, generator=generator) * 3
        done = torch.rand(4, width, generator=generator) < 0.3
        block_tokens = torch.where(done, 5, mask_id)
        slots.state["first_conf"][:, :width] = torch.rand(4, width, generator=generator)
        slots.state["low_yield"][:] = torch.randint(0, 3, (4,), generator=generator)
        stored, counter = slots.state["first_conf"][:, :width].clone(), slots.state["low_yield"].clone()
        out = ForwardOutput(logits, block_tokens, in_block, batch.block_start[:, None] + torch.arange(width))
        decided = engine.mode.decide(batch, slots.rows(batch), out, torch.tensor(llada_model.special.end_ids))

        x0, _ = predict(logits, [], mask_id)
        conf = confidence(logits, x0, {})
        candidates = (block_tokens == mask_id) & in_block
        step, block = batch.step, batch.block
        knobs = P.CaiKnobs(
            theta_s=torch.tensor([p.theta_s for p in params]), theta_e=torch.tensor([p.theta_e for p in params]),
            warmup=torch.tensor([p.warmup for p in params]), block_schedule=torch.tensor([True] * 4),
            block_decay=torch.tensor([p.block_decay for p in params]),
            stretch=torch.tensor([p.block_schedule_mode == "stretch" for p in params]),
            position_factors=torch.tensor([p.position_factors for p in params]),
            budgets=torch.tensor([r.params.gating for r in requests]),
            grinding=torch.tensor([r.params.gating for r in requests]), eta=torch.tensor([p.eta for p in params]),
            eta_denominator=torch.tensor([float(p.gen_length if p.eta_denominator == "generation" else
                                                p.block_length) for p in params]),
            patience=torch.tensor([p.patience for p in params]), theta_fb=torch.tensor([p.theta_fb for p in params]),
            grinding_fill=torch.tensor([p.grinding_exit == "fill" for p in params]),
            min_commit=torch.tensor([p.min_commit for p in params]))
        expected = P.cai_step(conf, candidates, step, batch.steps_per_block, block, batch.num_blocks,
                              batch.block_length, P.CaiState(P.box2_first_step_confidence(conf, stored, step), counter),
                              knobs)
        assert torch.equal(decided.tokens != block_tokens, expected.commit)
        assert torch.equal(decided.state["low_yield"], expected.low_yield)


def test_the_mask_token_is_never_predicted():
    from engine.decoding.sampling import predict

    logits = torch.tensor([[[0.0, 5.0, 1.0, 2.0], [3.0, 0.0, 1.0, 2.0]]])
    assert predict(logits, [], mask_id=1)[0].tolist() == [[3, 0]]
    generator = torch.Generator().manual_seed(0)
    hot = logits[:, :1].expand(1, 64, 4).contiguous()  # the mask leads at every position
    assert 1 not in predict(hot, [(0, generator, 5.0)], mask_id=1)[0].flatten().tolist()


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
@pytest.mark.parametrize("policy", STREAMED_POLICIES)
def test_streamed_text_equals_the_whole_response(tiny_engine_parts, held_out_prompts, policy, max_batch):
    """Held-out prompts (100 at batch 8; the first 24 one at a time, CI's time): the text a stream
    sends (the output path fed each step's delta, with a stop string that can straddle deltas)
    equals the whole response (fed everything at once) and the offline text."""
    model, tokenizer = tiny_engine_parts
    held_out_prompts = held_out_prompts if max_batch > 1 else held_out_prompts[:24]
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


class _InferenceModeSpy(TorchFunctionMode):
    """Records, for every torch call made under it, whether inference mode was on."""

    def __init__(self) -> None:
        super().__init__()
        self.modes: list[bool] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.modes.append(torch.is_inference_mode_enabled())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["masked", "block"])
def test_every_operation_of_a_step_and_a_scoring_job_runs_in_inference_mode(llada_model, sdar_dir, family):
    """A step's operations skip autograd's dispatch altogether (`torch.inference_mode`, not `no_grad`):
    its fixed cost per operation is a visible share of a small model's step on a CPU."""
    model = llada_model if family == "masked" else load_model(sdar_dir)
    engine = Engine.from_model(model, max_batch=4)
    caches = ["none", "prefix", "dual"] if family == "masked" else ["exact", "none"]
    for cache in caches:
        for prompt in ([5, 6, 7], [8, 9]):
            engine.add_request(prompt, DecodeParams(gen_length=8, block_length=8 if family == "masked" else None,
                                                    cache=cache))
    spy = _InferenceModeSpy()
    while engine.has_unfinished():
        with spy:
            engine.step()
    if family == "masked":
        job = engine.scoring_job([5, 6, 7, 8], samples=2)
        while not job.done:
            with spy:
                job.advance()
    outside = spy.modes.count(False)
    assert spy.modes and not outside, f"{outside} of {len(spy.modes)} operations ran outside inference mode"
