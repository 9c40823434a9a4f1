"""The decide step: from a step's logits to what each row commits, and the summary the host reads.

Policies are a registry: name -> (confidence kind, family, decide function). Each decide function
sees the whole batch and returns a commit mask for every row; `decide_step` runs each function
present in the batch once and keeps, per row, the decision of that row's policy, so rows of
different policies share a step. The step ends with one summary tensor (`engine.summary`), whose
host copy is the step's one device-to-host transfer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from engine import summary
from engine.batch import Batch
from engine.decoding import policies as P
from engine.decoding.sampling import (
    CONF_MARGIN,
    CONF_NEG_ENTROPY,
    CONF_PROB,
    confidence,
    filter_min_p,
    filter_top_k_top_p,
    predict,
    predict_unmasked,
    token_logprobs,
)

if TYPE_CHECKING:
    from engine.decoding.state import DecodeTables

# -------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class PolicyInputs:
    """Everything a decide function may read about the step's rows, as [B] / [B, W] tensors."""

    conf: torch.Tensor  # [B, W] Box 1 confidence (of the row's kind)
    candidates: torch.Tensor  # [B, W] still masked and inside the row's block
    x0: torch.Tensor  # [B, W] the predictions
    tokens: torch.Tensor  # [B, W] the block before the step
    editable: torch.Tensor  # [B, W] unmasked generated positions inside the row's block
    step: torch.Tensor
    block: torch.Tensor
    quota: torch.Tensor
    f: Mapping[str, torch.Tensor]  # float knobs by name
    i: Mapping[str, torch.Tensor]  # integer knobs by name
    b: Mapping[str, torch.Tensor]  # boolean knobs by name
    first_conf: torch.Tensor  # [B, W] Box 2's s_i as stored so far
    low_yield: torch.Tensor  # [B]


@dataclass
class Decision:
    commit: torch.Tensor  # [B, W]
    forced: Optional[torch.Tensor] = None  # [B, W] committed below their threshold
    first_conf: Optional[torch.Tensor] = None  # [B, W] state to store back
    low_yield: Optional[torch.Tensor] = None  # [B]
    grinding_exit: Optional[torch.Tensor] = None  # [B]
    edit: Optional[torch.Tensor] = None  # [B, W] unmasked positions that take the prediction


DecideFn = Callable[[PolicyInputs], Decision]


def decide_rank(batch: PolicyInputs) -> Decision:
    """`fixed` (LLaDA) and `dream-*`: the quota best candidates (the quota is computed on the host)."""
    return Decision(P.commit_best(batch.conf, batch.candidates, batch.quota))


def decide_threshold(batch: PolicyInputs) -> Decision:
    """Fast-dLLM: every candidate at or above the threshold, and always the best one."""
    return Decision(P.threshold_commit(batch.conf, batch.candidates, batch.f["threshold"],
                                       torch.ones_like(batch.step)))


def decide_block_dynamic(batch: PolicyInputs) -> Decision:
    """SDAR's low_confidence_dynamic and LLaDA2.0's threshold decoder: every candidate strictly above
    the threshold when there are at least `quota` of them, else the quota best (guarded: only masked
    positions are ever written, decoder B's behaviour; docs/decoding.md)."""
    high = batch.candidates & (batch.conf > batch.f["threshold"][:, None])
    enough = high.sum(dim=1) >= batch.quota
    return Decision(torch.where(enough[:, None], high, P.commit_best(batch.conf, batch.candidates, batch.quota)))


def decide_block_edit(batch: PolicyInputs) -> Decision:
    """LLaDA2.1's decoder: block-dynamic's commits with `num_to_transfer` as the quota (M2T), and
    token edits of the block's unmasked generated positions (T2T), from the same forward."""
    edit = P.token_edits(batch.conf, batch.x0, batch.tokens, batch.editable, batch.f["editing_threshold"])
    return Decision(decide_block_dynamic(batch).commit, edit=edit)


def decide_sequential(batch: PolicyInputs) -> Decision:
    """SDAR's sequential decoder: the `quota` masked positions from the first one on, left to right."""
    position = torch.arange(batch.conf.shape[1], device=batch.conf.device, dtype=batch.conf.dtype)
    return Decision(P.commit_best(-position.expand_as(batch.conf), batch.candidates, batch.quota))


