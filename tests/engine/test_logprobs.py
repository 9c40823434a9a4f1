"""Per-token logprobs of generated tokens, vLLM's sampling fields (min_p, top_k -1, ignore_eos) in the
engine, and the server's output path cutting at max_tokens: hand-built tensors first, then the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import DecodeParams, Engine, summary
from engine.decoding.sampling import filter_min_p, token_logprobs
from engine.decoding.types import TokenLogprob
from engine.host_reads import count_host_reads
from server.output import ChoiceOutput

REPO = Path(__file__).resolve().parents[2]


def test_token_logprobs_are_the_raw_log_softmax_and_its_top_k():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 0.0, 1.0]]])
    x0 = torch.tensor([[1, 1]])
    chosen, values, ids = token_logprobs(logits, x0, 2)
    logp = logits.log_softmax(-1)
    assert torch.allclose(chosen, logp[0, :, 1][None])
    assert ids.tolist() == [[[0, 1], [1, 3]]]
    assert torch.allclose(values[0, 0], logp[0, 0, [0, 1]])
    chosen0, values0, ids0 = token_logprobs(logits, x0, 0)
    assert values0.shape == (1, 2, 0) and ids0.shape == (1, 2, 0) and torch.equal(chosen0, chosen)


def test_summary_carries_counts_tokens_and_logprobs_exactly():
    width, k = 3, 2
    chosen = torch.tensor([[-0.5, -1.25, -3.0e-7]])
    values = torch.tensor([[[-0.5, -2.0], [-0.1, -1.25], [-3.0e-7, -20.0]]])
    ids = torch.tensor([[[4, 7], [9, 4], [1, 2]]])
    counts = {name: torch.tensor([v]) for v, name in enumerate(summary.COUNTS)}
    tokens = torch.tensor([[126336, 2**40 + 3, 5]])  # ids far past any vocabulary still travel exactly
    encoded = summary.encode(counts, tokens, (chosen, values, ids))
    [row] = summary.decode(encoded.tolist(), width, k)
    assert [getattr(row, name) for name in summary.COUNTS] == list(range(len(summary.COUNTS)))
    assert row.tokens == tokens[0].tolist()
    assert row.logprob(0) == (-0.5, ((4, -0.5), (7, -2.0)))
    logp, top = row.logprob(2)
    assert logp == float(chosen[0, 2]) and top[1] == (2, -20.0)  # the float32 value, bit for bit
    [plain] = summary.decode(summary.encode(counts, tokens).tolist(), width, -1)
    assert plain.tokens == row.tokens and plain.end_pos == row.end_pos


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]], [[0.5, 0.3, 0.15, 0.05]]]))
    out = filter_min_p(logits, torch.tensor([0.35, 0.0]))
    lowest = torch.finfo(logits.dtype).min
    # 0.35 x 0.5 = 0.175: 0.15 and 0.05 go; min_p 0 leaves the second row alone
    assert out[0, 0, 2] == lowest and out[0, 0, 3] == lowest and out[0, 0, 1] > lowest
    assert torch.equal(out[1], logits[1])


@pytest.fixture(scope="module")
def engine(llada_model):
    return Engine.from_model(llada_model, max_batch=4)


PROMPTS = [[5, 9, 13, 7], [21, 3, 11], [8, 8, 2, 30, 4]]


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_logprobs_leave_the_tokens_alone_and_cost_no_extra_transfer(engine, cache):
    base = DecodeParams(policy="cai", gen_length=16, block_length=8, cache=cache, early_exit=False)
    plain = engine.generate(PROMPTS, base)
    order = [engine.add_request(prompt, base.with_overrides(logprobs=3)) for prompt in PROMPTS]
    results, reads = {}, 0
    while engine.has_unfinished():
        with count_host_reads() as counted:
            outputs = engine.step()
        reads = max(reads, counted.count)
        for out in outputs:
            assert len(out.new_logprobs) == len(out.new_token_ids)
            if out.result is not None:
                results[out.request_id] = out.result
    assert reads == 1
    mask = engine.model.special.mask_id
    for result, reference in zip((results[i] for i in order), plain, strict=True):
        assert result.generated_ids == reference.generated_ids and reference.logprobs is None
        assert [lp.token_id for lp in result.logprobs] == result.generated_ids
        for lp in result.logprobs:
            assert lp.logprob <= 1e-6 and len(lp.top) == 3
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
            # greedy: the committed token is the most likely one the decoder may pick (never the mask)
            best = next(v for t, v in lp.top if t != mask)
            assert lp.logprob == pytest.approx(best, abs=1e-6)


def test_logprobs_above_the_engine_limit_are_refused(engine):
    from engine import RequestError

    with pytest.raises(RequestError) as err:
        engine.add_request([5, 9], DecodeParams(logprobs=engine.config.max_logprobs + 1))
    assert err.value.param == "logprobs"


def test_ignore_eos_decodes_the_whole_canvas_past_end_tokens():
    from engine import EngineConfig
    from engine.chat import chat_prompt_ids

    bundled = Engine(EngineConfig(model=str(REPO / "models" / "llada-tiny"), max_batch=4))
    prompts = [chat_prompt_ids(bundled.tokenizer, [{"role": "user", "content": text}])
               for text in ("00023+00045", "00457+00038")]
    params = DecodeParams(policy="fixed", gen_length=64, block_length=32, steps=64)
    stopped = bundled.generate(prompts, params)
    assert all(r.finish_reason == "stop" for r in stopped)  # they answer, then end
    forced = bundled.generate(prompts, params.with_overrides(ignore_eos=True))
    ends = set(bundled.model.special.end_ids)
    for result in forced:
        assert result.finish_reason == "length" and result.end_index is None and result.stats.steps == 64
        assert len(result.response_ids) == 64 and ends & set(result.response_ids)  # end tokens kept inside
    full = bundled.generate(prompts, params.with_overrides(early_exit=False))
    assert [r.generated_ids for r in forced] == [r.generated_ids for r in full]


def test_top_k_off_values_and_min_p_zero_change_nothing(engine):
    params = DecodeParams(policy="threshold", gen_length=8, block_length=8)
    reference = [r.generated_ids for r in engine.generate(PROMPTS, params)]
    for extra in ({"top_k": -1}, {"top_k": 0}, {"min_p": 0.0}):
        assert [r.generated_ids for r in engine.generate(PROMPTS, params.with_overrides(**extra))] == reference


def test_the_output_path_cuts_at_max_tokens_and_keeps_the_kept_tokens_logprobs():
    def lp(token: int) -> TokenLogprob:
        return TokenLogprob(token, -0.5, ((token, -0.5),))

    choice = ChoiceOutput(0, "r", [1], None, end_ids={99}, stops=[], max_tokens=3, logprobs=True)
    choice.add([10, 11], [lp(10), lp(11)])
    assert not choice.ended
    choice.add([12, 13, 14], [lp(12), lp(13), lp(14)])
    assert choice.ended and choice.stopped_early and choice.token_ids == [10, 11, 12]
    choice.finish(None)
    assert choice.finish_reason == "length"
    logged = choice.take_logprobs()
    assert [e.logprob.token_id for e in logged] == [10, 11, 12]
    assert [e.offset for e in logged] == [0, 2, 4]  # a token-id model's token text is the id
    # as in vLLM the end token counts: it fits in max_tokens 3 (and is logged), not in 2
    fits = ChoiceOutput(0, "r", [1], None, end_ids={99}, stops=[], max_tokens=3, logprobs=True)
    fits.add([10, 11, 99], [lp(10), lp(11), lp(99)])
    fits.finish(None)
    assert fits.token_ids == [10, 11] and fits.finish_reason == "stop"
    assert [e.logprob.token_id for e in fits.take_logprobs()] == [10, 11, 99]
    cut = ChoiceOutput(0, "r", [1], None, end_ids={99}, stops=[], max_tokens=2, logprobs=True)
    cut.add([10, 11, 99], [lp(10), lp(11), lp(99)])
    cut.finish(None)
    assert cut.token_ids == [10, 11] and cut.finish_reason == "length"
    assert [e.logprob.token_id for e in cut.take_logprobs()] == [10, 11]
