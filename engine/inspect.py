"""A quick description of a checkpoint directory, computed without reading any weight data."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch

from engine.errors import CheckpointError
from engine.loading.checkpoint import CheckpointFiles
from engine.loading.safetensors_stream import read_header
from engine.loading.weights import plan_weights
from engine.models.block_transformer import BlockDiffusionTransformer
from engine.models.diffusion_gemma import DiffusionGemmaModel
from engine.models.gemma4_config import FULL, SLIDING, AttentionKind
from engine.models.moe import GroupedExperts
from engine.models.registry import model_class_for
from engine.quantization import quantized_model_bytes
from engine.special_tokens import SpecialTokens

_GB = 1e9


def _special_ids(checkpoint: CheckpointFiles,
                 needs_mask: bool) -> tuple[Optional[SpecialTokens], Union[dict[str, Any], str]]:
    try:
        special = checkpoint.special_tokens(needs_mask=needs_mask)
    except CheckpointError as err:  # reported, not fatal: the rest of the description still holds
        return None, f"not loadable: {err}"
    return special, {"mask": special.mask_id, "eos": list(special.eos_ids), "eot": special.eot_id,
                     "pad": special.pad_id, "bos": special.bos_id}


def _block_diffusion_details(model: BlockDiffusionTransformer) -> dict[str, Any]:
    config = model.config
    details: dict[str, Any] = {
        "attention": "block-causal (block diffusion: bidirectional in a block, causal across blocks)",
        "block_size": config.block_size if config.block_size is not None
        else "not in config.json (the decoder's block length)",
        "head_dim": config.head_dim,
        "rotary_dims": config.rotary_dim,
        "qk_norm": config.qk_norm,
    }
    moe = config.moe
    if moe is not None:
        details["experts"] = (f"{moe.num_experts} routed, {moe.experts_per_token} per token (best {moe.topk_group} "
                              f"of {moe.num_groups} groups), {moe.num_shared_experts} shared; first "
                              f"{moe.first_dense_layers} layer(s) dense")
        idle = sum(sum(p.numel() for p in experts.parameters()) // moe.num_experts
                   * (moe.num_experts - moe.experts_per_token)
                   for experts in model.modules() if isinstance(experts, GroupedExperts))
        details["active_parameters"] = sum(p.numel() for p in model.parameters()) - idle
    return details


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _attention_kind(kind: AttentionKind, layers: int) -> str:
    window = f", window {kind.window}" if kind.window is not None else ""
    values = ", values = raw keys (k_eq_v)" if kind.values_from_keys else ""
    return (f"{layers} layer(s): head_dim {kind.head_dim}, {kind.num_kv_heads} KV head(s), RoPE θ {kind.rope_theta:g} "
            f"on {kind.rotated_pairs} of {kind.head_dim // 2} pairs{window}{values}")


def _layer_pattern(layer_types: tuple[str, ...]) -> str:
    """The layer types as letters (S sliding, F full), its repeating unit once where there is one."""
    letters = "".join("S" if t == SLIDING else "F" for t in layer_types)
    for period in range(1, len(letters) // 2 + 1):
        if len(letters) % period == 0 and letters[:period] * (len(letters) // period) == letters:
            return f"{letters[:period]} x{len(letters) // period} (S sliding, F full)"
    return f"{letters} (S sliding, F full)"


def _diffusion_gemma_details(model: DiffusionGemmaModel, dtype: torch.dtype) -> dict[str, Any]:
    gemma = model.gemma
    sliding, full = gemma.layers_of(SLIDING), gemma.layers_of(FULL)
    idle = sum(p.numel() for p in model.layers[0].experts.parameters()) // gemma.num_experts \
        * (gemma.num_experts - gemma.experts_per_token) * len(model.layers)
    ring = gemma.retained * len(sliding) * 2 * gemma.sliding.num_kv_heads * gemma.sliding.head_dim
    per_position = len(full) * 2 * gemma.full.num_kv_heads * gemma.full.head_dim
    return {
        "attention": (f"uniform-noise block diffusion: causal encoder over the prompt and each committed canvas, "
                      f"bidirectional decoder over a canvas of {gemma.canvas_length} random-initialised tokens"),
        "canvas_length": gemma.canvas_length,
        "layer_pattern": _layer_pattern(gemma.layer_types),
        "sliding_layers": _attention_kind(gemma.sliding, len(sliding)),
        "full_layers": _attention_kind(gemma.full, len(full)),
        "experts": (f"{gemma.num_experts} routed of intermediate size {gemma.expert_intermediate_size}, "
                    f"{gemma.experts_per_token} per token, beside a dense MLP of {model.config.intermediate_size} in "
                    f"every layer"),
        "active_parameters": sum(p.numel() for p in model.parameters()) - idle,
        "final_logit_softcapping": gemma.final_logit_softcapping,
        "kv_cache": (f"{_size(per_position * dtype.itemsize)} per cached position (full layers) + "
                     f"{_size(ring * dtype.itemsize)} per request (sliding rings of {gemma.retained} positions), "
                     f"{str(dtype).removeprefix('torch.')}"),
        "images": "not supported (the vision tower's weights are recognised and not loaded)",
    }


def describe_checkpoint(path: Union[str, Path]) -> dict[str, Any]:
    checkpoint = CheckpointFiles.open(path)
    cls = model_class_for(checkpoint.config)
    config = cls.parse_config(checkpoint.config)
    special, special_ids = _special_ids(checkpoint, getattr(cls, "uses_mask_token", True))
    with torch.device("meta"):
        model = cls(config, special, checkpoint.config)
    report: dict[str, Any] = {
        "path": str(checkpoint.path),
        "architecture": cls.display_name,
        "hf_architectures": checkpoint.config.get("architectures"),
        "model_type": checkpoint.config.get("model_type"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "heads": config.num_heads,
        "kv_heads": config.num_kv_heads,
        "vocab_size": config.vocab_size,
        "logits_shifted": config.logits_shifted,
        "dtype": checkpoint.config.get("torch_dtype") or checkpoint.config.get("dtype") or "not stated in config.json",
        "special_ids": special_ids,
        "weights_memory": weights_memory(model, _dtype_of(checkpoint.config.get("torch_dtype")
                                                          or checkpoint.config.get("dtype"))),
        "chat_template": checkpoint.has_chat_template,
        "tokenizer_files": sorted(p.name for p in checkpoint.path.iterdir()
                                  if p.name in ("tokenizer.json", "vocab.json", "merges.txt")),
    }
    if isinstance(model, BlockDiffusionTransformer):
        report.update(_block_diffusion_details(model))
    elif isinstance(model, DiffusionGemmaModel):
        report.update(_diffusion_gemma_details(model, _dtype_of(checkpoint.config.get("torch_dtype")
                                                                or checkpoint.config.get("dtype"))))
    try:
        files = checkpoint.weight_files()
        dtypes: set[str] = set()
        for file in files:
            dtypes.update(str(entry.dtype).removeprefix("torch.") for entry in read_header(file).values())
        plan = plan_weights(model, files)
        report["dtype"] = ", ".join(sorted(dtypes))
        report["weights"] = {"files": len(files), "bytes": sum(f.stat().st_size for f in files),
                             "status": "ok"}
        # a tensor read in several slices (fused projections, stacked experts) counts once
        loaded = sum(len({id(placement.entry) for placement in placements}) for placements in plan.values())
        skipped = sum(len(read_header(f)) for f in files) - loaded
        if skipped:
            report["weights"]["not_loaded"] = skipped  # recognised and not run (rotary buffers, a vision tower)
    except CheckpointError as err:
        report["weights"] = {"status": f"not loadable: {err}"}
    return report


def _dtype_of(name: Any) -> torch.dtype:
    """The checkpoint's stated dtype where the engine runs it, else bfloat16 (what large checkpoints use)."""
    dtype = getattr(torch, str(name), None) if name else None
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.bfloat16


