"""The model runner: runs each row's planned forward (its `RowPlan`, made by the decoding mode when
the batch was built) through the mode's one table of forwards, and gives the step the logits at
every row's block.

Rows with the same plan group share a forward; a step whose rows need several forwards builds each
group's rows, runs the forwards back to back and puts the logits back in row order with one
concatenation and an inverse permutation. The forwards (static buffers, CUDA graphs, compiled shapes:
`engine.static_forward`) are the modes'; the decisions (`engine.decide`) and the bookkeeping
(`engine.advance`) never see a store.
"""

from __future__ import annotations

import torch

from engine.batch import Batch, ForwardOutput
from engine.block_mode import BlockDiffusion
from engine.host_copy import to_device
from engine.masked_mode import MaskedDiffusion
from engine.mode import DecodingMode
from engine.slots import Slots
from engine.uniform_mode import UniformDiffusion

# The decoding modes, by the family table's `Family.mode` (engine/models/registry.py).
MODES: dict[str, type[DecodingMode]] = {mode.name: mode for mode in (MaskedDiffusion, BlockDiffusion, UniformDiffusion)}


class ModelRunner:
    def __init__(self, mode: DecodingMode, slots: Slots) -> None:
        self.slots = slots
        self.model = mode.model
        self.forwards = mode.forwards  # plan kind -> forward: the one table the runner dispatches through
        self.device = slots.device

    @torch.inference_mode()
    def run(self, batch: Batch) -> ForwardOutput:
        width = batch.width
        p = self.slots.positions[:width]
        positions = batch.block_start[:, None] + p
        in_block = p[None, :] < batch.block_length[:, None]
        block_tokens = self.slots.canvas[batch.slots[:, None], positions]
        groups: dict[tuple, list[int]] = {}
        for b, plan in enumerate(batch.plans):
            groups.setdefault(plan.group, []).append(b)
        # a tensor-parallel rank keeps its vocabulary shard's logits: the decide step reduces them
        with self.model.local_logits() as vocab:
            if len(groups) == 1:
                logits = self.forwards[batch.plans[0].kind](batch, width)
            else:  # one forward per group, the logits put back in row order
                parts = [self.forwards[batch.plans[index[0]].kind](batch.rows(index), width)
                         for index in groups.values()]
                order = [b for index in groups.values() for b in index]
                inverse = to_device(torch.tensor(sorted(range(len(order)), key=order.__getitem__)), self.device)
                logits = torch.cat(parts).index_select(0, inverse)
        return ForwardOutput(logits.float(), block_tokens, in_block, positions, vocab)
