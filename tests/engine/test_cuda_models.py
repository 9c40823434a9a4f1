"""The built-in models on the device (CUDA; tests/cuda_check.py says how they run and the criterion):
forwards and texts against the CPU in float32 and bfloat16, CUDA graphs against eager steps, one
host read a step, and LLaDA2's MoE kernels. Each test records what it measured (junit properties),
which bench/gpu_check.py puts in its results."""

from __future__ import annotations

import pytest
import torch
from cuda_check import (
    BLOCK_MODELS,
    CHECK_DEVICE,
    CUDA_MARKS,
    FLOAT32_LOGITS_TOLERANCE,
    MASKED_MODELS,
    bfloat16_budget,
    changed,
    check_device,
    check_requests,
    decode_with,
    decoded,
    describe,
    model_on,
    relative_error,
    steps_with_one_read,
    tokenizer_of,
)

from engine import Engine, load_model
from engine.decoding.params import DEFAULT_BLOCK_LENGTH
from engine.models.moe import grouped_mm_available

pytestmark = CUDA_MARKS
ALL_MODELS = MASKED_MODELS + BLOCK_MODELS
DTYPES = ("float32", "bfloat16")


def _forward(model, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    ids = ids.to(model.device)
    with torch.no_grad():
        if model.block_causal:
            return model(ids, block_size=model.block_size or DEFAULT_BLOCK_LENGTH).float()
        return model(ids).float()


def _canvases(name: str, mask_id: int, block: int) -> torch.Tensor:
    """Eight check prompts, each followed by masks to a common length (a multiple of `block`)."""
    prompts = [r.prompt_ids for r in check_requests(name)[:8]]
    length = -(-(max(map(len, prompts)) + 32) // block) * block
    return torch.tensor([list(p) + [mask_id] * (length - len(p)) for p in prompts])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ALL_MODELS)
def test_a_forward_on_the_device_tracks_the_cpu_forward(name, dtype, record_property):
    """float32 within 1e-4 of the CPU's logits (relative L2); bfloat16 within twice the CPU's own
    bfloat16 error, both against the CPU in float32."""
    reference_model = model_on(name, "cpu", "float32")
    ids = _canvases(name, reference_model.special.mask_id, reference_model.block_size or 1)
    reference = _forward(reference_model, ids)
    error = relative_error(_forward(model_on(name, CHECK_DEVICE, dtype), ids), reference)
    record_property("error", f"{error:.2g}")
    if dtype == "float32":
        assert error < FLOAT32_LOGITS_TOLERANCE
    else:
        cpu_error = relative_error(_forward(model_on(name, "cpu", dtype), ids), reference)
        record_property("cpu_error", f"{cpu_error:.2g}")
        assert error <= 2 * cpu_error, (error, cpu_error)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_float32_on_the_device_answers_as_on_the_cpu(name, record_property):
    reference, ours = decoded(name, "cpu", "float32"), decoded(name, CHECK_DEVICE, "float32")
    diff = changed(ours.texts, reference.texts)
    record_property("changed", f"{len(diff)}/{len(reference.texts)}")
    record_property("correct", f"{ours.correct} (cpu {reference.correct})")
    assert not diff, describe(name, diff, ours.texts, reference.texts)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_bfloat16_on_the_device_changes_no_more_texts_than_bfloat16_rounding(name, record_property):
    reference = decoded(name, "cpu", "float32")
    cpu_changes = changed(decoded(name, "cpu", "bfloat16").texts, reference.texts)
    ours = decoded(name, CHECK_DEVICE, "bfloat16")
    diff = changed(ours.texts, reference.texts)
    budget = bfloat16_budget(len(cpu_changes))
    record_property("changed", f"{len(diff)}/{len(reference.texts)} (cpu {len(cpu_changes)}, budget {budget})")
    record_property("correct", f"{ours.correct} (cpu {reference.correct})")
    assert len(diff) <= budget, describe(name, diff, ours.texts, reference.texts)


@pytest.mark.skipif(not CHECK_DEVICE.startswith("cuda"), reason="CUDA graphs need a CUDA device (the static "
                    "forwards they capture run eagerly on CPU in tests/engine/test_static_dual_forward.py and "
                    "test_static_block_forward.py)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ALL_MODELS)
def test_cuda_graphs_give_the_tokens_eager_steps_give(name, dtype, record_property):
    """Every request of the check (dual-cache rows, or block-diffusion cached rows, run as graphs
    beside the rows of other forwards): the eager engine's tokens, all of them in float32; in bfloat16
    within the rounding budget (a graph runs a padded bucket of rows, whose matmuls may pick other
    kernels)."""
    eager = decoded(name, CHECK_DEVICE, dtype)
    engine = Engine.from_model(model_on(name, CHECK_DEVICE, dtype), tokenizer_of(name), max_batch=8,
                               cuda_graphs=True)
    graphs = decode_with(engine, check_requests(name))
    mode = engine.mode
    captured = mode.static_forwards.made
    assert captured > 0
    diff = changed(graphs.tokens, eager.tokens)
    record_property("graphs", captured)
    if dtype == "float32":
        record_property("changed", f"{len(diff)}/{len(eager.tokens)}")
        assert not diff, describe(name, diff, graphs.texts, eager.texts)
    else:
        reference = decoded(name, "cpu", "float32")
        budget = bfloat16_budget(len(changed(decoded(name, "cpu", "bfloat16").texts, reference.texts)))
        record_property("changed", f"{len(diff)}/{len(eager.tokens)} (budget {budget})")
        assert len(diff) <= budget, describe(name, diff, graphs.texts, eager.texts)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_one_host_read_per_step_on_the_device(name, record_property):
    """Every request of the check joining and leaving an 8-row batch: one tensor read a step, counted
    by engine.host_reads. On CUDA, every synchronising operation is counted too (torch's sync debug
    mode: a blocking host-to-device copy waits for the stream as a read does) and recorded with
    where it happens; the rule the test holds the engine to is the read."""
    engine = Engine.from_model(model_on(name, CHECK_DEVICE, "bfloat16"), tokenizer_of(name), max_batch=8)
    for request in check_requests(name):
        engine.add_request(request.prompt_ids, request.params)
    steps_with_one_read(engine, record_property)


def test_moe_kernels_on_the_device(llada2_dir, record_property):
    """LLaDA2's routed experts (a random tiny MoE): float32 on the device within 1e-4 of the CPU;
    in bfloat16, grouped_mm against the plain kernel within the CPU's own bfloat16 error, and on CUDA
    the kernel picked by default is grouped_mm (where this torch has it)."""
    device = check_device()
    reference_model = load_model(llada2_dir)
    ids = (torch.arange(4 * 2 * DEFAULT_BLOCK_LENGTH).view(4, -1) * 7) % reference_model.config.vocab_size
    reference = _forward(reference_model, ids)
    error = relative_error(_forward(load_model(llada2_dir, device=str(device)), ids), reference)
    record_property("float32_error", f"{error:.2g}")
    assert error < FLOAT32_LOGITS_TOLERANCE
    cpu_error = relative_error(_forward(load_model(llada2_dir, dtype="bfloat16"), ids), reference)
    model = load_model(llada2_dir, device=str(device), dtype="bfloat16")
    default = _forward(model, ids)
    if not grouped_mm_available():
        record_property("grouped_mm", f"absent in torch {torch.__version__}: the plain kernel ran")
        pytest.skip(f"torch {torch.__version__} has no torch.nn.functional.grouped_mm")
    kernels = {}
    for kernel in ("plain", "grouped_mm"):
        model.set_moe_kernel(kernel)
        kernels[kernel] = _forward(model, ids)
    model.set_moe_kernel(None)
    between = relative_error(kernels["grouped_mm"], kernels["plain"])
    record_property("grouped_vs_plain", f"{between:.2g} (cpu bfloat16 error {cpu_error:.2g})")
    assert between <= cpu_error
    assert relative_error(kernels["grouped_mm"], reference) <= 2 * cpu_error
    if device.type == "cuda":
        assert torch.equal(default, kernels["grouped_mm"]), "the default kernel on CUDA in bfloat16 is grouped_mm"
