"""bench/gpu_step.py's rows for DiffusionGemma (uniform-noise block diffusion, engine/uniform_mode.py):
the engine's step at DiffusionGemma-26B-A4B's shapes with random weights, next to its roofline floor.

Each row's request decodes two canvases after its prompt (dg-official, the adaptive stop off and
`max_denoising_steps` = k + 1, so a canvas lasts exactly k + 1 steps; ignore_eos). Three kinds of step:

- `prefill`: the first canvas's first step: the causal encoder pass over the prompt, then the
  decoder over the canvas against it (fed prompt + canvas);
- `denoise`: steps 1..k of the first canvas: the decoder over the canvas alone;
- `next`: the second canvas's first step: the encoder pass over the committed canvas, then the
  decoder over the new canvas (fed 2 x canvas).

Floor = max(bytes / copy bandwidth, FLOPs / matmul rate), counted here:
bytes = per forward pass (an encoder pass, a decoder pass) every weight but the routed experts, plus
each routed expert the pass sent a token to (counted by wrapping the routers during the warm-up
pass, random router: printed per kind), the tied embedding matrix twice in a decoder step (the
logits, and the soft embeddings that self-condition the next step), the embedding rows looked up,
and every cached key/value column the passes read (full layers: every cached position; sliding
layers: at most `sliding_window - 1`);
FLOPs = 2 x the parameters a token runs through (dense MLP, attention, the router and top-k of the
experts) x tokens fed (the encoder's last layer, which only writes keys and values, counted whole),
2 x 2 x vocab x hidden per canvas position (logits and soft embeddings), the self-conditioning MLP
per canvas position, and attention's two matmuls over the keys each query sees.

Shapes: `REAL_CONFIG`, DiffusionGemma-26B-A4B's config.json as a dict (no released file is at hand).
transformers 5.23.0's `DiffusionGemmaTextConfig`/`DiffusionGemmaConfig` defaults give the layer count
(30), the 5:1 sliding/full pattern, the vocabulary (262,144), the full layers' head dim (512), RoPE,
soft-capping (30) and the canvas (256); their width defaults (hidden 2304, 8 heads, 4 KV heads, no
experts) are not the 26B-A4B's. Hidden 2816, dense MLP 2112, 16 heads, 8 KV heads of 256, 2 KV
heads on the full layers, sliding window 1024, 128 experts top-8 of 704 are the released
gemma-4-26B-A4B text config as several public repositories quote it (transformers' own expert-
parallel plan comment names its num_global_key_value_heads=2); docs/performance.md says so too.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from block_step import ExpertCounter
from random_models import build_random
from roofline import DeviceRates, sync

from engine.decoding import DecodeParams
from engine.engine import Engine
from engine.models.diffusion_gemma import DiffusionGemmaModel
from engine.models.gemma4_config import FULL, SLIDING
from engine.models.gemma4_moe import Gemma4Router
from engine.models.moe import GroupedExperts
from engine.special_tokens import SpecialTokens

NAME = "dg"
PREFILL, DENOISE, NEXT = "prefill", "denoise", "next"
_LAYER_TYPES = [SLIDING if (i + 1) % 6 else FULL for i in range(30)]
REAL_CONFIG: dict[str, Any] = {
    "architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma", "canvas_length": 256,
    "tie_word_embeddings": True,
    "text_config": {
        "vocab_size": 262_144, "hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512,
        "num_global_key_value_heads": 2, "sliding_window": 1024, "layer_types": _LAYER_TYPES,
        "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262_144,
    },
}
# Gemma's ids (DiffusionGemmaTextConfig: pad 0, eos 1, bos 2; generation_config adds <turn|> 106)
SPECIAL = SpecialTokens(mask_id=None, eos_ids=(1, 106), pad_id=0, bos_id=2)
TOKEN_LIMIT = 106  # prompt ids are drawn from [TOKEN_LIMIT, vocab): above every special id
# Tiny shapes keep the ids and the layer pattern (5 sliding, 1 full) and shrink the sizes, the
# vocabulary too: every step samples, tempers and soft-embeds the whole vocabulary at every position.
TINY_TEXT = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
             "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
             "sliding_window": 16, "layer_types": _LAYER_TYPES[:6], "num_experts": 8, "top_k_experts": 2,
             "moe_intermediate_size": 32}
TINY_CANVAS = 16


def dg_config(shapes: str) -> dict[str, Any]:
    config = copy.deepcopy(REAL_CONFIG)
    if shapes == "tiny":
        config["text_config"].update(TINY_TEXT)
        config["canvas_length"] = TINY_CANVAS
    elif shapes != "real":
        raise ValueError(f"unknown shapes {shapes!r}")
    return config


def random_dg_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(TOKEN_LIMIT, vocab, (prompt_len,), generator=gen).tolist()) for _ in range(batch)]


# ------------------------------------------------------------------------------ timing


@dataclass
class DgTimes:
    seconds: dict[str, list[float]]
    fed_reported: dict[str, set[int]]
    experts_touched: dict[str, list[int]]  # per step of the warm-up pass


def time_dg_steps(model: DiffusionGemmaModel, prompts: list[tuple[int, ...]], cached_steps: int,
                  repeats: int, graphs: bool = False) -> DgTimes:
    """Warm-up pass (experts counted, eager rows only), then `repeats` fresh engines, each timed through
    every step of the first canvas and the second canvas's first step. With `graphs`, the decoder
    and commit passes run as CUDA graphs (EngineConfig.cuda_graphs; a prompt's encoder pass runs
    eagerly): each engine decodes the prompts once untimed, capturing its shapes, then again timed
    (the store keeps its width, so its graphs stay)."""
    canvas = model.canvas_length
    params = DecodeParams(policy="dg-official", gen_length=2 * canvas, block_length=canvas,
                          max_denoising_steps=cached_steps + 1, adaptive_stop=False, ignore_eos=True)
    kinds = (PREFILL, DENOISE, NEXT)
    times = DgTimes({k: [] for k in kinds}, {k: set() for k in kinds}, {k: [] for k in kinds})
    for repeat in range(repeats + 1):
        engine = Engine.from_model(model, max_batch=len(prompts), cuda_graphs=graphs)
        if graphs:
            engine.generate(list(prompts), params)
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, f"bench-{i}")
        counter = ExpertCounter(model, Gemma4Router) if repeat == 0 and not graphs else None
        for step in range(cached_steps + 2):
            kind = PREFILL if step == 0 else NEXT if step == cached_steps + 1 else DENOISE
            if counter is not None:
                counter.touched = 0
            sync(model.device)
            start = time.perf_counter()
            outputs = engine.step()
            sync(model.device)
            elapsed = time.perf_counter() - start
            if counter is not None:
                times.experts_touched[kind].append(counter.touched)
            elif repeat:
                times.seconds[kind].append(elapsed)
                times.fed_reported[kind].add(sum(o.fed_tokens for o in outputs))
        if counter is not None:
            counter.remove()
        del engine
    return times


# ------------------------------------------------------------------------------ the floor


@dataclass(frozen=True)
class DgStepShape:
    batch: int
    cached: int  # positions in each row's cache before the step
    encoded: int  # tokens the encoder pass feeds per row (0: no encoder pass)
    canvas: int

    @property
    def fed(self) -> int:
        return self.encoded + self.canvas


def dg_step_shape(kind: str, batch: int, prompt_len: int, canvas: int) -> DgStepShape:
    if kind == PREFILL:
        return DgStepShape(batch, 0, prompt_len, canvas)
    if kind == DENOISE:
        return DgStepShape(batch, prompt_len, 0, canvas)
    return DgStepShape(batch, prompt_len, canvas, canvas)


@dataclass(frozen=True)
class DgDims:
    """What the floor needs of a DiffusionGemma model (counts of parameters, not bytes)."""

    vocab: int
    hidden: int
    heads: int
    elem_bytes: int
    layers: tuple[tuple[str, int, int], ...]  # per layer: (kind, KV heads, head_dim)
    retained: int  # positions a sliding layer keeps
    window: int
    layer_dense: int  # the layers' weights but the routed experts (attention, dense MLP, router, norms, scalars)
    expert: int  # one routed expert
    experts_per_token: int
    self_conditioning: int

    @classmethod
    def of(cls, model: DiffusionGemmaModel) -> DgDims:
        gemma = model.gemma
        experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        expert = sum(p.numel() for p in experts[0].parameters()) // gemma.num_experts
        layers_all = sum(p.numel() for p in model.layers.parameters())
        kinds = tuple((t, gemma.attention(i).num_kv_heads, gemma.attention(i).head_dim)
                      for i, t in enumerate(gemma.layer_types))
        return cls(vocab=model.config.vocab_size, hidden=model.config.hidden_size, heads=model.config.num_heads,
                   elem_bytes=model.dtype.itemsize, layers=kinds, retained=gemma.retained,
                   window=gemma.sliding.window or 0,
                   layer_dense=layers_all - len(experts) * gemma.num_experts * expert + model.norm.weight.numel(),
                   expert=expert, experts_per_token=gemma.experts_per_token,
                   self_conditioning=sum(p.numel() for p in model.self_conditioning.parameters()))


def _columns(kind: str, dims: DgDims, cached: int) -> int:
    """Cached positions a layer of `kind` keeps (and a pass reads) after `cached` positions."""
    return min(cached, dims.retained) if kind == SLIDING else cached


def _encoder_keys(kind: str, dims: DgDims, cached: int, fed: int) -> int:
    """Keys the `fed` causal queries of one row see in all, in one layer (sliding: the window)."""
    return sum(min(cached + i + 1, dims.window) if kind == SLIDING else cached + i + 1 for i in range(fed))


def dg_step_flops(dims: DgDims, shape: DgStepShape) -> int:
    per_token = dims.layer_dense + dims.experts_per_token * dims.expert
    head = 2 * 2 * dims.vocab * dims.hidden * shape.canvas  # logits and soft embeddings
    keys = 0
    for kind, _, head_dim in dims.layers:
        encoder = _encoder_keys(kind, dims, shape.cached, shape.encoded)
        decoder = shape.canvas * (_columns(kind, dims, shape.cached + shape.encoded) + shape.canvas)
        keys += dims.heads * head_dim * (encoder + decoder)
    return shape.batch * (2 * per_token * shape.fed + head + 2 * dims.self_conditioning * shape.canvas + 4 * keys)


def dg_step_bytes(dims: DgDims, shape: DgStepShape, experts_touched: float) -> int:
    passes = 2 if shape.encoded else 1
    weights = passes * dims.layer_dense + int(experts_touched) * dims.expert + dims.self_conditioning \
        + 2 * dims.vocab * dims.hidden + shape.batch * shape.fed * dims.hidden
    kv = 0
    for kind, kv_heads, head_dim in dims.layers:
        columns = _columns(kind, dims, shape.cached + shape.encoded)  # the decoder pass
        if shape.encoded:
            columns += _columns(kind, dims, shape.cached)  # the encoder pass
        kv += 2 * kv_heads * head_dim * columns * shape.batch
    return (weights + kv) * dims.elem_bytes


# ------------------------------------------------------------------------------ rows


def run_dg_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, rates: DeviceRates,
                 emit: Callable[[tuple], None]) -> None:
    """Print DiffusionGemma's rows (through `emit`, gpu_step's row format) for every batch size."""
    hf = dg_config(args.shapes)
    start = time.perf_counter()
    model: DiffusionGemmaModel = build_random(hf, SPECIAL, device, dtype, args.seed)
    dims = DgDims.of(model)
    gemma, total = model.gemma, sum(p.numel() for p in model.parameters())
    k = max(1, args.cached_steps)
    print(f"# {NAME}: {model.display_name} {args.shapes} shapes, {total / 1e9:.3f}B parameters "
          f"({len(dims.layers)} layers, {len(gemma.layers_of(FULL))} full, hidden {dims.hidden}, MoE "
          f"{gemma.num_experts} experts top-{gemma.experts_per_token} of {dims.expert / 1e6:.2f}M params each, "
          f"canvas {model.canvas_length}), built in {time.perf_counter() - start:.1f} s; uniform mode, "
          f"{k} denoising steps timed per canvas")
    # CUDA graphs rows where the engine captures the decoder and commit passes (float32 experts run eagerly)
    captures = getattr(args, "cuda_graphs", False) and Engine.from_model(model, cuda_graphs=True).mode.static_forwards
    touched_eager: dict[tuple[int, str], float] = {}
    graphs = (False, True) if captures else (False,)
    for batch, graph in [(batch, graph) for batch in args.batches for graph in graphs]:
        prompts = random_dg_prompts(batch, args.prompt_len, dims.vocab, args.seed + batch)
        times = time_dg_steps(model, prompts, k, args.repeats, graph)
        for kind in (PREFILL, DENOISE, NEXT):
            shape = dg_step_shape(kind, batch, args.prompt_len, model.canvas_length)
            fed = batch * shape.fed
            if times.fed_reported[kind] != {fed}:
                print(f"# warning: the engine reports {sorted(times.fed_reported[kind])} tokens fed, the floor "
                      f"counts {fed} ({NAME} batch {batch} {kind})")
            passes = 2 if shape.encoded else 1
            if not graph:  # the graph rows reuse the eager rows' count (a replay runs no Python hook)
                touched_eager[batch, kind] = statistics.mean(times.experts_touched[kind])
                print(f"# {NAME} batch {batch} {kind}: {touched_eager[batch, kind] / (passes * len(dims.layers)):.1f} "
                      f"of {gemma.num_experts} routed experts touched per layer and pass (measured, random router)")
            touched = touched_eager[batch, kind]
            step_s = statistics.median(times.seconds[kind])
            mem_s = dg_step_bytes(dims, shape, touched) / rates.copy_bytes_per_s
            comp_s = dg_step_flops(dims, shape) / rates.matmul_flops_per_s
            floor_s = max(mem_s, comp_s)
            label = f"{model.attention_backend}+graph" if graph else model.attention_backend
            emit((NAME, "none", batch, "exact", kind, label, 1e3 * step_s, fed, fed / step_s,
                  1e3 * mem_s, 1e3 * comp_s, 1e3 * floor_s, step_s / floor_s))
    del model
