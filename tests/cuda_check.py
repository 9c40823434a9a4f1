"""What the CUDA tests (`pytest -m cuda`: tests/engine/test_cuda_*.py) share: the device they check,
the requests every built-in model decodes there, and the fair criterion for bfloat16.

They run on a lent GPU through `bench/gpu_check.sh` (docs/performance.md); elsewhere they skip. The
check's CPU dry run (tests/engine/test_gpu_check.py) runs them with CAI_DLLM_CHECK_DEVICE=cpu and
CAI_DLLM_CHECK_QUICK=1: the CPU then checks itself, which cannot find a numerical difference but keeps
the tests' code from rotting between GPU loans.

The criterion. Each built-in model decodes held-out problems through every policy and cache mode on
the CPU in float32 (the reference) and in bfloat16, and on the device in both dtypes, texts compared:
- float32 on the device must give the reference's texts, all of them: float32 rounding moves a
  confidence by ~1e-7, far below the margins these models decide by, so a changed text is a bug.
- bfloat16 moves logits by ~1 %, and a text changes where some decision's margin is below that.
  bfloat16 on the device and on the CPU are two roundings of the same model by different kernels; the
  CPU's count of changed texts (r, measured in the same run on the same requests) says how many
  requests sit on such a margin. The device may hit others of the same kind: up to 2r + 2 changed
  texts is rounding (the + 2 for a model whose r happens to be 0), more is a bug.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import DecodeParams, Engine, load_model
from engine.chat import chat_prompt_ids
from engine.host_reads import count_host_reads
from engine.loading.tokenizer import load_tokenizer
from tinymodels.checker import is_correct
from tinymodels.evaluate import held_out_problems, model_mix
from tinymodels.tasks import Problem

MODELS = Path(__file__).resolve().parents[1] / "models"
CHECK_DEVICE = os.environ.get("CAI_DLLM_CHECK_DEVICE", "cuda")
QUICK = os.environ.get("CAI_DLLM_CHECK_QUICK") == "1"  # one request per cache mode (the CPU dry run)
NO_DEVICE = CHECK_DEVICE.startswith("cuda") and not torch.cuda.is_available()
SKIP_REASON = ("no CUDA device here: the cuda tests run on a lent GPU through bench/gpu_check.sh "
               "(docs/performance.md)")
# Every CUDA test module starts with `pytestmark = CUDA_MARKS`.
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(NO_DEVICE, reason=SKIP_REASON)]

MASKED_MODELS = ("llada-tiny", "dream-tiny")
BLOCK_MODELS = ("sdar-tiny",)
# every policy of each decoding mode (block-edit is LLaDA2.1's decoder: block-diffusion models only)
MASKED_POLICIES = ("fixed", "threshold", "cai", "dream-maskgit_plus", "dream-entropy", "dream-topk_margin",
                   "block-static", "block-dynamic", "block-sequential")
BLOCK_POLICIES = ("block-static", "block-dynamic", "block-sequential", "block-edit", "cai", "fixed", "threshold")
MASKED_CACHES = ("none", "prefix", "dual")
BLOCK_CACHES = ("exact", "none")
GEN_LENGTH = 64
FLOAT32_LOGITS_TOLERANCE = 1e-4  # relative L2; float32 with another summation order lands near 1e-6


@dataclass(frozen=True)
class CheckRequest:
    problem: Problem
    prompt_ids: tuple[int, ...]
    params: DecodeParams

    @property
    def label(self) -> str:
        return f"{self.params.policy}/{self.params.cache}: {self.problem.prompt!r}"


def check_device() -> torch.device:
    device = torch.device(CHECK_DEVICE)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def bfloat16_budget(cpu_changes: int) -> int:
    """Changed texts that bfloat16 rounding explains, given r = the CPU's own count (module doc)."""
    return 2 * cpu_changes + 2


@functools.cache
def tokenizer_of(name: str) -> Any:
    return load_tokenizer(MODELS / name)


@functools.cache
def model_on(name: str, device: str, dtype: str, quantization: str = "none") -> Any:
    return load_model(MODELS / name, device=device, dtype=dtype, quantization=quantization)


