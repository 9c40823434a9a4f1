"""A uniform-noise request's random draws (DiffusionGemma), from its own generator.

The official loop (transformers 5.23.0) makes three kinds of draw from torch's one global generator:
per canvas the initial canvas (`torch.randint(0, V)`), per step a sample of every position
(`torch.multinomial` over softmax(logits / T)) and the renoise tokens (`torch.randint(0, V)`), for
the whole batch at once, so that a row's tokens depend on its batch-mates. Here each request draws
the same calls, in the same order, for its own row from its own generator (seeded by its `seed`):
a request's tokens do not depend on what else is batched, and a batch of one draws exactly what
the official loop draws after `torch.manual_seed(seed)` (on the same device).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Draws(Protocol):
    """One request's draws, in the official call order; shapes are the row's [1, CL]."""

    def canvas(self, shape: tuple[int, int]) -> torch.Tensor: ...

    def samples(self, probabilities: torch.Tensor) -> torch.Tensor: ...

    def renoise(self, shape: tuple[int, int]) -> torch.Tensor: ...


class GeneratorDraws:
    """`torch.randint` and `torch.multinomial` from one request's generator."""

    def __init__(self, generator: torch.Generator, vocab_size: int) -> None:
        self.generator = generator
        self.vocab_size = vocab_size

    def canvas(self, shape: tuple[int, int]) -> torch.Tensor:
        return torch.randint(0, self.vocab_size, shape, generator=self.generator, device=self.generator.device)

    def samples(self, probabilities: torch.Tensor) -> torch.Tensor:
        """probabilities [1, CL, V] -> [1, CL] (one multinomial over the flattened positions, as officially)."""
        flat = probabilities.reshape(-1, probabilities.shape[-1])
        return torch.multinomial(flat, 1, generator=self.generator).view(probabilities.shape[:-1])

    renoise = canvas


def request_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator seeded from the request's seed, else from the system's entropy."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