def weights_memory(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, Any]:
    """The weights' bytes once loaded, per --quantization mode (the head in `dtype`, and quantized
    too), computed from the shapes; KV caches and activations come on top."""
    dtype_name = str(dtype).removeprefix("torch.")
    modes: dict[str, Any] = {"dtype": dtype_name, "none": quantized_model_bytes(model, "none", dtype)}
    for mode in ("int8", "int4", "fp8"):
        modes[mode] = quantized_model_bytes(model, mode, dtype)
        if not model.config.tie_word_embeddings:
            modes[f"{mode}+head"] = quantized_model_bytes(model, mode, dtype, quantize_head=True)
    return modes


def format_report(report: dict[str, Any]) -> str:
    width = max(len(k) for k in report)
    lines = []
    for key, value in report.items():
        if key in ("parameters", "active_parameters"):
            value = f"{value:,} ({value / 1e9:.2f}B)" if value >= 1e8 else f"{value:,}"
        elif key == "weights_memory":
            value = f"({value['dtype']}) " + ", ".join(f"{mode} {size / _GB:.2f} GB" if size >= 1e8
                                                       else f"{mode} {size / 1e6:.1f} MB"
                                                       for mode, size in value.items() if mode != "dtype")
        lines.append(f"{key.ljust(width)}  {value}")
    return "\n".join(lines)
