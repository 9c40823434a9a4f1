"""The roofline floor of one decoding step (bench/gpu_step.py): what a step must read and compute,
and the device's measured copy bandwidth and matmul rate. See docs/performance.md."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from engine.models.transformer import DiffusionTransformer
from engine.quantization import quantized_model_bytes

FULL, CACHED = "full", "cached"


@dataclass(frozen=True)
class ModelDims:
    """What the floor needs to know about a model."""

    body_params: int  # every parameter but the embedding table and the head
    head_params: int
    hidden_size: int
    q_size: int  # heads x head_dim: the width of attention's two matmuls
    kv_size: int  # kv_heads x head_dim
    num_layers: int
    shift: int  # 1 when output i-1 predicts token i (Dream): one extra position is fed
    elem_bytes: int
    layer_params: int  # one decoder layer's
    kv_proj_params: int  # one layer's key and value projections (weights and biases)
    body_bytes: Optional[int] = None  # with quantized layers, the body's bytes (None: body_params x elem_bytes)

    @property
    def wanted_only_params(self) -> int:
        """What runs at the logit positions alone: the last layer but its key and value projections
        (every fed position still writes its keys and values), and the final norm."""
        return self.layer_params - self.kv_proj_params + self.hidden_size

    @classmethod
    def of(cls, model: DiffusionTransformer, quantization: str = "none") -> ModelDims:
        """`model` in float; `quantization`: the mode its layers' linears will be quantized to."""
        config = model.config
        params = dict(model.named_parameters())  # tied weights appear once, under embed
        body = sum(p.numel() for name, p in params.items() if not name.startswith(("embed.", "lm_head.")))
        layer = sum(p.numel() for p in model.layers[-1].parameters())
        kv_bias = 2 * config.kv_size if config.qkv_bias else 0
        body_bytes = None
        if quantization != "none":
            outside = sum(p.numel() for name, p in params.items() if name.startswith(("embed.", "lm_head.")))
            body_bytes = (quantized_model_bytes(model, quantization, model.dtype, device_type=model.device.type)
                          - outside * model.dtype.itemsize)
        return cls(body_params=body, head_params=model.lm_head.weight.numel(), hidden_size=config.hidden_size,
                   q_size=config.q_size, kv_size=config.kv_size, num_layers=config.num_layers,
                   shift=1 if model.logits_shifted else 0, elem_bytes=model.dtype.itemsize, layer_params=layer,
                   kv_proj_params=2 * config.hidden_size * config.kv_size + kv_bias, body_bytes=body_bytes)


@dataclass(frozen=True)
class StepShape:
    batch: int
    fed: int  # tokens fed per row
    keys: int  # keys each query attends over
    logits: int  # positions per row whose logits are computed
    kv_read: int  # cache columns per row the step's attention reads (0: no cache)

    @property
    def fed_tokens(self) -> int:
        return self.batch * self.fed


def step_shape(dims: ModelDims, batch: int, cache: str, kind: str, prompt_len: int, gen_len: int,
               block: int, block_start: int) -> StepShape:
    """The work of one step of every row at the block starting at `block_start` (canvas index).

    Keys are the canvas length: the floor counts the work the step needs, not the padding or scratch
    columns an implementation may add."""
    length = prompt_len + gen_len
    cache_cols = 0 if cache == "none" else length
    if kind == FULL:
        fed = length
    elif cache == "dual":
        fed = block + dims.shift
    elif cache == "prefix":
        fed = length - block_start + dims.shift
    else:
        raise ValueError(f"cache {cache!r} has no {kind!r} step")
    return StepShape(batch=batch, fed=fed, keys=length, logits=block, kv_read=cache_cols)


def step_flops(dims: ModelDims, shape: StepShape) -> int:
    """2 x params x tokens, 4 x Q x K x q_size per layer for attention's two matmuls (the embedding is
    a lookup). Every fed token goes through every layer but the last, where only its keys and values
    are needed unless its logits are wanted: the last layer's queries, attention, MLP, the final norm
    and the head run at the logit positions alone (what the engine computes)."""
    b = shape.batch
    every_fed = dims.body_params - dims.wanted_only_params
    dense = 2 * b * (every_fed * shape.fed + (dims.wanted_only_params + dims.head_params) * shape.logits)
    attention = 4 * b * shape.keys * dims.q_size * ((dims.num_layers - 1) * shape.fed + shape.logits)
    return dense + attention


def step_bytes(dims: ModelDims, shape: StepShape) -> int:
    """Bytes read at least once: body (quantized, where it is) and head weights, the embedding rows looked up, and the
    keys and values of every cache column read (all layers)."""
    body = dims.body_params * dims.elem_bytes if dims.body_bytes is None else dims.body_bytes
    weights = body + (dims.head_params + shape.fed_tokens * dims.hidden_size) * dims.elem_bytes
    kv = 2 * shape.batch * shape.kv_read * dims.kv_size * dims.num_layers * dims.elem_bytes
    return weights + kv


@dataclass(frozen=True)
class DeviceRates:
    copy_bytes_per_s: float  # read + write
    matmul_flops_per_s: float


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` runs: a floor must use the best rate the device showed, or a
    moment of contention would put the floor above what the step itself achieves."""
    fn()  # warm-up: allocation, kernel selection
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _copy_rate(device: torch.device, dtype: torch.dtype, mib: int, repeats: int) -> float:
    src = torch.ones(mib * 2**20 // dtype.itemsize, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() * src.element_size() / seconds  # every byte is read once and written once


def _matmul_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _best_time(lambda: a @ b, device, repeats)


def measure_rates(device: torch.device, dtype: torch.dtype, copy_mib: int, matmul_n: int,
                  repeats: int = 10) -> DeviceRates:
    """The device's achievable rates, measured rather than taken from a datasheet so that the floor
    is one this device (clocks, power limit, MIG slice) can actually reach."""
    return DeviceRates(copy_bytes_per_s=_copy_rate(device, dtype, copy_mib, repeats),
                       matmul_flops_per_s=_matmul_rate(device, dtype, matmul_n, repeats))
