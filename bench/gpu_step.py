"""Time of ONE decoding step of LLaDA-8B, Dream-7B, SDAR-8B, LLaDA2.0-mini and DiffusionGemma-26B-A4B
shapes, next to its roofline floor.

The models have the real architectures (parsed from the released `config.json` files in
`tests/fixtures/real/`) with random weights created directly on the device, so no checkpoint is
needed. For each model, batch size and cache mode the engine's own step is driven (prompt 512 +
256 generated, block 32, the fixed policy committing one token per step, so a block lasts 32
steps) and two kinds of step are timed after a warm-up:

- `full`: the block-start step, a forward over the whole canvas (with cache `none` every step is one);
- `cached`: steps 1..k of the block, which feed only the block (`dual`) or the block and everything
  after it (`prefix`), reading the other positions' keys/values from the cache.

Each row is set against a floor measured in the same run: memory floor = bytes the step must read
(weights + KV cache) / the device's measured copy bandwidth; compute floor = the step's FLOPs / the
measured matmul rate; floor = the larger. See docs/performance.md.

SDAR and LLaDA2 decode in the block-causal mode: their rows (cache `exact`; steps `prefill`,
`denoise`, `next`) are bench/block_step.py's, which says what they time and count; DiffusionGemma's (uniform-noise mode:
steps `prefill`, `denoise`, `next` of a canvas) are bench/dg_step.py's.

    python bench/gpu_step.py                       # H100/H200: real shapes, bf16
    python bench/gpu_step.py --shapes tiny --device cpu --dtype float32 --prompt-len 64 --gen-len 64 --block 16
    python bench/gpu_step.py -tp 2                 # two GPUs against one (bench/tp_step.py)
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from engine.decoding import DecodeParams
from engine.engine import Engine
from engine.loading.checkpoint import CheckpointFiles
from engine.models.attention import flash_attn_available, sdpa_attention, select_attention
from engine.models.transformer import DiffusionTransformer
from engine.quantization import check_quantization, quantize_linears
from engine.special_tokens import added_token_ids

sys.path.insert(0, str(Path(__file__).resolve().parent))
from block_step import BLOCK_MODELS, run_block_model
from dg_step import NAME as DG
from dg_step import run_dg_model
from random_models import build_random
from roofline import CACHED, FULL, ModelDims, measure_rates, step_bytes, step_flops, step_shape, sync
from tp_step import add_arguments as add_tp_arguments
from tp_step import run_tensor_parallel

# The repository's fixtures (tests/fixtures), or where CAI_DLLM_FIXTURES says (as for the tests).
FIXTURES = Path(os.environ.get("CAI_DLLM_FIXTURES", Path(__file__).resolve().parents[1] / "tests" / "fixtures"))
REAL_DIR = FIXTURES / "real"
MODELS = {"llada": "llada-8b-instruct", "dream": "dream-v0-instruct-7b"}
# Tiny shapes keep each family's real config (vocabulary and special ids included, so the engine sees
# the same ids) and shrink only the sizes; Dream keeps grouped KV heads.
TINY_OVERRIDES: dict[str, dict[str, int]] = {
    "llada": {"d_model": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "mlp_hidden_size": 688},
    "dream": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 688},
}
# Mid-size shapes: LLaDA-8B's at 1/8 of the width, all 32 layers (bench/quant_speed.py's mid-size model)
MID_OVERRIDES: dict[str, dict[str, int]] = {
    "llada": {"d_model": 512, "n_layers": 32, "n_heads": 4, "n_kv_heads": 4, "mlp_hidden_size": 1536},
    "dream": {"hidden_size": 512, "num_hidden_layers": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 1536},
}


# ------------------------------------------------------------------------------ models


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hf_config: dict[str, Any]
    checkpoint: CheckpointFiles

    @property
    def token_limit(self) -> int:
        """Prompt ids are drawn below this: the lowest added or special id. Both tokenizers put
        their added tokens after the ordinary vocabulary, so every id below it is plain text."""
        special = self.checkpoint.special_tokens()
        added = added_token_ids(self.checkpoint.tokenizer_config or {}, self.checkpoint.added_tokens)
        ids = [special.mask_id, special.pad_id, *special.eos_ids, *added.values()]
        ids += [i for i in (special.bos_id, special.eot_id) if i is not None]
        return min(ids)


def model_spec(name: str, shapes: str, real_dir: Path = REAL_DIR) -> ModelSpec:
    checkpoint = CheckpointFiles.open(real_dir / MODELS[name])
    hf = dict(checkpoint.config)
    if shapes == "tiny":
        hf.update(TINY_OVERRIDES[name])
    elif shapes == "mid":
        hf.update(MID_OVERRIDES[name])
    elif shapes != "real":
        raise ValueError(f"unknown shapes {shapes!r}")
    return ModelSpec(name, hf, checkpoint)


def build_random_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                       seed: int = 0) -> DiffusionTransformer:
    """The model of `spec` with random weights on `device` (bench/random_models.py)."""
    return build_random(spec.hf_config, spec.checkpoint.special_tokens(), device, dtype, seed)


def free_model() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ the engine


def decode_params(cache: str, args: argparse.Namespace) -> DecodeParams:
    # One token per step (steps == gen_length) so that a block lasts `block` steps; no early exit so
    # that a random model's end tokens do not shorten the run.
    return DecodeParams(policy="fixed", gen_length=args.gen_len, block_length=args.block, steps=args.gen_len,
                        cache=cache, refresh_interval=0, early_exit=False)


def make_stepper(model: DiffusionTransformer, prompts: Sequence[tuple[int, ...]], cache: str,
                 args: argparse.Namespace, cuda_graphs: bool = False) -> Callable[[], Optional[int]]:
    """Everything that drives the engine: queue one request per prompt on a fresh engine and
    return a callable that runs one engine step and returns the tokens the engine says the model
    was fed (None if the engine does not report it). The first step also admits the requests."""
    engine = Engine.from_model(model, max_batch=len(prompts), cuda_graphs=cuda_graphs)
    params = decode_params(cache, args)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, f"bench-{i}")

    def step() -> Optional[int]:
        outputs = engine.step()
        fed = [getattr(output, "fed_tokens", None) for output in outputs]
        return None if None in fed else sum(fed)

    return step


# ------------------------------------------------------------------------------ timing


class _KernelProbe:
    """Wraps an attention kernel to count the calls that carried a key mask: the flash kernel
    hands those to SDPA, so a 'flash' row may not have run flash at all."""

    def __init__(self, kernel: Callable) -> None:
        self.kernel = kernel
        self.calls = 0
        self.masked = 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 key_mask: Optional[torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        self.masked += key_mask is not None
        return self.kernel(q, k, v, key_mask)


@dataclass
class StepTimes:
    full: list[float]
    cached: list[float]
    fed_reported: dict[str, set[int]]


def random_prompts(batch: int, prompt_len: int, token_limit: int, seed: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, token_limit, (prompt_len,), generator=gen).tolist()) for _ in range(batch)]


def time_steps(model: DiffusionTransformer, prompts: list[tuple[int, ...]], cache: str,
               args: argparse.Namespace, cuda_graphs: bool = False) -> StepTimes:
    """Warm-up: one stepper through the first block's start and k cached steps. Then `repeats`
    fresh steppers, each timing the first block's start and its steps 1..k, so every repeat has
    the same shape (a prefix step's work shrinks with the block index)."""
    device = model.device
    k = min(args.cached_steps, args.block - 1)
    times = StepTimes([], [], {FULL: set(), CACHED: set()})
    for repeat in range(args.repeats + 1):
        step = make_stepper(model, prompts, cache, args, cuda_graphs)
        for i in range(1 + k):
            sync(device)
            start = time.perf_counter()
            fed = step()
            sync(device)
            elapsed = time.perf_counter() - start
            kind = FULL if i == 0 or cache == "none" else CACHED
            if repeat == 0:
                continue
            (times.full if kind == FULL else times.cached).append(elapsed)
            if fed is not None:
                times.fed_reported[kind].add(fed)
        del step
    return times


# ------------------------------------------------------------------------------ main


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", choices=("real", "mid", "tiny"), default="real",
                        help="mid: llada and dream at 1/8 of the width (for a CPU run)")
    parser.add_argument("--models", nargs="+", choices=(*MODELS, *BLOCK_MODELS, DG),
                        default=[*MODELS, *BLOCK_MODELS, DG],
                        help="sdar and llada2 run the block-causal step (bench/block_step.py), dg "
                             "DiffusionGemma-26B-A4B's uniform-noise step (bench/dg_step.py); --caches, "
                             "--gen-len and --quantization apply to llada and dream only")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=256)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--caches", nargs="+", choices=("none", "prefix", "dual"), default=["none", "prefix", "dual"])
    parser.add_argument("--repeats", type=int, default=5, help="timed blocks per row (after one warm-up block)")
    parser.add_argument("--cached-steps", type=int, default=31, help="cached steps timed per block (at most block-1)")
    parser.add_argument("--attention", choices=("auto", "sdpa"), default="auto",
                        help="auto: flash_attn and SDPA when flash_attn is importable on CUDA")
    parser.add_argument("--copy-mib", type=int, default=None, help="size of the bandwidth copy (default 1024 on "
                        "CUDA, 64 on CPU)")
    parser.add_argument("--matmul-n", type=int, default=None, help="side of the square matmul (default 8192 on "
                        "CUDA, 1024 on CPU)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="also time every dual row with the engine's CUDA graphs (EngineConfig.cuda_graphs; "
                        "default: on with --device cuda), "
                        "attention sdpa, labelled 'sdpa+graph' (each repeat's fresh engine captures its graph in "
                        "its first cached step, one of the steps the median is taken over); and the SDAR and "
                        "LLaDA2 denoise and next rows (bench/block_step.py: captured in an untimed pass)")
    parser.add_argument("--quantization", nargs="+", choices=("none", "int8", "int4", "fp8"), default=["none"],
                        help="weights of the decoder layers' linears, each a run (engine.quantization); the memory "
                             "floor counts the quantized bytes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    parser.add_argument("--real-dir", type=Path, default=REAL_DIR, help="folder with the released configs")
    add_tp_arguments(parser)
    args = parser.parse_args(argv)
    if args.gen_len % args.block:
        parser.error(f"--block {args.block} must divide --gen-len {args.gen_len}")
    if args.block < 2 and any(c != "none" for c in args.caches):
        parser.error("--block must be >= 2 for a cached step to exist")
    if args.repeats < 1 or args.cached_steps < 1:
        parser.error("--repeats and --cached-steps must be >= 1")
    on_cuda = torch.device(args.device).type == "cuda"
    if args.cuda_graphs and not on_cuda:
        parser.error("--cuda-graphs needs --device cuda")
    if args.cuda_graphs is None:
        args.cuda_graphs = on_cuda
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; on CPU run e.g. --shapes tiny --device cpu --dtype float32")
    return args


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


# (name, width, format of a value); text columns are left-aligned, numbers right-aligned.
_COLUMNS = (("model", 6, "s"), ("quant", 5, "s"), ("batch", 5, "d"), ("cache", 6, "s"), ("step", 7, "s"),
            ("attn", 10, "s"),
            ("step_ms", 10, ".3f"), ("fed_tok", 7, "d"), ("tok_per_s", 11, ".0f"), ("mem_floor_ms", 12, ".3f"),
            ("comp_floor_ms", 13, ".3f"), ("floor_ms", 10, ".3f"), ("step/floor", 10, ".2f"))
COLUMNS = tuple(name for name, _, _ in _COLUMNS)


def _format_row(values: Sequence[Any]) -> str:
    cells = []
    for value, (_, width, fmt) in zip(values, _COLUMNS, strict=True):
        text = format(value, fmt)
        cells.append(text.ljust(width) if fmt == "s" else text.rjust(width))
    return " ".join(cells).rstrip()


def _format_header() -> str:
    return " ".join(name.ljust(width) if fmt == "s" else name.rjust(width) for name, width, fmt in _COLUMNS)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        _run(args, list(sys.argv[1:] if argv is None else argv))
    finally:  # main may be called in-process (tests): leave torch as it was
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, argv_shown: list[str]) -> None:
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    on_cuda = device.type == "cuda"
    rates = measure_rates(device, dtype, args.copy_mib or (1024 if on_cuda else 64),
                          args.matmul_n or (8192 if on_cuda else 1024))
    kernels: list[tuple[str, Callable]] = [("sdpa", sdpa_attention)]
    if args.attention == "auto" and on_cuda and dtype in (torch.float16, torch.bfloat16) and flash_attn_available():
        kernels.append(select_attention(device, dtype, use_flash=True))
        attn_note = ("flash_attn and sdpa, each row with both; 'flash>sdpa' = every attention call carried a key "
                     "mask, which flash_attn_func cannot take, so SDPA ran; 'flash~' = some calls did")
    else:
        why = "--attention sdpa" if args.attention == "sdpa" else \
            "flash_attn is not importable" if not flash_attn_available() else "flash_attn needs CUDA and fp16/bf16"
        attn_note = f"sdpa only ({why})"

    print(f"# command: python bench/gpu_step.py {shlex.join(argv_shown)}".rstrip())
    print(f"# device: {_device_name(device)}; torch {torch.__version__}; dtype {args.dtype}; "
          f"shapes {args.shapes}; attention: {attn_note}")
    print(f"# measured: copy bandwidth {rates.copy_bytes_per_s / 1e9:.1f} GB/s (read+write), "
          f"{args.dtype} matmul {rates.matmul_flops_per_s / 1e12:.3f} TFLOP/s")
    k = min(args.cached_steps, args.block - 1)
    print(f"# prompt {args.prompt_len} + gen {args.gen_len}, block {args.block}, fixed policy 1 token/step; "
          f"median of {args.repeats} block starts (full) and {args.repeats}x{k} steps 1..{k} (cached), first block")
    print("# fed_tok = tokens the model consumed in the step; floor = max(bytes / bandwidth, FLOPs / matmul rate)")
    if args.tensor_parallel_size > 1:
        run_tensor_parallel(args, device, dtype, model_spec, random_prompts)
        return
    print(_format_header())

    for mode in args.quantization:
        check_quantization(mode, device, dtype)
    for name, quant in [(name, mode) for name in args.models if name in MODELS for mode in args.quantization]:
        spec = model_spec(name, args.shapes, args.real_dir)
        start = time.perf_counter()
        model = build_random_model(spec, device, dtype, args.seed)
        dims = ModelDims.of(model, quant)
        total = sum(p.numel() for p in model.parameters())  # a tied head is counted once
        quantize_linears(model.layers, quant)
        print(f"# {name}: {model.display_name} {args.shapes} shapes, {total / 1e9:.3f}B parameters "
              f"({dims.num_layers} layers, hidden {dims.hidden_size}), quantization {quant}, built in "
              f"{time.perf_counter() - start:.1f} s")
        for batch in args.batches:
            prompts = random_prompts(batch, args.prompt_len, spec.token_limit, args.seed + batch)
            for cache in args.caches:
                variants = [(attn_name, kernel, False) for attn_name, kernel in kernels]
                if args.cuda_graphs and cache == "dual":
                    variants.append(("sdpa", sdpa_attention, True))
                for attn_name, kernel, graphs in variants:
                    probe = _KernelProbe(kernel)
                    model.set_attention_kernel(attn_name, probe)
                    times = time_steps(model, prompts, cache, args, graphs)
                    label = f"{attn_name}+graph" if graphs else attn_name
                    if attn_name != "sdpa" and probe.masked:
                        # flash_attn has no key mask: every masked call ran SDPA instead
                        label = f"{attn_name[:5]}>sdpa" if probe.masked == probe.calls else f"{attn_name[:5]}~"
                    kinds = [(FULL, times.full)] + ([(CACHED, times.cached)] if cache != "none" else [])
                    for kind, samples in kinds:
                        shape = step_shape(dims, batch, cache, kind, args.prompt_len, args.gen_len, args.block,
                                           block_start=args.prompt_len)
                        reported = times.fed_reported[kind]
                        if reported and reported != {shape.fed_tokens}:
                            print(f"# warning: the engine reports {sorted(reported)} tokens fed, the floor counts "
                                  f"{shape.fed_tokens} ({name} batch {batch} {cache} {kind})")
                        step_s = statistics.median(samples)
                        mem_s = step_bytes(dims, shape) / rates.copy_bytes_per_s
                        comp_s = step_flops(dims, shape) / rates.matmul_flops_per_s
                        floor_s = max(mem_s, comp_s)
                        print(_format_row((name, quant, batch, cache, kind, label, 1e3 * step_s, shape.fed_tokens,
                                           shape.fed_tokens / step_s, 1e3 * mem_s, 1e3 * comp_s,
                                           1e3 * floor_s, step_s / floor_s)), flush=True)
        model.set_attention_kernel("sdpa", sdpa_attention)
        del model
        free_model()
    for name in (name for name in args.models if name in BLOCK_MODELS):
        run_block_model(name, args, device, dtype, rates, lambda row: print(_format_row(row), flush=True),
                        random_prompts)
        free_model()
    if DG in args.models:
        run_dg_model(args, device, dtype, rates, lambda row: print(_format_row(row), flush=True))
        free_model()


if __name__ == "__main__":
    main()
