"""Weight-only quantization on the device (tests/cuda_check.py says how these run): a quantized
built-in model of each decoding mode loads and answers every check request. int8 (torchao) and int4
(bitsandbytes NF4) have CPU kernels too, so the device's texts are held to the rule bfloat16 is held
to, with the CPU's own count in the same mode and dtype as r: the libraries' device kernels may round
otherwise than their CPU kernels, not worse. fp8 exists on CUDA only (compute capability 8.9 and
later): it must load, run every path and answer at least half of what the float model answers; its
accuracy is recorded. A library that is not installed (it did not travel: bench/gpu_wheels.sh)
skips, naming it."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from cuda_check import (
    BLOCK_MODELS,
    CHECK_DEVICE,
    CUDA_MARKS,
    MASKED_MODELS,
    bfloat16_budget,
    changed,
    check_device,
    decoded,
    describe,
)

from engine import DeviceError
from engine.quantization import check_quantization

pytestmark = CUDA_MARKS
LIBRARY = {"int8": "torchao", "int4": "bitsandbytes", "fp8": "torchao"}
MODELS = (MASKED_MODELS[0], BLOCK_MODELS[0])  # one model of each decoding mode


def _ready(mode: str, dtype: str) -> None:
    """Skip when the mode's library is absent; fail when it is present but cannot run here."""
    if importlib.util.find_spec(LIBRARY[mode]) is None:
        pytest.skip(f"{LIBRARY[mode]} is not installed here (on a lent GPU it travels as a wheel made by "
                    "bench/gpu_wheels.sh)")
    check_quantization(mode, check_device(), getattr(torch, dtype))


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("name", MODELS)
def test_a_quantized_model_answers_on_the_device_as_on_the_cpu(name, mode, record_property):
    """In bfloat16, the dtype a GPU serves in (the CPU's quantized kernels in bfloat16 are the slow part
    of the check: one dtype)."""
    dtype = "bfloat16"
    _ready(mode, dtype)
    reference = decoded(name, "cpu", "float32", "none")
    cpu_changes = changed(decoded(name, "cpu", dtype, mode).texts, reference.texts)
    ours = decoded(name, CHECK_DEVICE, dtype, mode)
    diff = changed(ours.texts, reference.texts)
    budget = bfloat16_budget(len(cpu_changes))
    record_property("changed", f"{len(diff)}/{len(ours.texts)} (cpu {len(cpu_changes)}, budget {budget})")
    record_property("correct", f"{ours.correct} (cpu {reference.correct})")
    assert all(ours.tokens), "every request generated tokens"
    assert len(diff) <= budget, describe(name, diff, ours.texts, reference.texts)


@pytest.mark.parametrize("name", MODELS)
def test_fp8_loads_and_answers_on_a_gpu_that_has_it(name, record_property):
    device = check_device()
    if device.type != "cuda":
        pytest.skip("fp8 weights need a CUDA GPU of compute capability 8.9 or later")
    try:
        _ready("fp8", "bfloat16")
    except DeviceError as err:
        if "compute capability" not in str(err):
            raise
        pytest.skip(str(err))
    reference = decoded(name, "cpu", "float32", "none")
    ours = decoded(name, CHECK_DEVICE, "bfloat16", "fp8")
    assert all(ours.tokens), "every request generated tokens"
    record_property("changed", f"{len(changed(ours.texts, reference.texts))}/{len(ours.texts)}")
    record_property("correct", f"{ours.correct} (cpu {reference.correct})")
    # e4m3 keeps 3 mantissa bits (~3 % a weight: between int8 and int4): a model that answers fewer than
    # half of what the float model answers is broken, not rounded
    assert 2 * ours.correct >= reference.correct, describe(name, changed(ours.texts, reference.texts), ours.texts,
                                                           reference.texts)
