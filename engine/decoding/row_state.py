"""Row state: what a policy (or a decoding mode) keeps for each row from one step to the next, in
the slots (`engine.slots`), declared by name so that the slots allocate, reset, move, gather and
write it back without knowing whose it is. A policy declares its own in its registry entry
(`Policy.state`); its decide function reads `inputs.state[name]` and returns `state={name: ...}`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Union

import torch

BLOCK_WIDE = "block"  # a dimension as wide as the widest block of the running rows (it grows with them)


@dataclass(frozen=True)
class RowState:
    """One piece of row state: its shape after the slot dimension (ints; `BLOCK_WIDE` may be the first),
    its dtype.
    Zero at admission; `read`: gathered at the step's rows for the decide step (False: only the
    mode's forward reads it)."""

    shape: tuple[Union[int, str], ...] = ()
    dtype: torch.dtype = torch.long
    read: bool = True

    @property
    def block_wide(self) -> bool:
        return self.shape[:1] == (BLOCK_WIDE,)


def merged(declarations: Iterable[Mapping[str, RowState]]) -> dict[str, RowState]:
    """The union of several declarations; a name declared twice must mean the same state."""
    out: dict[str, RowState] = {}
    for declared in declarations:
        for name, state in declared.items():
            assert out.setdefault(name, state) == state, f"row state {name!r} declared twice, differently"
    return out
