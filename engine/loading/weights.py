"""`load_model`: a checkpoint directory in, a ready model on the requested device out.

The model is built on the meta device (no memory), given uninitialised storage on the target
device in the target dtype, and then filled tensor by tensor from the safetensors files, one
decoder layer at a time (quantized, when asked, before the next is allocated). Every name
and shape is checked against the weight table from the file headers before any data is read, so a
bad checkpoint fails in milliseconds and names the offending tensor.

On a tensor-parallel rank (`tp`) the model is that rank's share, and each tensor is read as the
slices the rank holds (`engine.models.parallel.sharding.source_slices`): no rank reads another's experts
or holds a whole sharded tensor.
"""

from __future__ import annotations

import ctypes
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Optional, Union

import torch

from engine.devices import resolve
from engine.errors import CheckpointError, DeviceError
from engine.loading.checkpoint import CheckpointFiles
from engine.loading.safetensors_stream import TensorEntry, copy_slice_into, read_header
from engine.models.attention import select_attention
from engine.models.parallel.group import SINGLE, TensorParallel
from engine.models.parallel.sharding import SliceRead, check_divisible, source_slices
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
    read: SliceRead  # which part of the tensor, into which rows of the parameter


def _destination(model: DiffusionTransformer, placement: _Placement) -> torch.Tensor:
    data = model.get_parameter(placement.param).data
    if placement.read.dest_rows is None:
        return data
    start, size = placement.read.dest_rows
    return data[start:start + size]


def plan_weights(model: DiffusionTransformer, files: list[Path]) -> dict[Path, list[_Placement]]:
    """Match every tensor in the files to a parameter (this rank's slices of it on a tensor-parallel
    rank), checking names and shapes; read no data."""
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
            module = model.get_submodule(param.rsplit(".", 1)[0])
            want, reads = source_slices(module, tuple(model.get_parameter(param).shape), shard,
                                        model.config.vocab_size, model.tp)
            if entry.shape != want:
                raise CheckpointError(f"weight {name} has shape {list(entry.shape)} but the config "
                                      f"implies {list(want)} (in {path.name})")
            plan[path].extend(_Placement(entry, param, read) for read in reads)
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


def _materialize_outside_layers(model: DiffusionTransformer, device: torch.device) -> None:
    """Allocate every module but the decoder layers on `device`, the vocabulary shard's padding rows
    zero (a tensor-parallel rank's; never read, but never garbage). A function of its own so that no
    loop variable outlives it: one left holding the float output head would keep it resident
    after `quantize_head` replaced it, for the whole load."""
    for name, child in model.named_children():
        if name != "layers":
            child.to_empty(device=device)
    for table in (model.embed, model.lm_head):
        table.weight.data[model.vocab_rows:].zero_()


def _copy(f: BinaryIO, placement: _Placement, model: DiffusionTransformer) -> None:
    read = placement.read
    copy_slice_into(f, placement.entry, _destination(model, placement), read.rows, read.columns)


def load_model(path: Union[str, Path], device: Union[str, torch.device] = "cpu",
               dtype: Union[str, torch.dtype] = torch.float32, *,
               use_flash_attn: Optional[bool] = None, quantization: str = "none",
               quantize_head: bool = False, tp: TensorParallel = SINGLE) -> DiffusionTransformer:
    """Load a checkpoint of any supported family (local directory, safetensors) for inference.

    The returned module maps `(input_ids, attention_mask=None, position_ids=None)` to raw logits
    [B, L, vocab]; `.config`, `.special` (token ids), `.hf_config` and `.logits_shifted` describe it.
    With `quantization` (engine.quantization), each decoder layer's linear layers are quantized as
    soon as that layer's weights are read, so peak memory is the quantized model plus one float layer.
    With `tp`, the model is that rank's share (its forward needs the group: `engine.executor`).
    """
    checkpoint = CheckpointFiles.open(path)
    cls = model_class_for(checkpoint.config)
    config = cls.parse_config(checkpoint.config)
    check_divisible(config, tp.size)
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
        model = cls(config, special, checkpoint.config, tp)
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
            _copy(handles[file], placement, model)
        if quantize_head:
            model.lm_head = quantize_linear(model.lm_head, quantization)
        for index, layer in enumerate(model.layers):
            layer.to_empty(device=target_device)
            for file, placement in by_layer.get(index, []):
                _copy(handles[file], placement, model)
            quantize_linears(layer, quantization)
            if quantization != "none":
                release_freed_heap()

    model.requires_grad_(False)
    model.eval()
    model.quantization, model.quantized_head = quantization, quantize_head
    # the checkpoint's decoding defaults (a uniform-noise model's knobs: engine/uniform_mode.py)
    model.generation_config = dict(checkpoint.generation_config or {})
    model.set_attention_kernel(*select_attention(target_device, target_dtype, use_flash_attn))
    return model
