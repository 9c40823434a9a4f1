"""The batched block-diffusion runner: up to `max_batch` requests advance one denoising step at a time.

Each call to `step()` gives every active row one denoising iteration of its current block:
1. plan: a row needs a full forward (no cache, block start, or refresh every f steps) or a cached
   one that feeds only its block (`dual`) or its block and everything after it (`prefix`);
2. run one batched forward per kind present (a row takes part in exactly one: NFE + 1);
3. predict a token and a confidence for each position of each row's block;
4. let each row's policy decide what to commit, commit it, and move rows to their next block or
   finish them (early exit as soon as an end token has no mask before it).
Rows differ freely in prompt and generation length, block length, policy and knobs, and may join
(`add`) or leave (`abort`, or finishing) between any two steps.

KV caches are stored per row as a reference into the `KVStore` of the forward that last wrote
them; rows that forward together again reuse that store in place, otherwise a store is assembled
from their rows (a copy, only when the group of rows changes).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from engine.decoding import policies as P
from engine.decoding.params import DecodeParams, resolve_defaults
from engine.decoding.sampling import CONF_MARGIN, CONF_NEG_ENTROPY, CONF_PROB, confidence, filter_top_k_top_p, predict
from engine.decoding.types import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationRequest,
    GenerationResult,
    RequestStats,
)
from engine.models.kv_cache import CacheWrite, KVStore
from engine.models.transformer import DiffusionTransformer

_CONF_KIND = {"dream-maskgit_plus": CONF_PROB, "dream-entropy": CONF_NEG_ENTROPY, "dream-topk_margin": CONF_MARGIN}
_FULL, _DUAL, _PREFIX = "full", "dual", "prefix"


class RequestError(ValueError):
    """A request the runner cannot take (bad prompt, too long, batch full)."""


class _Row:
    """Plain state and counters of one request inside the runner."""

    def __init__(self, request: GenerationRequest, params: DecodeParams, model: DiffusionTransformer,
                 queued_at: float) -> None:
        self.request = request
        self.params = params
        special = model.special
        self.prompt_len = len(request.prompt_ids)
        self.canvas = torch.tensor([*request.prompt_ids, *([special.mask_id] * params.gen_length)],
                                   dtype=torch.long, device=model.device)
        self.block_length = params.effective_block_length
        self.num_blocks = params.num_blocks
        self.steps_per_block = params.steps_per_block
        self.block = 0
        self.step = 0
        self.masked_at_block_start = self.block_length
        self.first_conf = torch.zeros(self.block_length, device=model.device)
        self.low_yield = 0
        self.dream_fractions = (P.dream_transfer_fractions(self.steps_per_block, params.eps)
                                if params.policy.startswith("dream-") else None)
        self.generator: Optional[torch.Generator] = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=model.device)
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)
        self.kv: Optional[tuple[KVStore, int]] = None
        self.stable_length = 0  # generated tokens that can no longer change (no mask before them)
        self.started = time.perf_counter()
        self.stats = RequestStats(fixed_step_budget=self.num_blocks * self.steps_per_block,
                                  queue_time=self.started - queued_at)

    @property
    def block_start(self) -> int:
        return self.prompt_len + self.block * self.block_length

    @property
    def length(self) -> int:
        return self.canvas.shape[0]

    def forward_kind(self) -> str:
        p = self.params
        if p.cache == "none" or self.step == 0 or (p.refresh_interval and self.step % p.refresh_interval == 0):
            return _FULL
        return _DUAL if p.cache == "dual" else _PREFIX


@dataclass
class _Group:
    rows: list[int]  # indices into the step's row list
    logits: torch.Tensor  # [len(rows), W, V]


class BlockDiffusionRunner:
    def __init__(self, model: DiffusionTransformer, max_batch: int = 8) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.max_batch = max_batch
        self.rows: list[_Row] = []
        self._ids = itertools.count()
        special = model.special
        self._end_ids = torch.tensor(special.end_ids, device=model.device)
        self._shift = 1 if model.logits_shifted else 0
        # tokens each row fed to the model in the last step: its share of the step's work
        self.last_step_work: dict[str, int] = {}
        self.rows_last_commits: dict[str, int] = {}  # tokens each row committed in the last step

    # ------------------------------------------------------------------------------ membership

    @property
    def num_active(self) -> int:
        return len(self.rows)

    @property
    def has_capacity(self) -> bool:
        return len(self.rows) < self.max_batch

    def validate(self, request: GenerationRequest) -> DecodeParams:
        """The request's parameters with model defaults filled; raises RequestError if unusable."""
        params = resolve_defaults(request.params, self.model.config.architecture)
        config = self.model.config
        if not request.prompt_ids:
            raise RequestError("prompt_ids must not be empty")
        bad = [t for t in request.prompt_ids if not 0 <= int(t) < config.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
        total = len(request.prompt_ids) + params.gen_length
        if total > config.max_position_embeddings:
            raise RequestError(f"prompt ({len(request.prompt_ids)}) + gen_length ({params.gen_length}) = {total} "
                               f"exceeds the model's context of {config.max_position_embeddings} tokens")
        return params

    def add(self, request: GenerationRequest, queued_at: Optional[float] = None) -> str:
        if not self.has_capacity:
            raise RequestError(f"the batch is full ({self.max_batch} rows)")
        params = self.validate(request)
        if not request.request_id:
            request = GenerationRequest(request.prompt_ids, request.params, f"req-{next(self._ids)}")
        self.rows.append(_Row(request, params, self.model, queued_at or time.perf_counter()))
        return request.request_id

    def stable_ids(self, request_id: str) -> list[int]:
        """The generated tokens of an active request that are final: the longest committed prefix
        with no mask before it (what a stream may send)."""
        for row in self.rows:
            if row.request.request_id == request_id:
                return row.canvas[row.prompt_len:row.prompt_len + row.stable_length].tolist()
        raise KeyError(request_id)

    def abort(self, request_id: str) -> Optional[GenerationResult]:
        for row in self.rows:
            if row.request.request_id == request_id:
                self.rows.remove(row)
                return self._result(row, FINISH_ABORT, end=None, full=False)
        return None

    # ------------------------------------------------------------------------------ one step

    @torch.no_grad()
    def step(self) -> list[GenerationResult]:
        """One denoising iteration for every active row; returns the rows that finished."""
        rows = self.rows
        if not rows:
            return []
        width = max(r.block_length for r in rows)
        by_kind: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            by_kind.setdefault(row.forward_kind(), []).append(i)
        self.last_step_work = {rows[i].request.request_id: self._fed_tokens(rows[i], kind)
                               for kind, idx in by_kind.items() for i in idx}
        groups = [self._forward(kind, idx, width) for kind, idx in by_kind.items()]
        order = torch.tensor([i for g in groups for i in g.rows], device=self.model.device)
        logits = torch.cat([g.logits for g in groups]).float()
        logits = logits[order.argsort()] if len(groups) > 1 else logits

        block_tokens, candidates = self._block_view(rows, width)
        batch = _BatchParams.build(rows, self.model.device)
        logits = batch.filter(logits)
        x0 = predict(logits, batch.temperature, [r.generator for r in rows])
        conf = confidence(logits, x0, batch.conf_kind)
        commit, forced, low_yield, grinding = self._decide(rows, batch, conf, candidates)

        new_tokens = torch.where(commit, x0, block_tokens)
        summary = self._summarize(rows, new_tokens, candidates, commit, forced, grinding, conf, batch)
        finished: list[GenerationResult] = []
        summary_rows = summary.tolist()
        self.rows_last_commits = {row.request.request_id: info[0] for row, info in zip(rows, summary_rows, strict=True)}
        for i, (row, info) in enumerate(zip(rows, summary_rows, strict=True)):
            start = row.block_start
            row.canvas[start:start + row.block_length] = new_tokens[i, :row.block_length]
            if row.step == 0:
                row.first_conf = conf[i, :row.block_length]
            row.low_yield = int(low_yield[i])
            result = self._advance(row, *info)
            if result is not None:
                finished.append(result)
        if finished:
            done = {r.request_id for r in finished}
            self.rows = [r for r in self.rows if r.request.request_id not in done]
        return finished

    def _advance(self, row: _Row, committed: int, remaining: int, n_forced: int, grinding: int, end_pos: int,
                 band_high: int, band_mid: int, band_low: int, first_masked: int) -> Optional[GenerationResult]:
        stats = row.stats
        row.stable_length = row.block_start - row.prompt_len + first_masked
        stats.nfe += 1
        stats.tokens_per_step.append(committed)
        stats.forced_commits += n_forced
        stats.grinding_exits += grinding
        if row.step == 0:
            for band, count in enumerate((band_high, band_mid, band_low)):
                stats.first_step_confidence_bands[band] += count
        if row.params.early_exit and end_pos >= 0:
            stats.steps_per_block.append(row.step + 1)
            return self._result(row, FINISH_STOP, end=row.block_start + end_pos - row.prompt_len, full=False)
        if remaining:
            row.step += 1
            return None
        stats.steps_per_block.append(row.step + 1)
        row.block += 1
        row.step = 0
        row.low_yield = 0
        row.masked_at_block_start = row.block_length
        if row.block < row.num_blocks:
            return None
        generated = row.canvas[row.prompt_len:]
        is_end = torch.isin(generated, self._end_ids)
        end = int(is_end.int().argmax()) if bool(is_end.any()) else None
        return self._result(row, FINISH_STOP if end is not None else FINISH_LENGTH, end=end, full=True)

    def _result(self, row: _Row, reason: str, end: Optional[int], full: bool) -> GenerationResult:
        row.kv = None
        row.stats.wall_time = time.perf_counter() - row.started
        stop = row.length if full or end is None else row.prompt_len + end + 1
        if reason == FINISH_ABORT:
            stop = row.block_start
        generated = row.canvas[row.prompt_len:stop].tolist()
        return GenerationResult(row.request.request_id, tuple(row.request.prompt_ids), generated, reason,
                                row.stats, end_index=end)

    # ------------------------------------------------------------------------------ forwards

    def _forward(self, kind: str, indices: list[int], width: int) -> _Group:
        rows = [self.rows[i] for i in indices]
        if kind == _FULL:
            return _Group(indices, self._forward_full(rows, width))
        return _Group(indices, self._forward_cached(rows, width, through_end=kind == _PREFIX))

    def _fed_tokens(self, row: _Row, kind: str) -> int:
        if kind == _FULL:
            return row.length * (2 if row.params.cfg_scale > 0 else 1)
        if kind == _DUAL:
            return row.block_length + self._shift
        return row.length - row.block_start + self._shift

    def _logits_positions(self, rows: Sequence[_Row], width: int, offsets: Sequence[int]) -> torch.Tensor:
        """Input index whose output predicts each block position (Dream: the position before)."""
        at = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (row, offset) in enumerate(zip(rows, offsets, strict=True)):
            first = row.block_start - self._shift - offset
            at[i, :row.block_length] = torch.arange(first, first + row.block_length)
        return at.to(self.model.device)

    def _forward_full(self, rows: list[_Row], width: int) -> torch.Tensor:
        """Every row's whole canvas; rows with a KV cache keep the keys/values it produced."""
        model, device = self.model, self.model.device
        guided = [r for r in rows if r.params.cfg_scale > 0]
        inputs = [r.canvas for r in rows]
        for row in guided:  # LLaDA classifier-free guidance: the same canvas with the prompt masked
            unconditional = row.canvas.clone()
            unconditional[:row.prompt_len] = model.special.mask_id
            inputs.append(unconditional)
        length = max(r.length for r in rows)
        ids = torch.full((len(inputs), length), model.special.pad_id, dtype=torch.long, device=device)
        key_mask = torch.zeros(len(inputs), length, dtype=torch.bool, device=device)
        for i, tokens in enumerate(inputs):
            ids[i, :tokens.shape[0]] = tokens
            key_mask[i, :tokens.shape[0]] = True
        positions = torch.arange(length, device=device).expand(len(inputs), -1)
        all_rows = rows + guided
        at = self._logits_positions(all_rows, width, [0] * len(all_rows))
        if any(r.params.cache != "none" for r in rows):
            store = KVStore.empty(model.config.num_layers, len(inputs), model.config.num_kv_heads, length + 1,
                                  model.config.head_dim, model.dtype, device)
            store.key_mask[:, :length] = key_mask
            write = CacheWrite(store, positions)
            logits = model(ids, position_ids=positions, cache=write, logits_at=at)
            for i, row in enumerate(rows):
                row.kv = (store, i) if row.params.cache != "none" else None
        else:
            logits = model(ids, attention_mask=key_mask, position_ids=positions, logits_at=at)
        if guided:
            conditional = logits[:len(rows)].clone()
            for j, row in enumerate(guided):
                i = rows.index(row)
                uncond = logits[len(rows) + j]
                conditional[i] = uncond + (row.params.cfg_scale + 1) * (conditional[i] - uncond)
            logits = conditional
        return logits

    def _gather_store(self, rows: list[_Row]) -> KVStore:
        """A store whose row b is rows[b]'s cache, reusing the rows' own store when it matches."""
        stores = {id(r.kv[0]) for r in rows if r.kv is not None}
        first = rows[0].kv
        if (first is not None and len(stores) == 1 and first[0].batch == len(rows)
                and all(r.kv is not None and r.kv[1] == b for b, r in enumerate(rows))):
            return first[0]
        model = self.model
        width = max(r.length for r in rows) + 1  # + a scratch column for padded queries
        store = KVStore.empty(model.config.num_layers, len(rows), model.config.num_kv_heads, width,
                              model.config.head_dim, model.dtype, model.device)
        for b, row in enumerate(rows):
            assert row.kv is not None, "a cached forward needs a full forward first"
            source, index = row.kv
            n = row.length
            for layer in range(model.config.num_layers):
                store.keys[layer][b, :, :n] = source.keys[layer][index, :, :n]
                store.values[layer][b, :, :n] = source.values[layer][index, :, :n]
            store.key_mask[b, :n] = True
            row.kv = (store, b)
        return store

    def _forward_cached(self, rows: list[_Row], width: int, through_end: bool) -> torch.Tensor:
        """Feed each row's block (dual) or block and everything after it (prefix); the other
        positions' keys/values come from the cache. Dream also feeds the position before the block,
        whose output predicts the block's first token."""
        model, device = self.model, self.model.device
        store = self._gather_store(rows)
        scratch = store.width - 1
        spans = []
        for row in rows:
            first = row.block_start - self._shift
            spans.append((first, row.length if through_end else row.block_start + row.block_length))
        length = max(end - first for first, end in spans)
        ids = torch.full((len(rows), length), model.special.mask_id, dtype=torch.long, device=device)
        positions = torch.zeros(len(rows), length, dtype=torch.long, device=device)
        write_index = torch.full((len(rows), length), scratch, dtype=torch.long, device=device)
        for i, (row, (first, end)) in enumerate(zip(rows, spans, strict=True)):
            ids[i, :end - first] = row.canvas[first:end]
            positions[i, :end - first] = torch.arange(first, end, device=device)
            # The extra position before the block (Dream) is only a query: its cached key/value
            # stay from the last full forward, as every other position outside the fed span.
            write_index[i, self._shift:end - first] = torch.arange(first + self._shift, end, device=device)
        at = self._logits_positions(rows, width, [first for first, _ in spans])
        return model(ids, position_ids=positions, cache=CacheWrite(store, write_index), logits_at=at)

    # ------------------------------------------------------------------------------ decisions

    def _block_view(self, rows: list[_Row], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Current block tokens [B, W] (padded past each row's block) and its masked positions."""
        mask_id = self.model.special.mask_id
        tokens = torch.full((len(rows), width), self.model.special.pad_id, dtype=torch.long, device=self.model.device)
        for i, row in enumerate(rows):
            tokens[i, :row.block_length] = row.canvas[row.block_start:row.block_start + row.block_length]
        return tokens, tokens == mask_id

    def _decide(self, rows: list[_Row], batch: _BatchParams, conf: torch.Tensor,
                candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        device = conf.device
        step = torch.tensor([r.step for r in rows], device=device)
        commit = torch.zeros_like(candidates)
        forced = torch.zeros_like(candidates)
        low_yield = torch.tensor([r.low_yield for r in rows], device=device)
        grinding = torch.zeros(len(rows), dtype=torch.bool, device=device)
        families = batch.families_present
        if P.FAMILY_RANK in families:
            masked_now = candidates.sum(dim=1)
            fractions = torch.tensor([r.dream_fractions[r.step] if r.dream_fractions else 0.0 for r in rows],
                                     dtype=torch.float32, device=device)
            start = torch.tensor([r.masked_at_block_start for r in rows], device=device)
            quota = torch.where(batch.is_dream, P.dream_quota(masked_now, fractions, step >= batch.steps_per_block - 1),
                                P.fixed_quota(start, batch.steps_per_block, step))
            rank = P.commit_best(conf, candidates, quota)
            commit = torch.where((batch.family == P.FAMILY_RANK)[:, None], rank, commit)
        if P.FAMILY_THRESHOLD in families:
            thr = P.threshold_commit(conf, candidates, batch.threshold, torch.ones_like(step))
            commit = torch.where((batch.family == P.FAMILY_THRESHOLD)[:, None], thr, commit)
        if P.FAMILY_CAI in families:
            first_conf = torch.stack([r.first_conf if r.first_conf.shape[0] == conf.shape[1]
                                      else torch.nn.functional.pad(r.first_conf, (0, conf.shape[1] - r.block_length))
                                      for r in rows])
            first_conf = torch.where((step == 0)[:, None], conf, first_conf)
            block_index = torch.tensor([r.block for r in rows], device=device)
            state = P.CaiState(first_conf=first_conf, low_yield=low_yield)
            cai = P.cai_step(conf, candidates, step, batch.steps_per_block, block_index, batch.num_blocks,
                             batch.block_length, state, batch.cai)
            is_cai = batch.family == P.FAMILY_CAI
            commit = torch.where(is_cai[:, None], cai.commit, commit)
            forced = torch.where(is_cai[:, None], cai.forced, forced)
            low_yield = torch.where(is_cai, cai.low_yield, low_yield)
            grinding = is_cai & cai.grinding_exit
        first_only = batch.commit_first & (step == 0)
        if bool(first_only.any()):
            first = torch.zeros_like(candidates)
            first[:, 0] = True
            commit = torch.where(first_only[:, None], first & candidates, commit)
        return commit, forced, low_yield, grinding

    def _summarize(self, rows: list[_Row], new_tokens: torch.Tensor, candidates: torch.Tensor, commit: torch.Tensor,
                   forced: torch.Tensor, grinding: torch.Tensor, conf: torch.Tensor,
                   batch: _BatchParams) -> torch.Tensor:
        """Per row, in one tensor (one device sync): committed, still masked, forced, grinding exit,
        early-exit end position (-1 if none), the first-step confidence band counts and the first
        position of the block still masked (the block length if none)."""
        still_masked = new_tokens == self.model.special.mask_id
        is_end = torch.isin(new_tokens, self._end_ids) & (batch.position < batch.block_length[:, None])
        clear_before = still_masked.int().cumsum(dim=1) == 0
        hit = is_end & clear_before
        end_pos = torch.where(hit.any(dim=1), hit.int().argmax(dim=1), torch.full_like(grinding, -1, dtype=torch.long))
        bands = torch.stack([candidates & (conf > P.CONF_HIGH),
                             candidates & (conf >= P.CONF_LOW) & (conf <= P.CONF_HIGH),
                             candidates & (conf < P.CONF_LOW)], dim=1).sum(dim=2)
        in_block = still_masked & (batch.position < batch.block_length[:, None])
        first_masked = torch.where(in_block.any(dim=1), in_block.int().argmax(dim=1), batch.block_length)
        return torch.cat([torch.stack([commit.sum(dim=1), still_masked.sum(dim=1), forced.sum(dim=1),
                                       grinding.long(), end_pos], dim=1), bands, first_masked[:, None]], dim=1)


@dataclass
class _BatchParams:
    """The per-row knobs of the current rows as [B] tensors (rebuilt each step; a few dozen scalars)."""

    family: torch.Tensor
    families_present: frozenset[int]
    is_dream: torch.Tensor
    conf_kind: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    threshold: torch.Tensor
    commit_first: torch.Tensor
    steps_per_block: torch.Tensor
    num_blocks: torch.Tensor
    block_length: torch.Tensor
    position: torch.Tensor
    cai: P.CaiKnobs

    @classmethod
    def build(cls, rows: Sequence[_Row], device: torch.device) -> _BatchParams:
        def col(values: Iterable, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(list(values), dtype=dtype, device=device)

        params = [r.params for r in rows]
        families = [P.FAMILY_CAI if p.policy == "cai" else P.FAMILY_THRESHOLD if p.policy == "threshold"
                    else P.FAMILY_RANK for p in params]
        block_length = col((r.block_length for r in rows), torch.long)
        gating = [p.gating_on for p in params]
        cai = P.CaiKnobs(
            theta_s=col(p.theta_s for p in params), theta_e=col(p.theta_e for p in params),
            warmup=col(p.warmup for p in params),
            block_schedule=col((p.block_schedule for p in params), torch.bool),
            block_decay=col(p.block_decay for p in params),
            stretch=col((p.block_schedule_mode == "stretch" for p in params), torch.bool),
            position_factors=col((p.position_factors for p in params), torch.bool),
            budgets=col((p.budgets and g for p, g in zip(params, gating, strict=True)), torch.bool),
            grinding=col((p.grinding and g for p, g in zip(params, gating, strict=True)), torch.bool),
            eta=col(p.eta for p in params),
            eta_denominator=col(p.gen_length if p.eta_denominator == "generation" else r.block_length
                                for p, r in zip(params, rows, strict=True)),
            patience=col((p.patience for p in params), torch.long),
            theta_fb=col(p.theta_fb for p in params),
            grinding_fill=col((p.grinding_exit == "fill" for p in params), torch.bool),
            min_commit=col((p.min_commit for p in params), torch.long),
        )
        width = int(max(r.block_length for r in rows))
        return cls(
            family=col(families, torch.long), families_present=frozenset(families),
            is_dream=col((p.policy.startswith("dream-") for p in params), torch.bool),
            conf_kind=col((_CONF_KIND.get(p.policy, CONF_PROB) for p in params), torch.long),
            temperature=col(p.temperature for p in params),
            top_k=col((p.top_k or 0 for p in params), torch.long),
            top_p=col(p.top_p if p.top_p is not None else 1.0 for p in params),
            threshold=col(p.threshold for p in params),
            commit_first=col((p.commit_first_at_block_start for p in params), torch.bool),
            steps_per_block=col((r.steps_per_block for r in rows), torch.long),
            num_blocks=col((r.num_blocks for r in rows), torch.long),
            block_length=block_length,
            position=torch.arange(width, device=device)[None, :].expand(len(rows), -1),
            cai=cai,
        )

    def filter(self, logits: torch.Tensor) -> torch.Tensor:
        if bool((self.top_k > 0).any()) or bool((self.top_p < 1).any()):
            return filter_top_k_top_p(logits, self.top_k, self.top_p)
        return logits