def cai_knobs(f: Mapping[str, torch.Tensor], i: Mapping[str, torch.Tensor],
              b: Mapping[str, torch.Tensor]) -> P.CaiKnobs:
    """CAI's knobs of the rows, from their knob columns by name (decoding.state)."""
    return P.CaiKnobs(theta_s=f["theta_s"], theta_e=f["theta_e"], warmup=f["warmup"],
                      block_schedule=b["block_schedule"], block_decay=f["block_decay"], stretch=b["stretch"],
                      position_factors=b["position_factors"], budgets=b["budgets"], grinding=b["grinding"],
                      eta=f["eta"], eta_denominator=f["eta_denominator"], patience=i["patience"],
                      theta_fb=f["theta_fb"], grinding_fill=b["grinding_fill"], min_commit=i["min_commit"])


def decide_cai(batch: PolicyInputs) -> Decision:
    """CAI, Algorithm 1 (policies.cai_step), with Box 2's s_i stored at a block's first step."""
    first_conf = P.box2_first_step_confidence(batch.conf, batch.first_conf, batch.step)
    i = batch.i
    out = P.cai_step(batch.conf, batch.candidates, batch.step, i["steps_per_block"], batch.block, i["num_blocks"],
                     i["block_length"], P.CaiState(first_conf=first_conf, low_yield=batch.low_yield),
                     cai_knobs(batch.f, i, batch.b))
    return Decision(out.commit, out.forced, first_conf, out.low_yield, out.grinding_exit)


@dataclass(frozen=True)
class Policy:
    conf_kind: int
    family: int
    decide: DecideFn


POLICIES: dict[str, Policy] = {
    "fixed": Policy(CONF_PROB, P.FAMILY_RANK, decide_rank),
    "threshold": Policy(CONF_PROB, P.FAMILY_THRESHOLD, decide_threshold),
    "cai": Policy(CONF_PROB, P.FAMILY_CAI, decide_cai),
    "dream-maskgit_plus": Policy(CONF_PROB, P.FAMILY_RANK, decide_rank),
    "dream-entropy": Policy(CONF_NEG_ENTROPY, P.FAMILY_RANK, decide_rank),
    "dream-topk_margin": Policy(CONF_MARGIN, P.FAMILY_RANK, decide_rank),
    "block-static": Policy(CONF_PROB, P.FAMILY_RANK, decide_rank),
    "block-dynamic": Policy(CONF_PROB, P.FAMILY_BLOCK_DYNAMIC, decide_block_dynamic),
    "block-sequential": Policy(CONF_PROB, P.FAMILY_SEQUENTIAL, decide_sequential),
    "block-edit": Policy(CONF_PROB, P.FAMILY_EDIT, decide_block_edit),
}


