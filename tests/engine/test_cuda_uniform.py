"""The built-in uniform-noise model (`models/diffusiongemma-tiny`, DiffusionGemma's format) on the
device (CUDA; tests/cuda_check.py says how these tests run).

Its texts cannot be compared with the CPU's token for token: a seeded request draws its canvases and
samples from its own generator on the engine's device, and CUDA's generator gives other numbers
than the CPU's for the same seed (vLLM does not promise a seed's sample across devices either). So
the criterion is the task's: the device answers about as many held-out problems as the CPU does
under the same policies, and on the device a seeded request gives the same tokens alone and batched
(its draws are its own, whatever else runs). One host read a step holds as for the other families."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from cuda_check import CHECK_DEVICE, CUDA_MARKS, GEN_LENGTH, MODELS, QUICK, model_on, steps_with_one_read, tokenizer_of

from engine import DecodeParams, Engine
from engine.chat import chat_prompt_ids
from engine.models.moe import GroupedExperts
from tinymodels.checker import is_correct
from tinymodels.evaluate import held_out_problems, model_mix
from tinymodels.tasks import Problem

pytestmark = CUDA_MARKS
NAME = "diffusiongemma-tiny"
POLICIES = ("dg-official", "dg-converge")
REQUESTS = 4 if QUICK else 32


def _requests() -> tuple[list[Problem], list[list[int]], list[DecodeParams]]:
    problems = held_out_problems(REQUESTS, seed=42, mix=model_mix(str(MODELS / NAME)))
    tokenizer = tokenizer_of(NAME)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p.prompt}]) for p in problems]
    params = [DecodeParams(policy=POLICIES[i % len(POLICIES)], gen_length=GEN_LENGTH, seed=i)
              for i in range(len(problems))]
    return problems, prompts, params


def _correct(problems: list[Problem], texts: list[str]) -> int:
    return sum(is_correct(p.prompt, t) for p, t in zip(problems, texts, strict=True))


def test_the_uniform_noise_model_answers_on_the_device_as_on_the_cpu(record_property):
    """Each side's own draws: the device may answer fewer than the CPU by no more than two standard
    deviations of the difference of two such counts (the model answers ~97 % of held-out problems)."""
    problems, prompts, params = _requests()
    counts = {}
    for device in ("cpu", CHECK_DEVICE):
        engine = Engine.from_model(model_on(NAME, device, "float32"), tokenizer_of(NAME), max_batch=8)
        counts[device] = _correct(problems, [r.text for r in engine.generate(prompts, params)])
    cpu, ours = counts["cpu"], counts[CHECK_DEVICE]
    share = max(cpu, 1) / len(problems)
    allowed = math.ceil(2 * math.sqrt(2 * len(problems) * share * (1 - share)))
    record_property("correct", f"{ours}/{len(problems)} (cpu {cpu}, allowed drop {allowed})")
    assert ours >= cpu - allowed, (ours, cpu, allowed)


def test_a_seeded_request_gives_the_same_tokens_alone_and_batched_on_the_device(record_property):
    _, prompts, params = _requests()
    model = model_on(NAME, CHECK_DEVICE, "float32")
    batched = Engine.from_model(model, tokenizer_of(NAME), max_batch=8).generate(prompts, params)
    alone_engine = Engine.from_model(model, tokenizer_of(NAME), max_batch=1)
    shown = min(len(prompts), 8)  # alone, one at a time: a few are enough
    alone = [alone_engine.generate([p], q)[0] for p, q in zip(prompts[:shown], params[:shown], strict=True)]
    differing = [i for i in range(shown) if alone[i].generated_ids != batched[i].generated_ids]
    record_property("changed", f"{len(differing)}/{shown}")
    assert not differing, [(alone[i].text, batched[i].text) for i in differing]


def test_one_host_read_per_step_on_the_device_uniform(record_property):
    """As tests/engine/test_cuda_models.py checks the other families, in bfloat16 (where CUDA runs
    the experts with grouped_mm): one tensor read a step, besides the one read a MoE layer that the
    plain experts kernel makes where grouped_mm does not run (engine/models/moe.py)."""
    _, prompts, params = _requests()
    model = model_on(NAME, CHECK_DEVICE, "bfloat16")
    plain_calls = [0]
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module._plain = _counted(module._plain, plain_calls)
    try:
        engine = Engine.from_model(model, tokenizer_of(NAME), max_batch=8)
        for prompt, request_params in zip(prompts, params, strict=True):
            engine.add_request(prompt, request_params)
        steps_with_one_read(engine, record_property, lambda: plain_calls[0])
    finally:
        for module in model.modules():
            if isinstance(module, GroupedExperts):
                del module._plain  # the class's method again
    record_property("plain_experts_calls", plain_calls[0])


def _counted(method: Callable[..., Any], calls: list[int]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return method(*args, **kwargs)
    return counted
