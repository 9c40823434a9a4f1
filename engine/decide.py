"""The mask-token decide step (`DecodingMode.decide`'s default: masked and block diffusion): from a
step's logits to what each row commits, and the summary the host reads.

The logits are filtered (top-k / top-p / min-p), every position gets a prediction and a confidence
(`engine.decoding.sampling`), the policy registry decides every row by its policy
(`engine.decoding.registry.decide`), and the step ends with one summary tensor (`engine.summary`),
whose host copy is the step's one device-to-host transfer. Which positions are still undecided is
the decoding mode's progress measure (`undecided`: `DecodingMode.undecided`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine import summary
from engine.batch import Batch, ForwardOutput, StepDecision
from engine.decoding import policies as P
from engine.decoding import vocab_parallel as V
from engine.decoding.knobs import field_words
from engine.decoding.params import DecodeParams
from engine.decoding.registry import POLICIES, PolicyInputs, decide, policy_rows
from engine.decoding.sampling import CONF_PROB, confidence, filter_min_p, filter_top_k_top_p, predict, token_logprobs
from engine.slots import RowTables

_WORDS = field_words(DecodeParams)


def decide_masks(batch: Batch, rows: RowTables, out: ForwardOutput, end_ids: torch.Tensor, mask_id: int,
                 undecided_of: Callable[[torch.Tensor], torch.Tensor]) -> StepDecision:
    """Predict, decide and commit for every row."""
    knobs = rows.knobs
    logits = raw_logits = out.logits
    shard = out.vocab  # a tensor-parallel rank's columns (engine/decoding/vocab_parallel.py)
    if shard is not None and batch.any_top_p:  # top_p sorts the whole vocabulary
        logits = raw_logits = shard.gather(logits)
        shard = None
    if shard is not None and batch.max_top_k > 0:
        logits = V.filter_top_k(logits, shard, knobs["top_k"], batch.max_top_k)
    elif batch.max_top_k > 0 or batch.any_top_p:
        logits = filter_top_k_top_p(logits, knobs["top_k"], knobs["top_p"], max_top_k=batch.max_top_k,
                                    any_top_p=batch.any_top_p)
    if batch.any_min_p:
        min_p = knobs["min_p"]
        logits = filter_min_p(logits, min_p) if shard is None else V.filter_min_p(logits, shard, min_p)
    policy = knobs["policy"]
    editing = [name for name in batch.policies if POLICIES[name].edits]
    mask_rows = policy_rows(policy, editing) if editing else None
    kinds: dict[int, list[str]] = {}
    for name in batch.policies:
        kinds.setdefault(POLICIES[name].conf_kind, []).append(name)
    rows_by_kind = {kind: policy_rows(policy, names) for kind, names in kinds.items() if kind != CONF_PROB}
    if shard is None:
        x0, unmasked = predict(logits, batch.sampled, mask_id, mask_rows=mask_rows)
        conf = confidence(logits, x0, rows_by_kind)
    else:
        x0, unmasked, conf = V.predict_and_confidence(logits, shard, batch.sampled, mask_id, mask_rows, rows_by_kind)
    block_tokens, in_block = out.block_tokens, out.in_block
    width = block_tokens.shape[1]
    position = torch.arange(width, device=conf.device)
    # generated positions only: a block-diffusion row's first block holds the prompt's tail
    generated = batch.block_start[:, None] + position >= batch.prompt_len[:, None]
    # a row's store pass (SDAR) commits nothing: its block is the next one, not yet denoised
    denoising = in_block & (batch.commits > 0)[:, None]
    undecided = undecided_of(block_tokens)
    candidates = undecided & denoising
    inputs = PolicyInputs(conf=conf, candidates=candidates, x0=x0, unmasked=unmasked, tokens=block_tokens,
                          editable=~undecided & denoising & generated, step=batch.step, block=batch.block,
                          quota=batch.quota, block_length=batch.block_length, steps_per_block=batch.steps_per_block,
                          num_blocks=batch.num_blocks, knobs=knobs, words=_WORDS, state=rows.state,
                          first_only=batch.first_only > 0 if batch.any_first_only else None)
    decision = decide(inputs, batch.policies)
    commit, edit, tokens = decision.commit, decision.edit, decision.tokens
    assert edit is not None and tokens is not None and decision.forced is not None
    new_tokens = torch.where(commit | edit, tokens, block_tokens)
    # a committed position holds a prediction, never the mask, but for a policy that edits, whose
    # commits and edits may write the mask id
    still = undecided_of(new_tokens) & denoising
    # first still-undecided position and first end token (width: none)
    first_undecided = torch.where(still, position, width).amin(dim=1)
    is_end = torch.isin(new_tokens, end_ids)
    end_pos = torch.where(is_end & in_block & generated, position, width).amin(dim=1)
    # first-step confidence bands, read by the host at a block's first step alone (the host derives
    # the middle band)
    no_band = torch.zeros_like(candidates)
    high = candidates & (conf > P.CONF_HIGH) if batch.at_block_start else no_band
    low = candidates & (conf < P.CONF_LOW) if batch.at_block_start else no_band
    committed = commit & ~still
    counts = {"committed": committed.sum(dim=1), "undecided": still.sum(dim=1), "forced": decision.forced.sum(dim=1),
              "band_high": high.sum(dim=1), "band_low": low.sum(dim=1), "grinding_exit": decision.grinding_exit,
              "end_pos": end_pos, "first_undecided": first_undecided, "edited": edit.sum(dim=1),
              "end_committed": (committed & is_end).sum(dim=1)}
    logprobs = None
    if batch.logprob_k >= 0:
        logprobs = (token_logprobs(raw_logits, tokens, batch.logprob_k) if shard is None
                    else V.token_logprobs(raw_logits, shard, tokens, batch.logprob_k))
    state = {}
    if decision.state is not None:  # a forward that commits nothing is no step: its rows keep their state
        step = batch.commits > 0
        state = {name: torch.where(step.view(-1, *[1] * (value.dim() - 1)), value, rows.state[name])
                 for name, value in decision.state.items()}
    return StepDecision(new_tokens, state, summary.encode(counts, new_tokens, logprobs))
