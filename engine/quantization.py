"""Weight-only quantization of the decoder layers' linear layers, chosen once at start-up.

| mode | library | storage | devices |
|---|---|---|---|
| int8 | torchao `Int8WeightOnlyConfig` | int8, one float32 scale per output row | CPU, CUDA |
| int4 | bitsandbytes `Linear4bit`, NF4 | two weights a byte, one scale per 64 weights | CPU, CUDA |
| fp8  | torchao `Float8WeightOnlyConfig` | float8 e4m3, one scale per output row | CUDA, compute capability >= 8.9 |

torchao's own packed 4-bit layout needs a CUDA-only kernel package and its CPU int4 stores a byte a
weight, so int4 is bitsandbytes' on every device. Activations stay in the model dtype: each layer
dequantizes (or multiplies in its library's mixed kernel) and accumulates in that dtype.

LLaDA2's routed experts are quantized too, each expert as its own linear pair
(`GroupedExperts.quantize`: neither library's weight can be viewed as stacked [experts, rows,
columns]); its router stays in the model dtype (it scores in float32, as the official gate does).
Embeddings, norms and the output head stay in the model dtype unless `quantize_head` asks for the
head too: the head's logits are the confidences that CAI's thresholds compare, so an error there
moves decisions, not only values (docs/operations.md). The loader quantizes one decoder layer at a
time as its weights arrive (`engine.loading.weights`), so at most one layer is ever held in float.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.config import QUANTIZATION_MODES
from engine.errors import DeviceError

_LIBRARY = {"int8": "torchao", "int4": "bitsandbytes", "fp8": "torchao"}
_INSTALL_HINT = "pip install 'cai-dllm[quant]'"
# bitsandbytes quantizes the flattened weight in blocks of this many values, each with its own scale
NF4_BLOCK = 64
NF4_SCALE_BLOCK = 256  # the block scales are themselves quantized to 8 bits in blocks of this many
NF4_VALUES_PER_CALL = 1 << 23  # weights quantized per bitsandbytes call (bounds its temporaries)
_FP8_MIN_CAPABILITY = (8, 9)  # the e4m3 matmul kernels torchao calls (Ada, Hopper and later)


def check_mode(mode: str) -> None:
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}; got {mode!r}")


def _quiet_library_logs() -> None:
    """Warnings the libraries log on a CPU-only machine about optional kernels that are absent by
    design: torchao's CUDA extensions, bitsandbytes' CPU kernel fetched from a model hub at run time
    (never here: nothing is downloaded at run time), torch's deprecation note for torchao's enums."""
    for name in ("torchao", "bitsandbytes.backends.cpu.ops", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _torchao_linear(config_name: str) -> Callable[[nn.Linear], nn.Module]:
    _quiet_library_logs()
    from torchao import quantization

    config = getattr(quantization, config_name)()

    def convert(linear: nn.Linear) -> nn.Module:
        quantization.quantize_(linear, config)  # replaces the weight with torchao's tensor subclass
        return linear
    return convert


def _nf4_state(weight: torch.Tensor, rows_per_call: int) -> tuple[torch.Tensor, Any]:
    """bitsandbytes' NF4 of `weight` (packed data, QuantState), computed `rows_per_call` rows at a
    time: its CPU kernel holds ~17 bytes of float temporaries per weight, 1.7 GB for one fused MLP
    projection of LLaDA-8B. Blocks never straddle rows (in_features is a multiple of the block), so
    the pieces' data and block scales are the one-call result; the scales are then compressed as
    `quantize_4bit(compress_statistics=True)` does (offset by their mean, 8-bit blocks of 256)."""
    from bitsandbytes.functional import QuantState, quantize_4bit, quantize_blockwise

    packed, absmax, code = [], [], None
    for start in range(0, weight.shape[0], rows_per_call):
        piece, state = quantize_4bit(weight[start:start + rows_per_call], blocksize=NF4_BLOCK,
                                     compress_statistics=False, quant_type="nf4")
        packed.append(piece)
        absmax.append(state.absmax)
        code = state.code
    scales = torch.cat(absmax)
    offset = scales.mean()
    compressed, state2 = quantize_blockwise(scales - offset, blocksize=NF4_SCALE_BLOCK)
    return torch.cat(packed), QuantState(absmax=compressed, shape=weight.shape, dtype=weight.dtype,
                                         blocksize=NF4_BLOCK, code=code, quant_type="nf4", offset=offset,
                                         state2=state2)


def nf4_fits(in_features: int) -> bool:
    """Whether NF4 blocks tile each weight row: bitsandbytes' packed CPU kernel (taken in eval mode on
    CPUs with AVX512-BF16) refuses rows that a block straddles, so such a layer (only in models too
    small to matter: real checkpoints' widths are multiples of 64) stays in the model dtype."""
    return in_features % NF4_BLOCK == 0


def _bnb_nf4_linear(linear: nn.Linear) -> nn.Module:
    _quiet_library_logs()
    import bitsandbytes as bnb

    if not nf4_fits(linear.in_features):
        return linear
    weight = linear.weight.data
    quantized = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  compute_dtype=weight.dtype, quant_type="nf4", device="meta")
    rows = max(1, NF4_VALUES_PER_CALL // linear.in_features)
    data, state = _nf4_state(weight, rows)
    quantized.weight = bnb.nn.Params4bit(data, requires_grad=False, quant_state=state, blocksize=NF4_BLOCK,
                                         compress_statistics=True, quant_type="nf4", bnb_quantized=True)
    if linear.bias is not None:
        quantized.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    if nf4_repacked_on(weight.device.type):
        # bitsandbytes repacks an NF4 weight for its CPU kernel at the layer's first eval-mode forward:
        # done here, the repack's temporaries are freed while loading, where the loader hands the heap
        # back, instead of staying resident after the first request
        with torch.no_grad():
            quantized.eval().forward(torch.zeros(1, linear.in_features, dtype=weight.dtype))
    return quantized


def _converter(mode: str) -> Callable[[nn.Linear], nn.Module]:
    if mode == "int8":
        return _torchao_linear("Int8WeightOnlyConfig")
    if mode == "fp8":
        return _torchao_linear("Float8WeightOnlyConfig")
    return _bnb_nf4_linear


def _is_float_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module.weight) in (torch.Tensor, nn.Parameter) \
        and module.weight.dtype.is_floating_point


