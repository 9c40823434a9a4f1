"""bench/gpu_step.py's rows for the block-diffusion models (SDAR-8B-Chat, LLaDA2.0-mini): the
engine's block-causal step timed next to its roofline floor.

Each row's request decodes two blocks after a prompt of whole blocks (block-static policy, one
token a step, so a block lasts `block` steps; ignore_eos). Three kinds of step are timed:

- `prefill`: the first block's first step: the prompt's whole blocks ride along in front of the
  block and their keys/values enter the exact cache (fed prompt + block);
- `denoise`: steps 1..k of the first block: the block alone against the cache of the prompt;
- `next`: the second block's first step: the finished block rides along (its keys/values are
  written) in front of the new block, against the cache of the prompt.

Floor = max(bytes / copy bandwidth, FLOPs / matmul rate), as bench/roofline.py counts them:
bytes = the weights the step reads + the embedding rows looked up + every cached key/value
column read (the keys/values the step writes are not counted); FLOPs = 2 x params x tokens (the
last layer past its k/v projections, the norm and the head at the block's positions only) +
attention's two matmuls over the keys each position sees under the block-causal mask.
MoE (LLaDA2): a token runs the router, the shared expert and its `num_experts_per_tok` routed
experts, so FLOPs count those; bytes count the dense and shared weights and, per MoE layer, only
the routed experts the step actually sent a token to, counted by a hook during the warm-up pass
(the same prompts and weights as the timed passes, so the same routing). Random weights route
unlike a trained router: the touched-expert count, printed per kind, is what this run measured.

Configs: SDAR from the released `sdar-8b-chat/config.json` (special ids from its tokenizer
files); LLaDA2.0-mini from `llada2.0-mini/hub_config_observed.json` (the config.json of DMax-Math-16B,
a fine-tune of LLaDA2.0-mini, as observed on the Hub) with `vocab_size` from
`dfactory_llada2_mini_config.json` and the special ids of `generate_defaults.json` (LLaDA2.0-mini's
own config.json is not available; README there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch
from random_models import build_random
from roofline import DeviceRates, ModelDims, StepShape, step_bytes, sync

from engine.decoding import DecodeParams
from engine.engine import Engine
from engine.loading.checkpoint import CheckpointFiles
from engine.models.block_transformer import BlockDiffusionTransformer
from engine.models.moe import MoeRouter
from engine.special_tokens import SpecialTokens, added_token_ids

BLOCK_MODELS = {"sdar": "sdar-8b-chat", "llada2": "llada2.0-mini"}
PREFILL, DENOISE, NEXT = "prefill", "denoise", "next"
# Tiny shapes keep the real vocabulary and ids and shrink the sizes; LLaDA2 keeps a dense first layer,
# grouped routing and a shared expert.
TINY_OVERRIDES: dict[str, dict[str, int]] = {
    "sdar": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 64, "intermediate_size": 688},
    "llada2": {"hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 64, "intermediate_size": 688, "num_experts": 16, "num_experts_per_tok": 4,
               "n_group": 4, "topk_group": 2, "moe_intermediate_size": 128},
}


@dataclass(frozen=True)
class BlockSpec:
    name: str
    hf_config: dict[str, Any]
    special: SpecialTokens
    token_limit: int  # prompt ids are drawn below every special and added id


def block_spec(name: str, shapes: str, real_dir: Path) -> BlockSpec:
    folder = real_dir / BLOCK_MODELS[name]
    if name == "sdar":
        checkpoint = CheckpointFiles.open(folder)
        hf, special = dict(checkpoint.config), checkpoint.special_tokens()
        added = added_token_ids(checkpoint.tokenizer_config or {}, checkpoint.added_tokens)
        limit = min([special.mask_id, special.pad_id, *special.eos_ids, *added.values()])
    else:
        observed = json.loads((folder / "hub_config_observed.json").read_text())["dmax_math_16b"]
        hf = {k: v for k, v in observed.items() if not k.startswith("_") and k != "auto_map"}
        hf["vocab_size"] = json.loads((folder / "dfactory_llada2_mini_config.json").read_text())["vocab_size"]
        ids = json.loads((folder / "generate_defaults.json").read_text())["special_ids"]
        special = SpecialTokens(mask_id=ids["mask_id"], eos_ids=(ids["eos_id"],), pad_id=ids["pad_token_id"])
        limit = min(ids["mask_id"], ids["eos_id"], ids["pad_token_id"])
    if shapes == "tiny":
        hf.update(TINY_OVERRIDES[name])
    elif shapes != "real":
        raise ValueError(f"unknown shapes {shapes!r}")
    return BlockSpec(name, hf, special, limit)


# ------------------------------------------------------------------------------ timing


@dataclass
class BlockTimes:
    seconds: dict[str, list[float]]
    fed_reported: dict[str, set[int]]
    experts_touched: dict[str, list[int]]  # per step of the warm-up pass: distinct routed experts, all MoE layers


class ExpertCounter:
    """Distinct experts every MoE router of a forward chose, summed over layers. The model calls its
    routers' `forward` directly (no module hooks run), so each router's bound method is wrapped on
    the instance for the warm-up pass and unwrapped after. A router returns the chosen expert ids
    first."""

    def __init__(self, model: torch.nn.Module, router_class: type = MoeRouter) -> None:
        self.touched = 0
        self.routers = [m for m in model.modules() if isinstance(m, router_class)]
        for router in self.routers:
            router.forward = self._counting(router.forward)

    def _counting(self, route: Callable) -> Callable:
        def counted(x: torch.Tensor) -> Any:
            out = route(x)
            self.touched += int(torch.unique(out[0]).numel())  # out[0]: the chosen expert ids
            return out
        return counted

    def remove(self) -> None:
        for router in self.routers:
            del router.forward  # the class's forward again


def _kind(step: int, block: int) -> str:
    return PREFILL if step == 0 else NEXT if step == block else DENOISE


def time_block_steps(model: BlockDiffusionTransformer, prompts: list[tuple[int, ...]],
                     args: argparse.Namespace, graphs: bool = False) -> BlockTimes:
    """Warm-up pass (expert counting on), then `repeats` fresh engines, each timed through the
    first block's start, its steps 1..k and the second block's start (the steps between run untimed).
    With `graphs`, the cached steps run as CUDA graphs (EngineConfig.cuda_graphs): each engine decodes
    the prompts once untimed, capturing its shapes, then again timed (the store keeps its width, so
    its graphs stay); the experts are counted in the eager rows only."""
    block, k = args.block, min(args.cached_steps, args.block - 1)
    params = DecodeParams(policy="block-static", gen_length=2 * block, block_length=block, steps=2 * block,
                          ignore_eos=True)
    kinds = (PREFILL, DENOISE, NEXT)
    times = BlockTimes({kind: [] for kind in kinds}, {kind: set() for kind in kinds}, {kind: [] for kind in kinds})
    for repeat in range(args.repeats + 1):
        engine = Engine.from_model(model, max_batch=len(prompts), cuda_graphs=graphs)
        if graphs:
            engine.generate(list(prompts), params)
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, f"bench-{i}")
        counter = ExpertCounter(model) if repeat == 0 and not graphs else None
        for step in range(block + 1):
            timed = step <= k or step == block
            if counter is not None:
                counter.touched = 0
            sync(model.device)
            start = time.perf_counter()
            outputs = engine.step()
            sync(model.device)
            elapsed = time.perf_counter() - start
            kind = _kind(step, block)
            if counter is not None and timed:
                times.experts_touched[kind].append(counter.touched)
            if repeat and timed:
                times.seconds[kind].append(elapsed)
                times.fed_reported[kind].add(sum(o.fed_tokens for o in outputs))
        if counter is not None:
            counter.remove()
        del engine
    return times


# ------------------------------------------------------------------------------ the floor


def _expert_params(model: BlockDiffusionTransformer) -> int:
    moe = model.config.moe
    return 3 * model.config.hidden_size * moe.expert_intermediate_size if moe else 0


def block_dims(model: BlockDiffusionTransformer, experts_touched: float) -> ModelDims:
    """ModelDims whose params are what one token runs through (FLOPs) and whose bytes are the
    weights the step reads: for MoE, `experts_touched` routed experts in all (summed over layers)."""
    dims = ModelDims.of(model)
    moe = model.config.moe
    if moe is None:
        return dims
    per_expert = _expert_params(model)
    moe_layers = model.config.num_layers - moe.first_dense_layers
    unrouted = per_expert * (moe.num_experts - moe.experts_per_token)  # an MoE layer's experts a token skips
    body_bytes = (dims.body_params - moe_layers * moe.num_experts * per_expert + int(experts_touched) * per_expert)
    return replace(dims, body_params=dims.body_params - moe_layers * unrouted,
                   layer_params=dims.layer_params - unrouted, body_bytes=body_bytes * dims.elem_bytes)


@dataclass(frozen=True)
class BlockStepShape:
    batch: int
    start: int  # cached columns per row before the step (all read)
    fed: int  # tokens fed per row: positions start .. start + fed - 1
    block: int  # the block being decoded: the last `block` fed positions, whose logits are computed

    def keys_seen(self, positions: range) -> int:
        """Keys the given positions attend over in all, block-causally (blocks from position 0)."""
        return sum((q // self.block + 1) * self.block for q in positions)

    @property
    def as_step_shape(self) -> StepShape:
        return StepShape(batch=self.batch, fed=self.fed, keys=self.start + self.fed, logits=self.block,
                         kv_read=self.start)


def block_step_shape(kind: str, batch: int, prompt_len: int, block: int) -> BlockStepShape:
    whole = prompt_len // block * block  # the prompt's whole blocks; prompt_len is a multiple of block here
    if kind == PREFILL:
        return BlockStepShape(batch, 0, whole + block, block)
    return BlockStepShape(batch, whole, block if kind == DENOISE else 2 * block, block)


def block_step_flops(dims: ModelDims, shape: BlockStepShape) -> int:
    fed = range(shape.start, shape.start + shape.fed)
    logits = range(shape.start + shape.fed - shape.block, shape.start + shape.fed)
    every_fed = dims.body_params - dims.wanted_only_params
    dense = 2 * shape.batch * (every_fed * shape.fed + (dims.wanted_only_params + dims.head_params) * shape.block)
    attention = 4 * shape.batch * dims.q_size * ((dims.num_layers - 1) * shape.keys_seen(fed)
                                                 + shape.keys_seen(logits))
    return dense + attention


def block_step_bytes(dims: ModelDims, shape: BlockStepShape) -> int:
    return step_bytes(dims, shape.as_step_shape)


# ------------------------------------------------------------------------------ rows


def run_block_model(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                    rates: DeviceRates, emit: Callable[[tuple], None],
                    random_prompts: Callable[[int, int, int, int], list[tuple[int, ...]]]) -> None:
    """Print `name`'s rows (through `emit`, gpu_step's row format) for every batch size."""
    if args.prompt_len % args.block:
        print(f"# {name}: skipped: --prompt-len {args.prompt_len} is not a multiple of --block {args.block} "
              f"(the prefill row assumes a prompt of whole blocks)")
        return
    spec = block_spec(name, args.shapes, args.real_dir)
    start = time.perf_counter()
    model = build_random(spec.hf_config, spec.special, device, dtype, args.seed)
    total = sum(p.numel() for p in model.parameters())
    moe = model.config.moe
    note = (f", MoE {moe.num_experts} experts top-{moe.experts_per_token} of {_expert_params(model) / 1e6:.2f}M "
            f"params each" if moe else "")
    print(f"# {name}: {model.display_name} {args.shapes} shapes, {total / 1e9:.3f}B parameters "
          f"({model.config.num_layers} layers, hidden {model.config.hidden_size}{note}), built in "
          f"{time.perf_counter() - start:.1f} s; block-causal mode, exact cache")
    # CUDA graphs rows where the engine captures this model's steps (a float32 MoE's run eagerly)
    captures = getattr(args, "cuda_graphs", False) and Engine.from_model(model, cuda_graphs=True).mode.static_forwards
    graphs = (False, True) if captures else (False,)
    touched_eager: dict[tuple[int, str], Optional[float]] = {}
    for batch, graph in [(batch, graph) for batch in args.batches for graph in graphs]:
        prompts = random_prompts(batch, args.prompt_len, spec.token_limit, args.seed + batch)
        times = time_block_steps(model, prompts, args, graph)
        for kind in (PREFILL, DENOISE, NEXT) if not graph else (DENOISE, NEXT):
            shape = block_step_shape(kind, batch, args.prompt_len, args.block)
            reported = times.fed_reported[kind]
            if reported != {batch * shape.fed}:
                print(f"# warning: the engine reports {sorted(reported)} tokens fed, the floor counts "
                      f"{batch * shape.fed} ({name} batch {batch} {kind})")
            if not graph:  # the graph rows reuse the eager rows' count (a replay runs no Python hook)
                touched_eager[batch, kind] = statistics.mean(times.experts_touched[kind]) if moe else None
            touched = touched_eager[batch, kind]
            dims = block_dims(model, touched or 0)
            if touched is not None and not graph:
                layers = model.config.num_layers - moe.first_dense_layers
                print(f"# {name} batch {batch} {kind}: {touched / layers:.1f} of {moe.num_experts} routed experts "
                      f"touched per MoE layer (measured, random router)")
            step_s = statistics.median(times.seconds[kind])
            mem_s = block_step_bytes(dims, shape) / rates.copy_bytes_per_s
            comp_s = block_step_flops(dims, shape) / rates.matmul_flops_per_s
            floor_s = max(mem_s, comp_s)
            fed = batch * shape.fed
            label = f"{model.attention_backend}+graph" if graph else model.attention_backend
            emit((name, "none", batch, "exact", kind, label, 1e3 * step_s, fed, fed / step_s,
                  1e3 * mem_s, 1e3 * comp_s, 1e3 * floor_s, step_s / floor_s))
    del model
