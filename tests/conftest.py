"""Shared test fixtures. The parity data (tiny official-format checkpoints, official logits, golden
decoding runs, released configs and tokenizers) lives in tests/fixtures; CAI_DLLM_FIXTURES points the
tests at another set of the same layout (e.g. a held-out one)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("CAI_DLLM_FIXTURES", REPO / "tests" / "fixtures")).resolve()

if not (FIXTURES / "README.md").is_file():
    raise RuntimeError(f"parity fixtures not found at {FIXTURES} (CAI_DLLM_FIXTURES): it must hold the layout "
                       "of tests/fixtures")


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def llada_model():
    from engine import load_model

    return load_model(FIXTURES / "llada_tiny")


@pytest.fixture(scope="session")
def dream_model():
    from engine import load_model

    return load_model(FIXTURES / "dream_tiny")


@pytest.fixture
def llada_copy(tmp_path: Path) -> Path:
    """A writable copy of the tiny LLaDA checkpoint, for tests that break it."""
    dest = tmp_path / "llada"
    shutil.copytree(FIXTURES / "llada_tiny", dest)
    return dest


@pytest.fixture(scope="session")
def sdar_dir(tmp_path_factory) -> Path:
    """A small random-weight SDAR checkpoint (trained block 8) on the character tokenizer."""
    from blockcheckpoints import write_sdar

    return write_sdar(tmp_path_factory.mktemp("sdar") / "sdar-random")


@pytest.fixture(scope="session")
def llada2_dir(tmp_path_factory) -> Path:
    """A small random-weight LLaDA2 MoE, the parity fixture's layout, on the character tokenizer."""
    from blockcheckpoints import write_llada2

    [config] = sorted((FIXTURES / "block" / "llada2").glob("*/config.json"))
    return write_llada2(tmp_path_factory.mktemp("llada2") / "llada2-random", config)


def generate(model, prompts, params=None, max_batch=8):  # type: ignore[no-untyped-def]
    """Decode `prompts` with a fresh engine over `model` (no request shares a step with another test's)."""
    from engine import Engine

    return Engine.from_model(model, max_batch=max_batch).generate(prompts, params)


def ordinary_ids(model: Any, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Random prompts of these lengths over `model`'s vocabulary, none of them a special id of its
    checkpoint (mask, pad, bos, end ids): prompts that fit whatever fixture set the tests run on."""
    special = model.special
    barred = {special.mask_id, special.pad_id, special.bos_id, *special.end_ids}
    allowed = torch.tensor([t for t in range(model.config.vocab_size) if t not in barred])
    gen = torch.Generator().manual_seed(seed)
    return [allowed[torch.randint(len(allowed), (n,), generator=gen)].tolist() for n in lengths]


def idle_passes(engine: Any) -> Callable[[float], None]:
    """An `on_progress` callback: after each step, every static pass made so far runs once more on
    its idle inputs (StaticForwards.run_idle, what a CUDA graph's capture warms up on), which must
    change nothing a row reads."""
    def run(done: float) -> None:
        forwards = engine.mode.static_forwards
        with torch.inference_mode():  # as the step runs
            for key in forwards.keys:
                forwards.run_idle(key)
    return run


def compiled_code(run: Callable[[], Any]) -> str:
    """The code inductor generates for every compile that `run` triggers (compiled anew: a graph
    found in inductor's cache is not generated again)."""
    from torch._inductor.utils import run_and_get_code

    with torch._inductor.config.patch(force_disable_caches=True):
        code = "\n".join(run_and_get_code(run)[1])
    assert code, "nothing was compiled"
    return code


def copies_whole(code: str, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a generated CPU kernel loops over as many elements as some of the first slots of one of
    `tensors` ([slots, ...]) hold: how a write through a view of a store (`index_put_` on a slice of
    its slots, on a transpose) compiles, those slots copied out and back, where a write into the
    store itself stays in place (engine.models.kv_cache.write_kv)."""
    return any(f"<static_cast<int64_t>({n * t[0].numel()}L)" in code
               for t in tensors for n in range(1, t.shape[0] + 1))