@functools.cache
def check_requests(name: str) -> tuple[CheckRequest, ...]:
    """Held-out problems of the kinds the model learned, one through each (cache, policy) of its
    decoding mode; QUICK: one per cache mode, the policies taken in turn."""
    block = name in BLOCK_MODELS
    caches, policies = (BLOCK_CACHES, BLOCK_POLICIES) if block else (MASKED_CACHES, MASKED_POLICIES)
    configs = [(cache, policy) for cache in caches for policy in policies]
    if QUICK:
        configs = [(cache, policies[i % len(policies)]) for i, cache in enumerate(caches)]
    problems = held_out_problems(len(configs), seed=42, mix=model_mix(str(MODELS / name)))
    tokenizer = tokenizer_of(name)
    requests = []
    for problem, (cache, policy) in zip(problems, configs, strict=True):
        knobs: dict[str, Any] = {"block_length": 32} if not block else {}  # a block model: its trained block
        params = DecodeParams(policy=policy, gen_length=GEN_LENGTH, cache=cache, **knobs)
        ids = tuple(chat_prompt_ids(tokenizer, [{"role": "user", "content": problem.prompt}]))
        requests.append(CheckRequest(problem, ids, params))
    return tuple(requests)


@dataclass(frozen=True)
class Decoded:
    texts: tuple[str, ...]
    tokens: tuple[tuple[int, ...], ...]
    correct: int  # answers the independent checker accepts


def decode_with(engine: Engine, requests: Sequence[CheckRequest]) -> Decoded:
    results = engine.generate([r.prompt_ids for r in requests], [r.params for r in requests])
    texts = tuple(r.text for r in results)
    correct = sum(is_correct(r.problem.prompt, text) for r, text in zip(requests, texts, strict=True))
    return Decoded(texts, tuple(tuple(r.generated_ids) for r in results), correct)


def decoded(name: str, device: str, dtype: str, quantization: str = "none") -> Decoded:
    """The model's texts for its check requests (each combination is decoded once a session: the CPU
    references serve every test)."""
    return _decoded(name, str(torch.device(device)), dtype, quantization)


@functools.cache
def _decoded(name: str, device: str, dtype: str, quantization: str) -> Decoded:
    engine = Engine.from_model(model_on(name, device, dtype, quantization), tokenizer_of(name), max_batch=8)
    return decode_with(engine, check_requests(name))


def changed(ours: Sequence[Any], reference: Sequence[Any]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b]


def describe(name: str, indices: Sequence[int], ours: Sequence[str], reference: Sequence[str]) -> str:
    """The changed requests, for a failure message (at most five)."""
    requests = check_requests(name)
    lines = [f"{requests[i].label}: {reference[i]!r} -> {ours[i]!r}" for i in indices[:5]]
    return "\n".join(lines + ([f"... and {len(indices) - 5} more"] if len(indices) > 5 else []))


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    ours, reference = ours.double().cpu(), reference.double().cpu()
    return ((ours - reference).norm() / reference.norm()).item()


def steps_with_one_read(engine: Engine, record_property: Any,
                        kernel_reads: Callable[[], int] = lambda: 0) -> None:
    """Step `engine` until its requests finish, asserting one tensor read a step (engine.host_reads)
    besides the reads a kernel is documented to make (`kernel_reads()`: those made so far); on CUDA
    every synchronising operation is counted too (torch's sync debug mode: a blocking host-to-device
    copy waits for the stream as a read does) and recorded with where it happens."""
    on_cuda = check_device().type == "cuda"
    syncs: list[int] = []
    sources: Counter[str] = Counter()
    while engine.has_unfinished():
        before = kernel_reads()
        with warnings.catch_warnings(record=True) as caught, count_host_reads() as reads:
            warnings.simplefilter("always")
            if on_cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                if on_cuda:
                    torch.cuda.set_sync_debug_mode("default")
        assert reads.count == 1 + kernel_reads() - before, reads.by_method
        found = [w for w in caught if "synchronizing" in str(w.message)]
        syncs.append(len(found))
        sources.update(f"{'/'.join(w.filename.split('/')[-2:])}:{w.lineno}" for w in found)
    record_property("steps", len(syncs))
    if on_cuda:
        record_property("syncs_per_step", f"max {max(syncs)}, mean {sum(syncs) / len(syncs):.2f}")
        record_property("sync_sources", "; ".join(f"{s} x{n}" for s, n in sources.most_common(8)))
