"""Uniform-noise block diffusion (DiffusionGemma): no mask token. A row's generation is a sequence of
canvases of the model's `canvas_length` (CL) tokens; each starts as uniform random ids and every
step re-samples all of it, until its policy (engine/decoding/uniform.py) says it is done or it has
taken `max_denoising_steps` steps; then its argmax canvas is committed, whole.

Each step, for every row, one forward (`canvas`):
- at a canvas's first step, the causal encoder pass first writes into the row's cache the tokens it
  has not encoded yet (the prompt, or the canvas committed last), as the official loop encodes
  before each canvas (the last committed canvas is never encoded), and the row draws its initial
  canvas; rows encoding as many tokens share an encoder pass (no padding: a row's numbers do not
  depend on its batch-mates), or, on static buffers, every row encoding a canvas's length or fewer
  shares one, its tokens padded (`_static_encode`);
- the decoder over the row's noisy canvas against its cache, self-conditioned on the previous
  step's soft embeddings (none at a canvas's first step).
The decide step (`decide`, batched over the rows) tempers the logits (T from t_max towards t_min),
samples every position and draws renoise tokens from the row's own generator (`engine.decoding.
draws`: the one per-row loop, since torch has no batched per-row generator), runs the rows'
policies and returns, for the step's one write-back (`Slots.write_back`), the canvas state (the
mode's row state, `row_state`) and a done canvas's argmax for the slot's canvas. Its summary is the
shared one (`engine.summary`): a canvas is undecided until committed, so a row streams whole
canvases. After an end token in a committed canvas
nothing more is generated (the official loop pads it out).

Prefix caching (engine.prefix_cache) holds whole blocks of `canvas_length` positions from position 0:
the encoder is causal, so a position's keys and values depend only on the tokens up to it, and a row
whose prompt starts with cached blocks has them copied into its cache at admission (`Request.cached`)
and its prefill encodes only the rest (nothing, when every prompt token is restored).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from engine import summary
from engine.batch import Batch, ForwardOutput, RowPlan, StepDecision
from engine.decoding import uniform as U
from engine.decoding.params import DecodeParams
from engine.decoding.registry import decide_canvas, policy_state
from engine.decoding.row_state import RowState, merged
from engine.decoding.sampling import token_logprobs
from engine.host_copy import to_device
from engine.mode import DecodingMode, ForwardFn
from engine.request import Geometry, Request
from engine.slots import RowTables
from engine.static_forward import Buffer, attended_columns
from engine.uniform_slots import UniformSlots

CANVAS = "canvas"
ENCODE = "encode"  # a static shape's key tag: the encoder pass (UniformDiffusion._static_encode)
BLANK = -1  # what a canvas not yet committed reads in the slot's canvas (never a token id, never fed)
# the sampling filters: the entropy-bound sampler draws from the whole tempered distribution
_FILTERS = {"top_k": (None, -1, 0), "top_p": (None, 1.0), "min_p": (None, 0.0)}


class UniformDiffusion(DecodingMode):
    name = "uniform"
    caches = ("exact",)
    prefix_caching = True  # the causal encoder's keys of a prompt's blocks (module docstring)
    slots_class = UniformSlots
    confidence_bands = False
    draws_when_greedy = True  # the initial canvas and the renoise tokens, at any temperature
    slots: UniformSlots

    def __init__(self, model: Any, slots: UniformSlots, static: Optional[str] = None) -> None:
        super().__init__(model, slots, static)
        self.mask_id = self.blank = BLANK
        self.canvas_length: int = model.canvas_length
        self._policy_state = tuple(policy_state(self.name))  # the row state its policies read
        # the checkpoint's generation_config.json, then the official library defaults
        generation = getattr(model, "generation_config", None) or {}
        sampler = generation.get("sampler_config") or {}
        self.defaults = {name: generation.get(name, default) for name, default in U.OFFICIAL.items()}
        self.defaults["entropy_bound"] = sampler.get("entropy_bound", U.OFFICIAL["entropy_bound"])
        # a checkpoint that disables the adaptive stop (a threshold set to null) disables it by default
        self.adaptive_default = all(name not in generation or generation[name] is not None
                                    for name in ("stability_threshold", "confidence_threshold"))
        for name, value in self.defaults.items():
            if value is None:
                self.defaults[name] = U.OFFICIAL[name]

    @property
    def forwards(self) -> dict[str, ForwardFn]:
        return {CANVAS: self._canvas}

    @classmethod
    def row_state(cls, model: Any) -> dict[str, RowState]:
        """Its policies' state and the canvas state between steps: `noisy` the canvas the decoder reads
        next (uniform random ids at a canvas's start); `argmax` the previous step's argmax canvas and
        `stable` the consecutive steps it has not changed (the stop rule's count); `soft` the next
        step's self-conditioning input (the soft embeddings of the tempered logits; the forward alone
        reads it); `accepted` the previous step's accepted count."""
        length = model.canvas_length
        canvas = {"noisy": RowState((length,)), "argmax": RowState((length,)), "stable": RowState(),
                  "soft": RowState((length, model.config.hidden_size), model.dtype, read=False),
                  "accepted": RowState()}
        return merged([policy_state(cls.name), canvas])

    def with_defaults(self, params: DecodeParams) -> DecodeParams:
        unset = {name: value for name, value in self.defaults.items() if getattr(params, name) is None}
        if not self.adaptive_default and params.adaptive_stop:
            unset["adaptive_stop"] = False
        return params.with_overrides(**unset) if unset else params

    def geometry(self, prompt_len: int, params: DecodeParams) -> Geometry:
        length = self.canvas_length
        steps = params.max_denoising_steps
        assert steps is not None, "a uniform-noise request's knobs are resolved (with_defaults) before its geometry"
        return Geometry(prompt_len, prompt_len + -(-params.gen_length // length) * length, length, steps)

    def check_rules(self, params: DecodeParams) -> None:
        if params.block_length != self.canvas_length:
            self.refuse("block_length", f"a canvas is the model's canvas_length ({self.canvas_length}), got "
                                        f"block_length={params.block_length}")
        for name, neutral in _FILTERS.items():  # their neutral values, which OpenAI clients send by default
            if getattr(params, name) not in neutral:
                allowed = " or ".join(str(v) for v in neutral if v is not None)
                self.refuse(name, f"{name} does not apply: every position is sampled from the whole vocabulary "
                                  f"at the temperature that t_max and t_min set (scaled by `temperature`); "
                                  f"{name} may only be {allowed}")
        if params.t_max is not None and params.t_min is not None and params.t_max <= params.t_min:
            self.refuse("t_max", f"t_max ({params.t_max}) must be above t_min ({params.t_min})")

    def plan(self, request: Request) -> RowPlan:
        """The canvas, after the tokens to encode at a canvas's first step."""
        encoded = 0 if request.step else self._to_encode(request)
        return RowPlan(CANVAS, self.canvas_length + encoded, (CANVAS,))

    def _to_encode(self, request: Request) -> int:
        """At a canvas's first step: the prompt's tokens not restored from the prefix cache, or the
        canvas committed last."""
        return request.prompt_len - request.cached if request.block == 0 else self.canvas_length

    def cached_after(self, request: Request, plan: RowPlan) -> int:
        """The cache holds every token before the row's canvas."""
        return request.block_start

    def ends_inside_block(self, request: Request, end_committed: int) -> bool:
        """A committed canvas with an end token ends the row there."""
        return request.params.stops_at_end

    # ---------------------------------------------------------------------------------- forwards

    def _encode_and_draw(self, rows: Batch, starting: list[int]) -> None:
        """The encoder pass of the rows at a canvas's first step, their initial canvases and their
        canvas state reset. On static buffers, every row that encodes a canvas's length or fewer (a
        committed canvas; a short prompt) shares one pass (`_static_encode`); the others share a pass
        with the rows that encode as many tokens (no padding)."""
        slots, requests, length = self.slots, rows.requests, self.canvas_length
        groups: dict[int, list[Request]] = {}
        static: list[Request] = []
        for b in starting:
            r = requests[b]
            fed = self._to_encode(r)
            if fed == 0:  # a prompt restored whole from the prefix cache
                continue
            if self.static_forwards is not None and fed <= min(length, slots.store.retained):
                static.append(r)
            else:
                groups.setdefault(fed, []).append(r)
        if static:
            self._static_encode(static)
        for fed, group in groups.items():
            slot_ids = [r.slot for r in group]
            at = to_device(torch.tensor(slot_ids), slots.device)
            start = to_device(torch.tensor([r.block_start - fed for r in group]), slots.device)
            ids = slots.canvas[at[:, None], start[:, None] + slots.positions[:fed]]
            self.model.encode(ids, slots.store, rows=at, width=max(r.block_start for r in group), slot_ids=slot_ids)
        fresh = [requests[b] for b in starting]
        at = to_device(torch.tensor([r.slot for r in fresh]), slots.device)
        draws = [slots.draws[r.slot] for r in fresh]
        for state in slots.state.values():  # a canvas's state starts at zero
            state.index_fill_(0, at, 0)  # no host value to copy (an assigned 0 would be one)
        slots.state["noisy"][at] = torch.cat([d.canvas((1, length)) for d in draws if d is not None]).to(slots.device)

    def _static_encode(self, group: list[Request]) -> None:
        """One encoder pass on static buffers, keyed by (bucket, columns, ENCODE), for the rows of
        `group`, each encoding a canvas's length or fewer tokens that fit the sliding ring (so the
        prefix cache's insert finds them there: the pass keeps none for it). Each row's tokens are
        padded to a canvas's length, and the rows to the batch bucket by a slot that takes no part;
        a padding token encodes nothing (`count`, CachePass). Longer prompts would make a shape per
        length, each compiled or captured on first use, so they stay eager."""
        assert self.static_forwards is not None
        slots, store = self.slots, self.slots.store
        fed = [self._to_encode(r) for r in group]
        padding = self.static_forwards.bucket(len(group) - 1) - len(group)
        spare = min(set(range(len(group) + 1)) - {r.slot for r in group})
        host = torch.tensor([[r.slot for r in group] + [spare] * padding,
                             [r.block_start - n for r, n in zip(group, fed, strict=True)] + [0] * padding,
                             fed + [0] * padding])
        at, start, count = to_device(host, slots.device)
        steps = slots.positions[:self.canvas_length]
        read = (start[:, None] + steps).clamp(max=slots.canvas.shape[1] - 1)
        ids = torch.where(steps < count[:, None], slots.canvas[at[:, None], read], 0)  # padding: any token id
        key = (len(at), attended_columns(max(r.block_start for r in group), store.width), ENCODE)
        self.static_forwards.forward(key, self._encode_buffers, store.keys[0],
                                     slots.positions[:len(at)], {"ids": ids, "rows": at, "count": count})

    def _canvas(self, rows: Batch, width: int) -> torch.Tensor:
        """Logits [B, CL, V] of each row's noisy canvas against its cache."""
        slots, requests = self.slots, rows.requests
        starting = [b for b, r in enumerate(requests) if r.step == 0]
        if starting:
            self._encode_and_draw(rows, starting)
        soft: Optional[torch.Tensor] = None
        if len(starting) < len(requests) or self.static_forwards is not None:  # zeros: no self-conditioning
            soft = torch.where((rows.step > 0)[:, None, None], slots.state["soft"][rows.slots], 0)
        noisy, width = slots.state["noisy"][rows.slots], max(r.block_start for r in requests) + self.canvas_length
        if self.static_forwards is not None:
            columns = attended_columns(width, slots.store.width)
            key = (self.static_forwards.bucket(requests[-1].slot), columns)
            return self.static_forwards.forward(key, self._buffers, slots.store.keys[0], rows.slots,
                                                {"canvas": noisy, "soft": soft})
        return self.model.decode(noisy, slots.store, rows=rows.slots, self_conditioning=soft, width=width)

    def _buffers(self) -> dict[str, Buffer]:
        """A static decoder pass's inputs; a slot that takes no part decodes token 0 unconditioned
        at its own length (its full layers' scratch columns, which its own next pass rewrites)."""
        length = self.canvas_length
        return {"canvas": Buffer((length,), torch.long, 0),
                "soft": Buffer((length, self.model.config.hidden_size), self.model.dtype, 0)}

    def _encode_buffers(self) -> dict[str, Buffer]:
        """A static encoder pass's inputs: each row's slot (`rows`) and the tokens it encodes (`count`);
        a row that takes no part encodes none."""
        return {"ids": Buffer((self.canvas_length,), torch.long, 0), "rows": Buffer((), torch.long, 0),
                "count": Buffer((), torch.long, 0)}

    def _static_run(self, x: Mapping[str, torch.Tensor], key: tuple) -> torch.Tensor:
        """The decoder pass's logits [bucket, CL, V] of slots [0, bucket) over `columns` full-layer
        columns (key (bucket, columns)), or the encoder pass of the slots `rows` (key (bucket, columns,
        ENCODE)), which returns its `count` input."""
        store, columns = self.slots.store, key[1]
        if key[-1] == ENCODE:
            self.model.encode(x["ids"], store, rows=x["rows"], width=columns, count=x["count"])
            return x["count"]
        return self.model.decode(x["canvas"], store, self_conditioning=x["soft"], width=columns)

    # ------------------------------------------------------------------------------- decide step

    def decide(self, batch: Batch, rows: RowTables, out: ForwardOutput, end_ids: torch.Tensor) -> StepDecision:
        """Sample, accept, stop and commit for every row (module docstring)."""
        slots, at, state = self.slots, batch.slots, rows.state
        knobs = rows.knobs
        scaled = out.logits / U.temperature(batch.step, knobs)[:, None, None]
        probabilities = scaled.softmax(dim=-1)
        sampled, renoise = [], []
        for b, r in enumerate(batch.requests):  # each row from its own generator (module docstring)
            draws = slots.draws[r.slot]
            assert draws is not None
            sampled.append(draws.samples(probabilities[b:b + 1]))
            renoise.append(draws.renoise((1, self.canvas_length)))
        argmax = scaled.argmax(dim=-1)
        later = batch.step > 0
        same = (argmax == state["argmax"]).all(dim=-1) & later
        stable = torch.where(same, state["stable"] + 1, 0)
        x = U.CanvasInputs(entropy=U.entropy(scaled),
                           canvas_in=state["noisy"], sampled=torch.cat(sampled).to(at.device),
                           renoise=torch.cat(renoise).to(at.device), stable=stable, canvas_index=batch.block,
                           knobs=knobs, accepted_before=state["accepted"],
                           state={name: state[name] for name in self._policy_state})
        d = decide_canvas(x, batch.policies)
        capped = batch.step + 1 >= batch.steps_per_block
        done = d.done | capped
        canvas_state = {"noisy": d.next_canvas, "argmax": argmax, "stable": stable,
                        "soft": self.model.soft_embeddings(scaled), "accepted": d.accepted.sum(dim=-1)}
        return StepDecision(torch.where(done[:, None], argmax, BLANK), {**canvas_state, **(d.state or {})},
                            self._summary(batch, out, argmax, done, capped & ~d.done, d.grinding_exit, end_ids))

    def _summary(self, batch: Batch, out: ForwardOutput, argmax: torch.Tensor, done: torch.Tensor,
                 forced: torch.Tensor, grinding_exit: Optional[torch.Tensor], end_ids: torch.Tensor) -> torch.Tensor:
        """The shared summary: a committed canvas is decided at once, an open one not at all."""
        width = argmax.shape[1]
        position = torch.arange(width, device=argmax.device)
        committed = done[:, None] & out.in_block
        tokens = torch.where(committed, argmax, BLANK)
        is_end = torch.isin(tokens, end_ids) & committed
        none = torch.zeros_like(batch.step)
        counts = {"committed": committed.sum(dim=1), "undecided": (~committed & out.in_block).sum(dim=1),
                  "forced": torch.where(forced, committed.sum(dim=1), 0), "band_high": none, "band_low": none,
                  "grinding_exit": none if grinding_exit is None else (grinding_exit & done).long(),
                  "end_pos": torch.where(is_end, position, width).amin(dim=1),
                  "first_undecided": torch.where(done, width, 0), "edited": none, "end_committed": is_end.sum(dim=1)}
        logprobs = token_logprobs(out.logits, argmax, batch.logprob_k) if batch.logprob_k >= 0 else None
        return summary.encode(counts, tokens, logprobs)
