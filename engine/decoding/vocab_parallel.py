"""The decide step on vocabulary-parallel logits: under tensor parallelism each rank holds its shard
of a step's logits (`VocabShard`), and instead of gathering them whole (8 rows x a 32-token block of
a 157 k vocabulary is 161 MB of float32 a step) every rank reduces its shard to a few numbers per
position, which one small all-gather combines: the same decisions as one device (engine/decoding/
sampling.py), from a few kilobytes.

- Prediction: the best id (never the mask, but in `mask_rows`), and for a sampling row the Gumbel-max
  winner: every rank draws the row's noise over the whole vocabulary from the row's generator (the
  draws of one device) and keeps its own columns. Ties break toward the lowest id, as `argmax` does
  on one device: ranks hold the ids in order.
- Confidence: the probability of the prediction, exp(l - M) / S with M the largest logit and
  S = sum exp(l - M) combined over the ranks; the negative entropy (each rank's sum, then one
  all-reduce); the top-1 minus top-2 probability. One device's float32 softmax sums in vector lanes
  and is off by ~1e-5 (relative) at a 150 k vocabulary, S here by far less: a confidence within that
  of a threshold may be decided otherwise at TP 1 and TP N (the tests' tokens are identical).
- top_k: the k-th largest logit of the whole vocabulary, from each rank's k largest; min_p: M.
- Logprobs: the raw logits' log-sum-exp, the logit of each chosen token and each rank's k best.
top_p needs the whole sorted vocabulary: a batch with a top_p row gathers the logits instead (the
decide step does, `VocabShard.gather`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

import torch

from engine.decoding.sampling import _ENTROPY_EPS, CONF_MARGIN, CONF_NEG_ENTROPY, _best_but
from engine.models.parallel.group import VocabShard

_NEG_INF = float("-inf")


def _exchange(shard: VocabShard, columns: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's `columns` (name -> [B, W] or [B, W, n]) in one all-gather: name -> [size, B, W(, n)].
    Packed in float64, which holds float32 values and token ids exactly."""
    parts = [c.double() if c.dim() == 3 else c.double()[..., None] for c in columns.values()]
    stacked = shard.tp.all_gather_stack(torch.cat(parts, dim=-1))
    out, at = {}, 0
    for (name, column), part in zip(columns.items(), parts, strict=True):
        value = stacked[..., at:at + part.shape[-1]]
        out[name] = value if column.dim() == 3 else value[..., 0]
        at += part.shape[-1]
    return out


def _best(scores: torch.Tensor, excluded: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, local index) of the largest of `scores` [..., n], never column `excluded`."""
    index = scores.argmax(dim=-1) if excluded is None else _best_but(scores, excluded)
    return scores.gather(-1, index[..., None])[..., 0], index


def _winner(values: torch.Tensor, *others: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Of stacked per-rank candidates [size, B, W], the largest value's (the lowest rank on a tie),
    and the other stacks' entries at the same rank."""
    rank = values.argmax(dim=0, keepdim=True)
    return tuple(t.gather(0, rank)[0] for t in (values, *others))


