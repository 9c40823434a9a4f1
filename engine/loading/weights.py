"""`load_model`: a checkpoint directory in, a ready model on the requested device out.

The model is built on the meta device (no memory), given uninitialised storage on the target
device in the target dtype, and then filled tensor by tensor from the safetensors files, one
decoder layer at a time (quantized, when asked, before the next is allocated). Every name
and shape is checked against the weight table from the file headers before any data is read, so a
bad checkpoint fails in milliseconds and names the offending tensor.
"""

from __future__ import annotations

import ctypes
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from engine.devices import resolve
from engine.errors import CheckpointError, DeviceError
from engine.loading.checkpoint import CheckpointFiles
from engine.loading.safetensors_stream import TensorEntry, copy_tensor_into, read_header
from engine.models.attention import select_attention
from engine.models.registry import model_class_for
from engine.models.transformer import DiffusionTransformer
from engine.models.weight_names import expected_weights, ignored_weight
from engine.quantization import check_quantization, quantize_linear, quantize_linears


def _glibc() -> Optional[ctypes.CDLL]:
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (e.g. musl)
        return None


_LIBC = _glibc()


@dataclass(frozen=True)
class _Placement:
    entry: TensorEntry
    param: str
    rows: Optional[tuple[int, int]]  # (start, size) inside a fused parameter


def _destination(model: DiffusionTransformer, placement: _Placement) -> torch.Tensor:
    data = model.get_parameter(placement.param).data
    if placement.rows is None:
        return data
    start, size = placement.rows
    return data[start:start + size]


def plan_weights(model: DiffusionTransformer, files: list[Path]) -> dict[Path, list[_Placement]]:
    """Match every tensor in the files to a parameter, checking names and shapes; read no data."""
    expected = expected_weights(model.config)
    plan: dict[Path, list[_Placement]] = {}
    seen: set[str] = set()
    unexpected: list[str] = []
    for path in files:
        plan[path] = []
        for name, entry in read_header(path).items():
            if name not in expected:
                if not ignored_weight(name, model.config):
                    unexpected.append(name)
                continue
            if name in seen:
                raise CheckpointError(f"weight {name} appears in more than one shard")
            seen.add(name)
            param, shard = expected[name]
            rows = None
            if shard is not None:
                module = model.get_submodule(param.rsplit(".", 1)[0])
                rows = module.shard_offsets[shard]
            placement = _Placement(entry, param, rows)
            want = tuple(_destination(model, placement).shape)
            if entry.shape != want:
                raise CheckpointError(f"weight {name} has shape {list(entry.shape)} but the config "
                                      f"implies {list(want)} (in {path.name})")
            plan[path].append(placement)
    if unexpected:
        shown = ", ".join(sorted(unexpected)[:5]) + (" …" if len(unexpected) > 5 else "")
        raise CheckpointError(f"{len(unexpected)} weight(s) are not part of a {model.display_name} model "
                              f"with this config: {shown}")
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
        raise CheckpointError(f"{len(missing)} weight(s) missing from the checkpoint: {shown}")
    return plan


def release_freed_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing). The
    quantizers' temporaries are freed into the heap, where glibc keeps them resident: without this a
    quantized load ends well above its weights' size (bench/load_memory.py)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _layer_of(param: str) -> Optional[int]:
    """The decoder layer a parameter belongs to (`layers.{i}.…`), None outside the layers."""
    parts = param.split(".", 2)
    return int(parts[1]) if parts[0] == "layers" and len(parts) > 2 else None


def _materialize_outside_layers(model: nn.Module, device: torch.device) -> None:
    """Allocate every module but the decoder layers on `device`. A function of its own so that no
    loop variable outlives it: one left holding the float output head would keep it resident
    after `quantize_head` replaced it, for the whole load."""
    for name, child in model.named_children():
        if name != "layers":
            child.to_empty(device=device)


def load_model(path: Union[str, Path], device: Union[str, torch.device] = "cpu",
               dtype: Union[str, torch.dtype] = torch.float32, *,
               use_flash_attn: Optional[bool] = None, quantization: str = "none",
               quantize_head: bool = False) -> DiffusionTransformer:
    """Load a LLaDA or Dream checkpoint (local directory, safetensors) for inference.

    The returned module maps `(input_ids, attention_mask=None, position_ids=None)` to raw logits
    [B, L, vocab]; `.config`, `.special` (token ids), `.hf_config` and `.logits_shifted` describe it.
    With `quantization` (engine.quantization), each decoder layer's linear layers are quantized as
    soon as that layer's weights are read, so peak memory is the quantized model plus one float layer.
    """
    checkpoint = CheckpointFiles.open(path)
    cls = model_class_for(checkpoint.config)
    config = cls.parse_config(checkpoint.config)
    special = checkpoint.special_tokens(needs_mask=getattr(cls, "uses_mask_token", True))
    files = checkpoint.weight_files()
    target_device, target_dtype = resolve(device, dtype)
    check_quantization(quantization, target_device, target_dtype)
    if quantize_head and quantization == "none":
        raise DeviceError("quantize_head needs a --quantization mode other than none")
    if quantize_head and config.tie_word_embeddings:
        raise CheckpointError("quantize_head needs an untied output head: this checkpoint ties it to the "
                              "embedding, which stays in the model dtype")

    with torch.device("meta"):
        model = cls(config, special, checkpoint.config)
    plan = plan_weights(model, files)
    model = model.to(dtype=target_dtype)
    by_layer: dict[Optional[int], list[tuple[Path, _Placement]]] = {}
    for file, placements in plan.items():
        for placement in placements:
            by_layer.setdefault(_layer_of(placement.param), []).append((file, placement))

    with torch.no_grad(), ExitStack() as files_open:
        handles = {file: files_open.enter_context(open(file, "rb", buffering=0)) for file in plan}
        _materialize_outside_layers(model, target_device)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed.weight
        for file, placement in by_layer.pop(None, []):
            copy_tensor_into(handles[file], placement.entry, _destination(model, placement))
        if quantize_head:
            model.lm_head = quantize_linear(model.lm_head, quantization)
        for index, layer in enumerate(model.layers):
            layer.to_empty(device=target_device)
            for file, placement in by_layer.get(index, []):
                copy_tensor_into(handles[file], placement.entry, _destination(model, placement))
            quantize_linears(layer, quantization)
            if quantization != "none":
                release_freed_heap()

    model.requires_grad_(False)
    model.eval()
    model.quantization, model.quantized_head = quantization, quantize_head
    model.set_attention_kernel(*select_attention(target_device, target_dtype, use_flash_attn))
    return model
