"""Resolving and checking the device and dtype a model is loaded onto."""

from __future__ import annotations

from typing import Union

import torch
import torch.nn.functional as F

from engine.dtype_names import DTYPE_ALIASES
from engine.errors import DeviceError

DTYPE_NAMES: dict[str, torch.dtype] = {alias: getattr(torch, name) for alias, name in DTYPE_ALIASES.items()}
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype.lower() not in DTYPE_NAMES:
            raise DeviceError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")
        return DTYPE_NAMES[dtype.lower()]
    if dtype not in SUPPORTED_DTYPES:
        raise DeviceError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
    return dtype


def resolve_device(device: Union[str, torch.device]) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise DeviceError(f"invalid device {device!r}: {err}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise DeviceError(f"device type {dev.type!r} is not supported; use cpu or cuda")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {device!r} was requested but no CUDA GPU is available on this machine")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise DeviceError(f"device {device!r} does not exist: this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def check_device_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """Raise DeviceError if the device cannot run the model's kernels in this dtype."""
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise DeviceError(f"{torch.cuda.get_device_name(device)} does not support bfloat16; "
                          "use --dtype float16 or float32")
    try:  # the kernels a forward pass needs, at the smallest size
        x = torch.ones(1, 1, 2, 2, dtype=dtype, device=device)
        F.scaled_dot_product_attention(x, x, x) @ x
        F.silu(x).float().rsqrt()
    except RuntimeError as err:
        raise DeviceError(f"device {device} cannot compute in {dtype}: {err}") from None


def resolve(device: Union[str, torch.device], dtype: Union[str, torch.dtype]) -> tuple[torch.device, torch.dtype]:
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    check_device_dtype(dev, dt)
    return dev, dt