def _normaliser(m: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole vocabulary's (M, S) from every rank's max and sum of exp(l - max) [size, B, W]."""
    top = m.amax(dim=0)
    safe = torch.where(torch.isfinite(m), m, top)  # a rank whose logits are all -inf adds nothing
    return top, (s * torch.exp(safe - top)).sum(dim=0)


def _local_normaliser(local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m = local.amax(dim=-1)
    safe = torch.where(torch.isfinite(m), m, 0.0)
    return m, torch.exp(local - safe[..., None]).sum(dim=-1)


def _local(shard: VocabShard, token: int) -> Optional[int]:
    """The column of vocabulary id `token` on this rank, None where another rank holds it."""
    return token - shard.start if 0 <= token - shard.start < shard.real else None


def predict_and_confidence(local: torch.Tensor, shard: VocabShard,
                           sampled: Sequence[tuple[int, torch.Generator, float]], mask_id: int,
                           mask_rows: Optional[torch.Tensor], rows_by_kind: Mapping[int, torch.Tensor]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sampling.predict` and `sampling.confidence` on a rank's shard [B, W, V/size] (float32; padding
    columns -inf): (x0, unmasked, confidence), the same on every rank."""
    mask = _local(shard, mask_id)
    greedy, greedy_at = _best(local, mask)
    m, s = _local_normaliser(local)
    columns = {"greedy": greedy, "greedy_id": greedy_at + shard.start, "m": m, "s": s}
    if mask_rows is not None:
        best, best_at = _best(local)
        columns.update(best=best, best_id=best_at + shard.start)
    if sampled:
        # a row that samples: its Gumbel-max winner (never the mask; over every id in a mask row) and
        # the raw logit there; rows that do not sample: -inf
        kinds = ("drawn", "drawn_any") if mask_rows is not None else ("drawn",)
        for kind in kinds:
            columns.update({kind: torch.full_like(greedy, _NEG_INF, dtype=torch.float64),
                            f"{kind}_id": torch.zeros_like(greedy_at), f"{kind}_logit": torch.zeros_like(greedy)})
        real = local[..., :shard.real]
        for row, generator, tau in sampled:
            noise = torch.rand((local.shape[1], shard.vocab_size), generator=generator, dtype=torch.float64,
                               device=local.device)[:, shard.start:shard.start + shard.real]
            gumbel = real[row].double() - tau * torch.log(-torch.log(noise))
            for kind in kinds:
                value, at = _best(gumbel, mask if kind == "drawn" else None)
                columns[kind][row], columns[f"{kind}_id"][row] = value, at + shard.start
                columns[f"{kind}_logit"][row] = real[row].gather(-1, at[:, None])[:, 0]
    if CONF_MARGIN in rows_by_kind:
        columns["top2"] = local.topk(min(2, local.shape[-1]), dim=-1).values
    x = _exchange(shard, columns)
    top, total = _normaliser(x["m"], x["s"])
    chosen, unmasked = _winner(x["greedy"], x["greedy_id"])
    x0 = unmasked
    if mask_rows is not None:
        best, best_id = _winner(x["best"], x["best_id"])
        x0, chosen = torch.where(mask_rows[:, None], best_id, x0), torch.where(mask_rows[:, None], best, chosen)
    if sampled:
        _, drawn_id, drawn_logit = _winner(x["drawn"], x["drawn_id"], x["drawn_logit"])
        if mask_rows is not None:
            _, any_id, any_logit = _winner(x["drawn_any"], x["drawn_any_id"], x["drawn_any_logit"])
            drawn_id = torch.where(mask_rows[:, None], any_id, drawn_id)
            drawn_logit = torch.where(mask_rows[:, None], any_logit, drawn_logit)
        rows = torch.zeros(local.shape[0], dtype=torch.bool, device=local.device)
        rows[[row for row, _, _ in sampled]] = True
        x0, chosen = torch.where(rows[:, None], drawn_id, x0), torch.where(rows[:, None], drawn_logit, chosen)
    top, total = top.float(), total.float()
    conf = torch.exp(chosen.float() - top) / total
    if CONF_NEG_ENTROPY in rows_by_kind:
        probs = torch.exp(local - top[..., None]) / total[..., None]
        neg_entropy = shard.tp.all_reduce((probs * torch.log(probs + _ENTROPY_EPS)).sum(dim=-1))
        conf = torch.where(rows_by_kind[CONF_NEG_ENTROPY][:, None], neg_entropy, conf)
    if CONF_MARGIN in rows_by_kind:
        top2 = x["top2"].permute(1, 2, 0, 3).flatten(2).float().topk(2, dim=-1).values
        margin = (torch.exp(top2[..., 0] - top) - torch.exp(top2[..., 1] - top)) / total
        conf = torch.where(rows_by_kind[CONF_MARGIN][:, None], margin, conf)
    return x0.long(), unmasked.long(), conf


def filter_top_k(local: torch.Tensor, shard: VocabShard, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """`sampling.filter_top_k_top_p`'s top-k on a shard: below the whole vocabulary's k-th largest
    logit, the dtype's lowest value."""
    k = top_k.clamp(min=1, max=shard.vocab_size)
    count = min(max_top_k, shard.vocab_size)
    mine = local.topk(min(count, local.shape[-1]), dim=-1).values
    everyone = _exchange(shard, {"top": mine})["top"].permute(1, 2, 0, 3).flatten(2).float()
    kth = everyone.topk(count, dim=-1).values.gather(-1, (k - 1)[:, None, None].expand(-1, local.shape[1], 1))
    return local.masked_fill((local < kth) & (top_k > 0)[:, None, None], torch.finfo(local.dtype).min)


def filter_min_p(local: torch.Tensor, shard: VocabShard, min_p: torch.Tensor) -> torch.Tensor:
    """`sampling.filter_min_p` on a shard, the largest logit taken over the whole vocabulary."""
    top = _exchange(shard, {"m": local.amax(dim=-1)})["m"].amax(dim=0).float()
    floor = top[..., None] + torch.log(min_p)[:, None, None]
    return local.masked_fill((local < floor) & (min_p > 0)[:, None, None], torch.finfo(local.dtype).min)


def token_logprobs(local: torch.Tensor, shard: VocabShard, tokens: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sampling.token_logprobs` on a shard of the raw logits: log p of each token [B, W] and the k
    most likely tokens' log p and ids [B, W, k]."""
    local = local.float()
    m, s = _local_normaliser(local)
    inside = (tokens >= shard.start) & (tokens < shard.start + shard.real)
    column = (tokens - shard.start).clamp(0, local.shape[-1] - 1)
    logit = torch.where(inside, local.gather(-1, column[..., None])[..., 0], _NEG_INF)
    columns = {"m": m, "s": s, "logit": logit}
    if k > 0:
        top = local.topk(min(k, local.shape[-1]), dim=-1)
        columns.update(top=top.values, top_id=top.indices + shard.start)
    x = _exchange(shard, columns)
    top_logit, total = _normaliser(x["m"], x["s"])
    lse = (top_logit + torch.log(total)).float()
    chosen = x["logit"].amax(dim=0).float() - lse
    empty = chosen.new_zeros(*tokens.shape, 0)
    if k == 0:
        return chosen, empty, empty.long()
    values = x["top"].permute(1, 2, 0, 3).flatten(2)
    best = values.topk(k, dim=-1)
    ids = x["top_id"].permute(1, 2, 0, 3).flatten(2).gather(-1, best.indices)
    return chosen, best.values.float() - lse[..., None], ids.long()
