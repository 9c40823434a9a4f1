"""A reference of DiffusionGemma's official decoding loop (transformers 5.23.0,
`DiffusionGemmaGenerationMixin.generate`) on our model's forwards, written from the fixture README's
sections 5.4-5.5 (tests/fixtures/diffusion_gemma/README.md). Scope: what the golden runs exercise,
no more — one batch decoded to the end, the official single random stream, no streaming, no
per-request state. It is the oracle the golden-run test replays (tests/parity/
test_diffusion_gemma_golden.py) and what the built-in model's held-out accuracy is measured with
before the engine's uniform-noise mode exists (tinymodels/dg_evaluate.py); it is not a serving path.

Per canvas: the encoder pass (the prompt, later the previous committed canvas), an initial canvas of
uniform random ids, then denoising steps cur_step = N..1 at temperature
T = t_min + (t_max - t_min) * cur_step / N (float32): the decoder's logits / T are sampled at every
position, the lowest-entropy positions whose smaller entropies sum to at most `entropy_bound` keep
their sample, the rest are re-randomised; the next step self-conditions on softmax(logits / T). A
row stops when its argmax canvas equals the previous `stability_threshold` ones and its mean entropy
is below `confidence_threshold` (stopped rows are frozen but still run and drawn for); the canvas
ends when every row stopped or after N steps, and its argmax is committed. After the first end id in
a committed canvas every token becomes the pad id; the loop ends when every row holds an end id or
after ceil(max_new_tokens / canvas_length) canvases.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from engine.decoding.draws import Draws
from engine.models.diffusion_gemma import DiffusionGemmaModel


@dataclass(frozen=True)
class OfficialSettings:
    """The fields of a `generation_config.json` the official loop reads."""

    max_new_tokens: int
    max_denoising_steps: int
    entropy_bound: float
    t_min: Optional[float]
    t_max: Optional[float]
    stability_threshold: Optional[int]
    confidence_threshold: Optional[float]
    eos_ids: tuple[int, ...]
    pad_id: Optional[int]

    @classmethod
    def from_generation_config(cls, gen: dict[str, Any]) -> OfficialSettings:
        eos = gen.get("eos_token_id")
        return cls(max_new_tokens=int(gen["max_new_tokens"]), max_denoising_steps=int(gen["max_denoising_steps"]),
                   entropy_bound=float(gen["sampler_config"]["entropy_bound"]), t_min=gen.get("t_min"),
                   t_max=gen.get("t_max"), stability_threshold=gen.get("stability_threshold"),
                   confidence_threshold=gen.get("confidence_threshold"),
                   eos_ids=() if eos is None else (eos,) if isinstance(eos, int) else tuple(eos),
                   pad_id=gen.get("pad_token_id"))

    @property
    def adaptive_stop(self) -> bool:
        return self.stability_threshold is not None and self.confidence_threshold is not None

    def temperature(self, cur_step: int) -> Optional[torch.Tensor]:
        """float32, as the official loop evaluates it (`cur_step` an int32 tensor); None: no temperature."""
        if self.t_min is None or self.t_max is None:
            return None
        return self.t_min + (self.t_max - self.t_min) * (
            torch.tensor(cur_step, dtype=torch.int32) / self.max_denoising_steps)


@dataclass(frozen=True)
class StepReport:
    """One denoising step, for an observer (the golden test checks each against the record)."""

    canvas_index: int
    step: int  # 1-based within the canvas
    temperature: Optional[torch.Tensor]
    canvas_in: torch.Tensor  # [B, CL] the canvas the decoder read
    entropy: torch.Tensor  # [B, CL] float32, of softmax(logits / T)
    accepted: torch.Tensor  # [B, CL] bool
    argmax: torch.Tensor  # [B, CL] the argmax canvas after the step (frozen rows keep theirs)
    finished: torch.Tensor  # [B] bool, sticky: the row met the stop rule in this canvas


@dataclass(frozen=True)
class CanvasReport:
    canvas_index: int
    steps: int
    committed: torch.Tensor  # [B, CL] the argmax canvas
    after_finalize: torch.Tensor  # [B, CL] after end/pad handling


@dataclass(frozen=True)
class Generation:
    tokens: torch.Tensor  # [B, n * CL] the committed canvases after end/pad handling
    passes: torch.Tensor  # [B] steps at whose start the row had neither stopped nor ended
    tokens_per_forward: torch.Tensor  # [B] float32: non-pad generated tokens / passes
    steps_per_canvas: list[int]


def _entropy(scaled: torch.Tensor) -> torch.Tensor:
    return torch.distributions.Categorical(logits=scaled).entropy()


def generate(model: DiffusionGemmaModel, input_ids: torch.Tensor, settings: OfficialSettings, draws: Draws, *,
             attention_mask: Optional[torch.Tensor] = None, first_canvas: Optional[torch.Tensor] = None,
             on_step: Optional[Callable[[StepReport], None]] = None,
             on_canvas: Optional[Callable[[CanvasReport], None]] = None) -> Generation:
    """Decode a batch of prompts (left-padded, `attention_mask` 0 on pads, as the official processor
    batches) to the end. `first_canvas` [B, CL] replaces the first initial canvas (its draw is still
    made, as officially: `decoder_input_ids`)."""
    device = model.device
    batch, canvas_length = input_ids.shape[0], model.canvas_length
    shape = (batch, canvas_length)
    eos = torch.tensor(settings.eos_ids, dtype=torch.long, device=device)
    canvases_max = math.ceil(settings.max_new_tokens / canvas_length)
    cache = model.new_cache(batch, input_ids.shape[1] + canvases_max * canvas_length)
    to_encode, encode_mask = input_ids, attention_mask
    ended = torch.zeros(batch, dtype=torch.bool, device=device)  # the row holds an end id
    passes = torch.zeros(batch, dtype=torch.long, device=device)
    generated, steps_per_canvas = [], []
    for index in range(canvases_max):
        model.encode(to_encode, cache, attention_mask=encode_mask)
        canvas = draws.canvas(shape)
        if index == 0 and first_canvas is not None:
            canvas = first_canvas.to(device)
        argmax, soft = canvas, None
        stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        history = torch.full((max(settings.stability_threshold or 0, 0), *shape), -1, dtype=torch.long, device=device)
        steps = 0
        for cur_step in range(settings.max_denoising_steps, 0, -1):
            steps += 1
            passes += ~(stopped | ended)
            temperature = settings.temperature(cur_step)
            logits = model.decode(canvas, cache, self_conditioning=soft)
            scaled = logits if temperature is None else logits / temperature.to(device)
            sampled = draws.samples(scaled.softmax(dim=-1))
            entropy = _entropy(scaled)
            ascending, order = entropy.sort(dim=-1)
            accepted = torch.zeros(shape, dtype=torch.bool, device=device).scatter(
                -1, order, ascending.cumsum(-1) - ascending <= settings.entropy_bound)
            new_canvas = torch.where(accepted, sampled, draws.renoise(shape))
            new_argmax, new_soft = scaled.argmax(-1), model.soft_embeddings(scaled)
            if settings.adaptive_stop:  # stopped rows keep their canvas, argmax and self-conditioning input
                new_argmax = torch.where(stopped[:, None], argmax, new_argmax)
                new_canvas = torch.where(stopped[:, None], canvas, new_canvas)
                if soft is not None:
                    new_soft = torch.where(stopped[:, None, None], soft, new_soft)
                stable = (history == new_argmax).all(-1).all(0)
                history = torch.cat((history[1:], new_argmax[None]))[:len(history)]
                assert settings.confidence_threshold is not None
                stopped = stopped | (stable & (entropy.mean(-1) < settings.confidence_threshold))
            if on_step is not None:
                on_step(StepReport(index, steps, temperature, canvas, entropy, accepted, new_argmax, stopped))
            canvas, argmax, soft = new_canvas, new_argmax, new_soft
            if stopped.all():
                break
        committed = argmax.clone()
        if len(eos) and settings.pad_id is not None:
            is_eos = torch.isin(committed, eos)
            committed[ended] = settings.pad_id
            seen = is_eos.cumsum(-1)
            committed[(seen > 0) & ~((seen == 1) & is_eos)] = settings.pad_id  # every token after the first end id
            ended = ended | is_eos.any(-1)
        if on_canvas is not None:
            on_canvas(CanvasReport(index, steps, argmax, committed))
        generated.append(committed)
        steps_per_canvas.append(steps)
        if ended.all():
            break
        to_encode, encode_mask = committed, None
    tokens = torch.cat(generated, dim=1)
    valid = (tokens != settings.pad_id).sum(-1) if settings.pad_id is not None else torch.full(
        (batch,), tokens.shape[1], device=device)
    return Generation(tokens, passes, (valid / passes).float(), steps_per_canvas)
