"""The slots of a uniform-noise model (DiffusionGemma): the shared slot tables (`engine.slots`: the
canvas of committed tokens, the knob tables, the row state the mode declares: its canvas state,
`UniformDiffusion.row_state`) with a `Gemma4Cache` as the KV store, and each row's random stream:
`draws[slot]` (`engine.decoding.draws`), made at admission from its seed (`make_draws`: a test may
replay recorded draws instead).
The slot's canvas holds the prompt and the committed canvases; the canvas being denoised reads
`blank` there until it is committed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Optional

from engine.decoding.draws import Draws, GeneratorDraws, request_generator
from engine.decoding.row_state import RowState
from engine.models.protocol import DiffusionModel
from engine.request import Request
from engine.slots import Slots


class UniformSlots(Slots):
    def __init__(self, model: DiffusionModel, max_batch: int, row_state: Mapping[str, RowState]) -> None:
        super().__init__(model, max_batch, row_state)
        self.vocab_size = model.config.vocab_size
        self.draws: list[Optional[Draws]] = [None] * max_batch
        self.make_draws: Callable[[Request], Draws] = self._generator_draws

    def _generator_draws(self, request: Request) -> Draws:
        # a sampling row's own generator where it has one (temperature > 0), else one from its seed
        generator = request.generator or request_generator(request.params.seed, self.device)
        return GeneratorDraws(generator, self.vocab_size)

    def move(self, src: int, dst: int) -> None:
        """Slot `dst` takes slot `src`'s request, its random stream too."""
        super().move(src, dst)
        self.draws[dst], self.draws[src] = self.draws[src], None

    def admit(self, request: Request, running: Sequence[Request], blank: int) -> None:
        super().admit(request, running, blank)
        self.draws[request.slot] = self.make_draws(request)