def quantize_linear(linear: nn.Linear, mode: str) -> nn.Module:
    """`linear` in `mode`: the same module with a quantized weight (torchao) or a bitsandbytes module
    in its place. Callers use the result's `forward`, which both libraries implement."""
    return linear if mode == "none" else _converter(mode)(linear)


def quantize_linears(module: nn.Module, mode: str) -> None:
    """Quantize every float `nn.Linear` below `module`, in place; a module that says
    `quantizes_itself` (LLaDA2's stacked routed experts) through its own `quantize(convert)`."""
    if mode == "none":
        return
    convert = _converter(mode)
    for parent in _linear_parents(module):
        for name, child in list(parent.named_children()):
            if _is_float_linear(child):
                setattr(parent, name, convert(child))
    for stacked in _self_quantizing(module):
        stacked.quantize(convert)


def _linear_parents(module: nn.Module) -> list[nn.Module]:
    """`module` and its descendants, less any subtree whose root `quantizes_itself`."""
    if getattr(module, "quantizes_itself", False):
        return []
    return [module] + [m for child in module.children() for m in _linear_parents(child)]


def _self_quantizing(module: nn.Module) -> list[Any]:
    return [m for m in module.modules() if getattr(m, "quantizes_itself", False)]


def check_quantization(mode: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raise DeviceError, naming the mode and the device, when `mode` cannot run there: its library
    is missing, the device has no kernel for it, or a small quantized layer fails to run."""
    check_mode(mode)
    if mode == "none":
        return
    library = _LIBRARY[mode]
    if importlib.util.find_spec(library) is None:
        raise DeviceError(f"--quantization {mode} needs the {library} package, which is not installed "
                          f"({_INSTALL_HINT})")
    if mode == "fp8":
        if device.type != "cuda":
            raise DeviceError(f"--quantization fp8 is not supported on device {device}: it needs a CUDA GPU "
                              f"of compute capability {_FP8_MIN_CAPABILITY[0]}.{_FP8_MIN_CAPABILITY[1]} or "
                              "later (on CPU use int8, the same bytes)")
        capability = torch.cuda.get_device_capability(device)
        if capability < _FP8_MIN_CAPABILITY:
            raise DeviceError(f"--quantization fp8 is not supported on device {device} "
                              f"({torch.cuda.get_device_name(device)}, compute capability "
                              f"{capability[0]}.{capability[1]}); use int8")
    try:  # the kernels a quantized forward needs, at a small size
        probe = nn.Sequential(nn.Linear(2 * NF4_BLOCK, NF4_BLOCK, bias=False)).to(device=device, dtype=dtype)
        quantize_linears(probe, mode)
        probe[0].forward(torch.ones(1, 2 * NF4_BLOCK, device=device, dtype=dtype))
    except (RuntimeError, NotImplementedError, ImportError, AttributeError, TypeError) as err:
        raise DeviceError(f"--quantization {mode} ({library}) cannot run on device {device} in {dtype}: "
                          f"{type(err).__name__}: {err}") from None


@functools.cache
def nf4_repacked_on(device_type: str) -> bool:
    """Whether bitsandbytes runs NF4 on this device through its packed CPU kernel (CPUs with
    AVX512-BF16), which keeps one bfloat16 scale a block instead of the compressed 8-bit ones."""
    if device_type != "cpu" or importlib.util.find_spec("bitsandbytes") is None:
        return False
    _quiet_library_logs()
    from bitsandbytes.functional import has_avx512bf16

    return bool(has_avx512bf16())


def linear_weight_bytes(out_features: int, in_features: int, mode: str, dtype: torch.dtype,
                        device_type: str = "cuda") -> int:
    """The bytes one linear layer's weight takes in `mode` on `device_type` (scales included; a
    bias is extra)."""
    numel = out_features * in_features
    if mode == "none" or (mode == "int4" and not nf4_fits(in_features)):
        return numel * dtype.itemsize
    if mode in ("int8", "fp8"):
        return numel + out_features * (4 + (1 if mode == "int8" else 0))  # float32 scale (+ int8 zero point)
    # NF4: half a byte a weight; bitsandbytes stores each block's scale as one byte plus a float32
    # for every 256 of them (compress_statistics), or as one bfloat16 after its CPU repack
    blocks = -(-numel // NF4_BLOCK)
    if nf4_repacked_on(device_type):
        return numel // 2 + 2 * blocks
    return numel // 2 + blocks + 4 * -(-blocks // NF4_SCALE_BLOCK)


def quantized_model_bytes(model: nn.Module, mode: str, dtype: torch.dtype, quantize_head: bool = False,
                          device_type: str = "cuda") -> int:
    """Bytes of every parameter of `model` (which may live on the meta device; a tensor-parallel
    rank's share) once loaded in `mode` on `device_type`: the decoder layers' linear weights
    quantized (routed experts one linear pair each), the rest in `dtype`."""
    layers = model.layers
    head = getattr(model, "lm_head", None)
    quantized: dict[int, int] = {}  # parameter id -> its bytes once quantized
    if mode != "none":
        for parent in _linear_parents(layers):
            for m in parent.children():
                if isinstance(m, nn.Linear):
                    quantized[id(m.weight)] = linear_weight_bytes(m.out_features, m.in_features, mode, dtype,
                                                                  device_type)
        for stacked in _self_quantizing(layers):
            for linear, (out_features, in_features) in zip((stacked.gate_up_proj, stacked.down_proj),
                                                           stacked.expert_shapes(), strict=True):
                quantized[id(linear.weight)] = stacked.local * linear_weight_bytes(out_features, in_features, mode,
                                                                                   dtype, device_type)
        if quantize_head and head is not None:
            quantized[id(head.weight)] = linear_weight_bytes(head.out_features, head.in_features, mode, dtype,
                                                             device_type)
    return sum(quantized.get(id(p), p.numel() * dtype.itemsize)
               for p in {id(p): p for p in model.parameters()}.values())
