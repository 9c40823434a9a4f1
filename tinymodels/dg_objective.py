"""The uniform-noise block-diffusion objective for the built-in DiffusionGemma-format model.

What we follow, from the official SFT recipe (google-deepmind/gemma `gemma/diffusion/
hackable_diffusion_adapter`: `hd/sft_model.py`, `data/data.py`, `configs/sft_sudoku.py`; NVIDIA NeMo
AutoModel's DiffusionGemma recipe says the same):
- a row is [prompt | response | end token | end fill to the end of its canvas]: the response is cut
  into canvases of `canvas_length` tokens and the last one is filled with end tokens;
- the clean row goes through the causal encoder once (one causal pass over the whole row writes the
  keys and values that block-by-block inference writes with its prefill and commit passes);
- a canvas is corrupted with uniform noise: at a time t ~ U(1e-4, 1 - 1e-4), each of its tokens is
  replaced, with probability t, by a token drawn uniformly from the whole vocabulary (the
  rectified-flow schedule alpha(t) = 1 - t of `CategoricalProcess.uniform_process`); there is no
  mask token;
- the decoder reads the noisy canvas (bidirectional inside it) against the encoder's keys and values
  of everything before the canvas and predicts the clean canvas; the loss is the plain mean
  cross-entropy over every canvas position, corrupted or not (`NoWeightDiscreteLoss`, no 1/t);
- self-conditioning as trained officially: a first decoder pass without gradients and without a
  self-conditioning signal; for a `self_conditioning_share` of the rows (officially 0.5) the second
  pass is conditioned on that pass's softmax (its raw logits: the official training feeds them
  unscaled, its sampler feeds logits / T), the other rows get a zero signal (what the sampler's
  first step of a canvas gets);
- the encoder is also trained as a causal language model on the clean row (weight 1.0 officially):
  next-token cross-entropy wherever a token and its successor are real.

What we do differently, for CPU time: the official recipe draws one time per example and takes the
loss on one randomly chosen canvas; we draw a time per canvas and take the loss on every canvas of
the row at once, each decoded against exactly the context it has at inference (the clean prompt and
the clean canvases before it). Every canvas is then the training problem the official one is, with
the encoder pass shared by all of them. The first pass runs only on the rows that use it.

The decoder's view matches the engine's and the official code's (engine/models/gemma4_cache.py): a
full layer sees every real position before the canvas, a sliding layer the `sliding_window - 1`
positions just before it (what the official cache retains), whatever the query's position; both
see the whole canvas. `tests/engine/test_dg_training.py` checks both passes against
`DiffusionGemmaModel.encode` / `decode` on a cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import Optional

import torch
import torch.nn.functional as F

from engine.models.diffusion_gemma import DiffusionGemmaModel
from engine.models.gemma4_config import FULL, SLIDING, AttentionKind, Gemma4Spec
from engine.models.gemma4_layers import Rope
from engine.models.gemma4_ops import KindRotaryEmbedding

MIN_TIME = 1e-4  # the official UniformTimeSampler's safety epsilon: t in [1e-4, 1 - 1e-4]

KeysValues = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [B, kv_heads, L, head_dim] each


@dataclass(frozen=True)
class CanvasRows:
    """A micro-batch of examples: the clean rows the encoder reads and the canvases the decoder denoises."""

    clean: torch.Tensor  # [B, S] prompt | response | end fill to a canvas end, right-padded with end tokens
    clean_valid: torch.Tensor  # [B, S] bool: a real token (not right padding)
    prompt_lengths: torch.Tensor  # [B] long: where each row's first canvas starts
    targets: torch.Tensor  # [B, R] the clean canvases of each row, one after the other
    canvas_valid: torch.Tensor  # [B, R] bool: a real canvas (not padding of a shorter row)
    canvas_length: int

    def to(self, device: torch.device | str) -> CanvasRows:
        return replace(self, clean=self.clean.to(device), clean_valid=self.clean_valid.to(device),
                       prompt_lengths=self.prompt_lengths.to(device), targets=self.targets.to(device),
                       canvas_valid=self.canvas_valid.to(device))


def encode_canvas_rows(prompts: Sequence[list[int]], responses: Sequence[list[int]], canvas_length: int,
                       end_id: int) -> CanvasRows:
    """Rows from token ids: each response gets one end token and end fill to the end of its last canvas."""
    canvases = [-(-(len(response) + 1) // canvas_length) for response in responses]
    width = max(len(p) + c * canvas_length for p, c in zip(prompts, canvases, strict=True))
    span = max(canvases) * canvas_length
    clean = torch.full((len(prompts), width), end_id, dtype=torch.long)
    clean_valid = torch.zeros_like(clean, dtype=torch.bool)
    targets = torch.full((len(prompts), span), end_id, dtype=torch.long)
    canvas_valid = torch.zeros_like(targets, dtype=torch.bool)
    for i, (prompt, response, count) in enumerate(zip(prompts, responses, canvases, strict=True)):
        length = count * canvas_length
        canvas = torch.full((length,), end_id, dtype=torch.long)
        canvas[:len(response)] = torch.tensor(response, dtype=torch.long)
        clean[i, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        clean[i, len(prompt):len(prompt) + length] = canvas
        clean_valid[i, :len(prompt) + length] = True
        targets[i, :length] = canvas
        canvas_valid[i, :length] = True
    return CanvasRows(clean, clean_valid, torch.tensor([len(p) for p in prompts]), targets, canvas_valid,
                      canvas_length)


def corrupt(targets: torch.Tensor, canvas_length: int, vocab_size: int,
            generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform noise at one time per canvas: (noisy [B, R], t [B, R // canvas_length]). Each token is
    replaced with probability t by a token uniform over the vocabulary (possibly itself). Drawn on the
    CPU `generator` whatever the device, so every device sees the same noise."""
    batch, span = targets.shape
    t = MIN_TIME + (1 - 2 * MIN_TIME) * torch.rand(batch, span // canvas_length, generator=generator)
    replaced = torch.rand(batch, span, generator=generator) < t.repeat_interleave(canvas_length, dim=1)
    noise = torch.randint(0, vocab_size, (batch, span), generator=generator)
    return torch.where(replaced.to(targets.device), noise.to(targets.device), targets), t


def encoder_masks(clean_valid: torch.Tensor, window: int) -> dict[str, torch.Tensor]:
    """[B, 1, S, S] bool per layer kind: causal over real keys; sliding layers also key > query - window."""
    width = clean_valid.shape[1]
    positions = torch.arange(width, device=clean_valid.device)
    behind = positions[:, None] - positions[None, :]  # query minus key
    full = (behind >= 0)[None] & clean_valid[:, None, :]
    return {FULL: full[:, None], SLIDING: (full & (behind < window)[None])[:, None]}


def decoder_masks(rows: CanvasRows, window: int) -> dict[str, torch.Tensor]:
    """[B, 1, R, S + R] bool per layer kind over the keys [clean row | noisy canvases]: a canvas token
    sees the real clean positions before its canvas (sliding layers: only the `window - 1` just before
    it) and every token of its own canvas."""
    span, width = rows.targets.shape[1], rows.clean.shape[1]
    device = rows.clean.device
    canvas = torch.arange(span, device=device) // rows.canvas_length
    start = rows.prompt_lengths[:, None] + canvas[None, :] * rows.canvas_length  # [B, R]
    positions = torch.arange(width, device=device)
    before = (positions[None, None, :] < start[:, :, None]) & rows.clean_valid[:, None, :]  # [B, R, S]
    recent = before & (positions[None, None, :] >= start[:, :, None] - (window - 1))
    own = (canvas[:, None] == canvas[None, :]).expand(len(start), span, span)
    return {FULL: torch.cat((before, own), dim=-1)[:, None], SLIDING: torch.cat((recent, own), dim=-1)[:, None]}


class SequenceAttention:
    """What a `Gemma4Layer` asks of its pass (`encoder`, `attend`), over whole sequences under given
    masks instead of the cache. An encoder pass keeps every layer's keys and values (with their
    gradients) for the decoder passes; a decoder pass attends over [the encoder's | its own]."""

    def __init__(self, spec: Gemma4Spec, masks: dict[str, torch.Tensor],
                 context: Optional[KeysValues] = None) -> None:
        self.encoder = context is None
        self.layer_types = spec.layer_types
        self.masks = masks
        self.context = context
        self.keys_values: KeysValues = []

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.context is None:
            self.keys_values.append((k, v))
        else:
            context_k, context_v = self.context[layer]
            k, v = torch.cat((context_k, k), dim=2), torch.cat((context_v, v), dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.masks[self.layer_types[layer]], scale=1.0,
                                              enable_gqa=q.shape[1] != k.shape[1])


@cache
def _rotary(kind: AttentionKind) -> KindRotaryEmbedding:
    return KindRotaryEmbedding(kind)


def _layers(model: DiffusionGemmaModel, h: torch.Tensor, positions: torch.Tensor,
            attention: SequenceAttention) -> torch.Tensor:
    ropes: dict[str, Rope] = {SLIDING: _rotary(model.gemma.sliding).forward(positions),
                              FULL: _rotary(model.gemma.full).forward(positions)}
    for i, layer in enumerate(model.layers):
        # the layer reads only `encoder` and `attend` of its pass: SequenceAttention has both
        h = layer.forward(h, ropes[model.gemma.layer_types[i]], attention)  # type: ignore[arg-type]
    return h


def encoder_forward(model: DiffusionGemmaModel, rows: CanvasRows) -> tuple[torch.Tensor, KeysValues]:
    """The causal encoder over the clean rows: its final-normed hidden states [B, S, hidden] and every
    layer's keys and values."""
    batch, width = rows.clean.shape
    positions = torch.arange(width, device=rows.clean.device).expand(batch, width)
    attention = SequenceAttention(model.gemma, encoder_masks(rows.clean_valid, model.gemma.sliding.window or 0))
    h = _layers(model, model.embed_tokens(rows.clean), positions, attention)
    return model.norm.forward(h), attention.keys_values


def decoder_forward(model: DiffusionGemmaModel, noisy: torch.Tensor, positions: torch.Tensor, context: KeysValues,
                    masks: dict[str, torch.Tensor], soft: Optional[torch.Tensor]) -> torch.Tensor:
    """Float32 logits [B, R, vocab] of the noisy canvases at `positions` [B, R] against the encoder's
    `context`; `soft` [B, R, hidden]: the self-conditioning input (`model.soft_embeddings`), None or a
    row of zeros for none."""
    h = model.self_conditioning.forward(model.embed_tokens(noisy), soft)
    h = _layers(model, h, positions, SequenceAttention(model.gemma, masks, context))
    return model.logits(model.norm.forward(h))


def uniform_noise_loss(model: DiffusionGemmaModel, rows: CanvasRows, generator: torch.Generator,
                       self_conditioning_share: float, encoder_loss_weight: float) -> torch.Tensor:
    """The mean cross-entropy of the decoder over every real canvas token, plus `encoder_loss_weight`
    times the encoder's mean next-token cross-entropy on the clean rows. Random draws (noise, which rows
    self-condition) come from the CPU `generator`."""
    batch, span = rows.targets.shape
    noisy, _ = corrupt(rows.targets, rows.canvas_length, model.config.vocab_size, generator)
    conditioned = (torch.rand(batch, generator=generator) < self_conditioning_share).nonzero()[:, 0]
    conditioned = conditioned.to(rows.clean.device)
    hidden, context = encoder_forward(model, rows)
    positions = rows.prompt_lengths[:, None] + torch.arange(span, device=rows.clean.device)
    masks = decoder_masks(rows, model.gemma.sliding.window or 0)
    soft = None
    if len(conditioned):
        with torch.no_grad():
            first = decoder_forward(model, noisy[conditioned], positions[conditioned],
                                    [(k[conditioned], v[conditioned]) for k, v in context],
                                    {kind: mask[conditioned] for kind, mask in masks.items()}, None)
        soft = torch.zeros(batch, span, model.config.hidden_size, dtype=model.dtype, device=rows.clean.device)
        soft[conditioned] = model.soft_embeddings(first)  # the embedding gets gradients through it, as officially
    logits = decoder_forward(model, noisy, positions, context, masks, soft)
    loss = F.cross_entropy(logits[rows.canvas_valid], rows.targets[rows.canvas_valid])
    if encoder_loss_weight:
        pairs = rows.clean_valid[:, :-1] & rows.clean_valid[:, 1:]
        predicted = model.logits(hidden[:, :-1][pairs])
        loss = loss + encoder_loss_weight * F.cross_entropy(predicted, rows.clean[:, 1:][pairs])
    return loss
