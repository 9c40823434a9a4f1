"""bench/gpu_step.py's rows at `--tensor-parallel-size N` > 1: the engine's step over N ranks
against one rank, measured in the same run, on the same random weights' shapes.

Each rank builds its own random shard (`random_models.build_random_rank`: no checkpoint); the
baseline is the same model whole on one device (rank 0's). Each engine decodes, per repeat, a batch
of fresh requests on the engine that decoded the last one (a tensor-parallel engine is not
restarted per repeat), so the baseline is timed the same way: the first step of a repeat (the
block start: a full forward, or for a block-diffusion model the prefill of the prompt's blocks)
and its steps 1..k (cached or denoising). On CPU the ranks share the host's cores: each of N ranks
runs cores/N threads, the baseline all of them. On CUDA rank r runs on GPU r (NCCL). `wire_kb` is
what rank 0 received from its peers in the step (`WireCount`: the layers' all-reduces and the decide's
reductions, engine/decoding/vocab_parallel.py).

    python bench/gpu_step.py -tp 2                    # real shapes, bf16, GPUs 0 and 1
    python bench/gpu_step.py -tp 2 --device cpu --dtype float32 --shapes mid --models llada \\
        --prompt-len 256 --gen-len 64 --block 32 --batches 1 8 --caches none dual --repeats 3 --cached-steps 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from block_step import BLOCK_MODELS, block_spec
from random_models import build_random
from roofline import sync

from engine.config import EngineConfig
from engine.cpus import default_threads
from engine.decoding import DecodeParams
from engine.engine import Engine
from engine.errors import TensorParallelError
from engine.executor.start import start_engine
from engine.models.parallel.group import WireCount

COLUMNS = ("model", "tp", "batch", "cache", "step", "step_ms", "fed_tok", "tok_per_s", "vs_tp1", "wire_kb")


def _params(block_model: bool, cache: str, args: argparse.Namespace) -> DecodeParams:
    if block_model:  # bench/block_step.py's request: one token a step, the exact cache
        return DecodeParams(policy="block-static", gen_length=args.gen_len, block_length=args.block,
                            steps=args.gen_len, ignore_eos=True)
    return DecodeParams(policy="fixed", gen_length=args.gen_len, block_length=args.block, steps=args.gen_len,
                        cache=cache, refresh_interval=0, early_exit=False)


def time_engine(engine: Engine, prompts: list[tuple[int, ...]], params: DecodeParams,
                args: argparse.Namespace) -> dict[str, tuple[list[float], int, int]]:
    """{step kind: (seconds of each timed step, tokens fed, bytes rank 0 received from its peers in
    the last one: every layer's all-reduces and the decide's reductions)} over `repeats` batches
    after a warm-up."""
    k = min(args.cached_steps, args.block - 1)
    first, rest = ("prefill", "denoise") if engine.family.mode == "block" else ("full", "cached")
    times: dict[str, list[float]] = {first: [], rest: []}
    fed: dict[str, int] = {}
    wire: dict[str, int] = {}
    for repeat in range(args.repeats + 1):
        ids = [engine.add_request(p, params, f"bench-{repeat}-{i}") for i, p in enumerate(prompts)]
        for step in range(1 + k):
            sync(engine.model.device)
            started, received = time.perf_counter(), WireCount.bytes
            outputs = engine.step()
            sync(engine.model.device)
            kind = first if step == 0 or params.cache == "none" else rest
            if repeat:
                times[kind].append(time.perf_counter() - started)
                fed[kind] = sum(o.fed_tokens for o in outputs)
                wire[kind] = WireCount.bytes - received
        for request_id in ids:  # leave at the next step, which admits the next repeat's batch
            engine.abort(request_id)
    return {kind: (samples, fed[kind], wire[kind]) for kind, samples in times.items() if samples}


def _spec(name: str, args: argparse.Namespace, model_spec: Callable) -> tuple[dict[str, Any], Any, int]:
    """(hf config, special ids, lowest special id) of `name` at the run's shapes."""
    if name in BLOCK_MODELS:
        spec = block_spec(name, args.shapes, args.real_dir)
        return spec.hf_config, spec.special, spec.token_limit
    spec = model_spec(name, args.shapes, args.real_dir)
    return spec.hf_config, spec.checkpoint.special_tokens(), spec.token_limit


def run_tensor_parallel(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                        model_spec: Callable, random_prompts: Callable) -> None:
    size = args.tensor_parallel_size
    on_cpu = device.type == "cpu"
    cores = args.threads or default_threads()
    ranks = f"gloo, {max(1, cores // size)} CPU threads each" if on_cpu else "NCCL, GPU r for rank r"
    one = f"{cores} CPU threads" if on_cpu else "GPU 0"
    print(f"# tensor parallel: {size} ranks ({ranks}) against 1 rank ({one}); vs_tp1 = the 1-rank step time / "
          f"this one; median of {args.repeats} repeats")
    print(" ".join(COLUMNS))
    for name in args.models:
        if name in BLOCK_MODELS and args.shapes not in ("real", "tiny"):
            print(f"# {name}: skipped: bench/block_step.py has no {args.shapes!r} shapes")
            continue
        hf, special, limit = _spec(name, args, model_spec)
        block_model = name in BLOCK_MODELS
        caches = ["exact"] if block_model else args.caches
        baseline: dict[tuple, float] = {}
        for tp in (1, size):
            torch.set_num_threads(cores if tp == 1 or not on_cpu else max(1, cores // size))
            config = EngineConfig(model="", device="cuda" if not on_cpu else "cpu", dtype=args.dtype,
                                  max_batch=max(args.batches), tensor_parallel_size=tp)
            started = time.perf_counter()
            try:
                if tp == 1:
                    engine = Engine.from_model(build_random(hf, special, device, dtype, args.seed),
                                               max_batch=max(args.batches))
                else:
                    factory = ("random_models:build_random_rank",
                               {"hf_config": hf, "special": special, "dtype": dtype, "seed": args.seed})
                    engine = start_engine(config, model_factory=factory)
            except (TensorParallelError, torch.cuda.OutOfMemoryError) as err:
                print(f"# {name} tp {tp}: {type(err).__name__}: {err}")
                continue
            print(f"# {name} tp {tp}: built in {time.perf_counter() - started:.1f} s")
            try:
                for batch in args.batches:
                    prompts = random_prompts(batch, args.prompt_len, limit, args.seed + batch)
                    for cache in caches:
                        for kind, (samples, fed, wire) in time_engine(engine, prompts,
                                                                      _params(block_model, cache, args), args).items():
                            step = statistics.median(samples)
                            key = (batch, cache, kind)
                            if tp == 1:
                                baseline[key] = step
                            ratio = baseline.get(key, float("nan")) / step
                            print(f"{name} {tp} {batch} {cache} {kind} {1e3 * step:.2f} {fed} {fed / step:.0f} "
                                  f"{ratio:.2f} {wire / 1e3:.1f}", flush=True)
            finally:
                engine.close()
                del engine
    torch.set_num_threads(cores)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="time the step over this many ranks against one (bench/tp_step.py)")