def decide_step(batch: Batch, tables: DecodeTables, logits: torch.Tensor, block_tokens: torch.Tensor,
                in_block: torch.Tensor, mask_id: int, end_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Predict, decide and commit for every row; CAI's state is stored back into `tables`. Returns
    (the block's new tokens [B, W], the step's summary: `engine.summary.encode`)."""
    rows = tables.at(batch)
    f, i = rows.f, rows.i
    raw_logits = logits
    if batch.max_top_k > 0 or batch.any_top_p:
        logits = filter_top_k_top_p(logits, i["top_k"], f["top_p"], max_top_k=batch.max_top_k,
                                    any_top_p=batch.any_top_p)
    if batch.any_min_p:
        logits = filter_min_p(logits, f["min_p"])
    edit_rows = i["family"] == P.FAMILY_EDIT if "block-edit" in batch.policies else None
    x0 = predict(logits, batch.sampled, mask_id, mask_rows=edit_rows)
    conf = confidence(logits, x0, i["conf_kind"], frozenset(POLICIES[name].conf_kind for name in batch.policies))
    width = block_tokens.shape[1]
    position = torch.arange(width, device=conf.device)
    # generated positions only: a block-diffusion row's first block holds the prompt's tail
    generated = batch.block_start[:, None] + position >= batch.prompt_len[:, None]
    # a row's store pass (SDAR) commits nothing: its block is the next one, not yet denoised
    denoising = in_block & (batch.commits > 0)[:, None]
    masked = block_tokens == mask_id
    candidates = masked & denoising
    cai = "cai" in batch.policies
    inputs = PolicyInputs(conf=conf, candidates=candidates, x0=x0, tokens=block_tokens,
                          editable=~masked & denoising & generated, step=batch.step, block=batch.block,
                          quota=batch.quota, f=f, i=i, b=rows.b, first_conf=rows.first_conf, low_yield=rows.low_yield)
    commit, forced, grinding, first_conf, low_yield, edit = _dispatch(inputs, batch.policies)
    if batch.edit_fill:  # a block-edit row at its step limit fills its block with tokens (never the mask)
        assert edit_rows is not None
        fill = edit_rows & (batch.step + 1 >= i["max_steps_per_block"])
        x0 = torch.where(fill[:, None], predict_unmasked(logits, mask_id), x0)
        commit = commit | (fill[:, None] & candidates)
        edit = edit & (x0 != block_tokens)  # an edit to the mask id that the fill turned back
    if batch.commit_first:  # Fast-dLLM's Dream block decoder: a block's first forward commits its first token
        first = torch.zeros_like(candidates)
        first[:, 0] = True
        commit = torch.where((batch.commit_first_only > 0)[:, None], first & candidates, commit)
    if cai:
        low_yield = torch.where(batch.commits > 0, low_yield, rows.low_yield)  # a store pass is no step
        tables.store_cai_state(batch, first_conf, low_yield)

    new_tokens = torch.where(commit | edit, x0, block_tokens)
    # a committed position holds a prediction, never the mask, but for block-edit, whose commits and
    # edits may write the mask id
    still_masked = (new_tokens == mask_id) & denoising
    # first still-masked position and first end token (width: none)
    first_masked = torch.where(still_masked, position, width).amin(dim=1)
    is_end = torch.isin(new_tokens, end_ids)
    end_pos = torch.where(is_end & in_block & generated, position, width).amin(dim=1)
    # first-step confidence bands, read by the host at a block's first step alone (the host derives
    # the middle band)
    no_band = torch.zeros_like(candidates)
    high = candidates & (conf > P.CONF_HIGH) if batch.at_block_start else no_band
    low = candidates & (conf < P.CONF_LOW) if batch.at_block_start else no_band
    unmasked = commit & ~still_masked
    counts = [m.sum(dim=1) for m in (unmasked, still_masked, forced, high, low)] + [grinding, end_pos, first_masked]
    counts += [edit.sum(dim=1), (unmasked & is_end).sum(dim=1)]
    logprobs = token_logprobs(raw_logits, x0, batch.logprob_k) if batch.logprob_k >= 0 else None
    return new_tokens, summary.encode(counts, new_tokens, logprobs)


def _dispatch(inputs: PolicyInputs, policies: frozenset[str]) -> tuple[torch.Tensor, ...]:
    """Each present policy's decide function once; per row, the decision of the row's policy.
    Returns (commit, forced, grinding exit, CAI's s_i, CAI's counter, edits)."""
    decided: dict[DecideFn, Decision] = {}
    for name in sorted(policies):
        fn = POLICIES[name].decide
        if fn not in decided:
            decided[fn] = fn(inputs)
    candidates = inputs.candidates
    commit = torch.zeros_like(candidates)
    forced = torch.zeros_like(candidates)
    edit = torch.zeros_like(candidates)
    grinding = torch.zeros_like(inputs.step, dtype=torch.bool)
    first_conf, low_yield = inputs.first_conf, inputs.low_yield
    for fn, decision in decided.items():
        mine = torch.zeros_like(grinding)
        for family in {p.family for p in POLICIES.values() if p.decide is fn}:
            mine |= inputs.i["family"] == family
        commit = torch.where(mine[:, None], decision.commit, commit)
        if decision.edit is not None:
            edit = torch.where(mine[:, None], decision.edit, edit)
        if decision.forced is not None:
            forced = torch.where(mine[:, None], decision.forced, forced)
            grinding = mine & decision.grinding_exit
            first_conf = torch.where(mine[:, None], decision.first_conf, first_conf)
            low_yield = torch.where(mine, decision.low_yield, low_yield)
    return commit, forced, grinding, first_conf, low_yield, edit
