"""Reading safetensors files tensor by tensor, straight into preallocated memory.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
range) and the raw little-endian data. Reading with `readinto` rather than memory-mapping keeps the
file's pages out of the process's resident set, so loading never holds the checkpoint twice.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO, Optional

import torch

from engine.errors import CheckpointError

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

# Linux returns at most ~2 GiB per read() call; larger tensors are read in pieces.
_MAX_READ = 1 << 30


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse the header of one safetensors file; raise CheckpointError if it is malformed."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (too short)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > size - 8:
            raise CheckpointError(f"{path} is not a safetensors file (header length {header_len} "
                                  f"exceeds the file size {size})")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path} has an unreadable safetensors header: {err}") from None
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"weight {name} in {path} has unsupported dtype {info.get('dtype')!r}")
        begin, end = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if end - begin != nbytes or data_start + end > size:
            raise CheckpointError(f"weight {name} in {path} has a byte range that does not match "
                                  f"its shape {shape} and dtype {info.get('dtype')} (file truncated?)")
        entries[name] = TensorEntry(name, dtype, shape, data_start + begin, nbytes)
    return entries


def _read_exact(f: BinaryIO, entry: TensorEntry, dest: torch.Tensor) -> None:
    buffer = memoryview(dest.view(-1).view(torch.uint8).numpy())
    f.seek(entry.offset)
    done = 0
    while done < entry.nbytes:
        got = f.readinto(buffer[done:done + _MAX_READ])
        if not got:
            raise CheckpointError(f"unexpected end of file while reading weight {entry.name}")
        done += got


def copy_tensor_into(f: BinaryIO, entry: TensorEntry, dest: torch.Tensor) -> None:
    """Fill `dest` (any device/dtype, same number of elements) with the tensor `entry` of file `f`."""
    if entry.nbytes == 0:
        return
    if dest.device.type == "cpu" and dest.dtype == entry.dtype and dest.is_contiguous():
        _read_exact(f, entry, dest)
        return
    staging = torch.empty(entry.shape, dtype=entry.dtype)
    _read_exact(f, entry, staging)
    dest.copy_(staging.view(dest.shape))


def _rows_entry(entry: TensorEntry, start: int, count: int) -> TensorEntry:
    """The rows [start, start + count) of `entry`: a contiguous byte range of the file."""
    row_bytes = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
    return replace(entry, shape=(count, *entry.shape[1:]), offset=entry.offset + start * row_bytes,
                   nbytes=count * row_bytes)


def copy_slice_into(f: BinaryIO, entry: TensorEntry, dest: torch.Tensor, rows: Optional[tuple[int, int]] = None,
                    columns: Optional[tuple[int, int]] = None) -> None:
    """Fill `dest` with rows [r, r + m) and columns [c, c + n) of the tensor `entry` (None: all),
    reading those bytes only: whole rows are one read, a column range one read per row (a
    tensor-parallel rank's share of a row-parallel weight)."""
    if rows is not None:
        entry = _rows_entry(entry, *rows)
    if columns is None or (columns[0] == 0 and columns[1] == entry.shape[1]):
        copy_tensor_into(f, entry, dest)
        return
    start, count = columns
    item = entry.dtype.itemsize
    row_bytes = entry.shape[1] * item
    staging = torch.empty((entry.shape[0], count), dtype=entry.dtype)
    buffer = memoryview(staging.view(-1).view(torch.uint8).numpy())
    piece = count * item
    for row in range(entry.shape[0]):
        f.seek(entry.offset + row * row_bytes + start * item)
        target, done = buffer[row * piece:(row + 1) * piece], 0
        while done < piece:
            got = f.readinto(target[done:])
            if not got:
                raise CheckpointError(f"unexpected end of file while reading weight {entry.name}")
            done += got
    dest.copy_(staging)
