"""The slots of a uniform-noise model (DiffusionGemma): the shared slot tables (`engine.slots`: the
canvas of committed tokens, the knob tables) with a `Gemma4Cache` as the KV store, and each row's
canvas state between steps:

- `noisy` [slots, CL]: the canvas the decoder reads next (uniform random ids at a canvas's start);
- `argmax` [slots, CL]: the previous step's argmax canvas, and `stable` [slots] the consecutive
  steps it has not changed (the stop rule's stability count);
- `soft` [slots, CL, hidden]: the self-conditioning input of the next step (the soft embeddings of
  the previous step's tempered logits; unused at a canvas's first step);
- `settled` [slots, CL], `accepted` [slots] and the shared `low_yield` [slots]: dg-converge's
  per-position settling counts, the previous step's accepted count and Box 7's counter;
- `draws[slot]`: the request's random stream (`engine.decoding.draws`), made at admission from its
  seed (`make_draws`: a test may replay recorded draws instead).
The slot's canvas holds the prompt and the committed canvases; the canvas being denoised reads
`blank` there until it is committed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from engine.decoding.draws import Draws, GeneratorDraws, request_generator
from engine.models.gemma4_cache import Gemma4Cache
from engine.request import Request
from engine.slots import Slots


class UniformSlots(Slots):
    def __init__(self, model: Any, max_batch: int) -> None:
        super().__init__(model, max_batch)
        self.vocab_size = model.config.vocab_size
        length = model.canvas_length
        device = self.device
        self.noisy = torch.zeros(max_batch, length, dtype=torch.long, device=device)
        self.argmax = torch.zeros(max_batch, length, dtype=torch.long, device=device)
        self.stable = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.soft = torch.zeros(max_batch, length, model.config.hidden_size, dtype=model.dtype, device=device)
        self.settled = torch.zeros(max_batch, length, dtype=torch.long, device=device)
        self.accepted = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.draws: list[Optional[Draws]] = [None] * max_batch
        self.make_draws: Callable[[Request], Draws] = self._generator_draws

    def _new_store(self, model: Any, max_batch: int) -> Gemma4Cache:  # type: ignore[override]
        return model.new_cache(max_batch, 2)

    def _admit_store(self, request: Request) -> None:
        self.store.reset(request.slot)

    def _grow_store(self, width: int) -> None:
        self.store.reserve(width)

    def _generator_draws(self, request: Request) -> Draws:
        if request.generator is None:
            request.generator = request_generator(request.params.seed, self.device)
        return GeneratorDraws(request.generator, self.vocab_size)

    def move(self, src: int, dst: int) -> None:
        """Slot `dst` takes slot `src`'s request, its canvas state and random stream too."""
        super().move(src, dst)
        for state in (self.noisy, self.argmax, self.stable, self.soft, self.settled, self.accepted):
            state[dst] = state[src]
        self.draws[dst], self.draws[src] = self.draws[src], None

    def admit(self, request: Request, running: Sequence[Request], blank: int) -> None:
        super().admit(request, running, blank)
        steps = request.params.max_denoising_steps
        assert steps is not None, "a uniform-noise request's knobs are resolved at add_request"
        request.steps_per_block = steps  # the step cap of a canvas
        request.stats.fixed_step_budget = request.num_blocks * steps
        self.draws[request.slot] = self.make_draws(request)
