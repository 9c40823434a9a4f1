"""How a row advances from its step's host summary, in one place: its cache (its mode's rule), the
block's tokens, logprobs and telemetry, when the block ends (its policy's rule), when the row ends,
and which tokens it reports as final.

A block ends when nothing in it is left undecided, unless its policy says otherwise (`block-edit`,
LLaDA2.1's decoder: `engine.decoding.registry.edit_block_ends`). A row ends at an end token with
nothing undecided before it inside its block when its mode says so (early exit in masked diffusion;
`eos_early_stop` in block diffusion), else at an end token in a finished block (LLaDA2.0's check
after every block, SDAR's, LLaDA2.1's `eos_early_stop`; masked diffusion's early exit), or after
its last block.
"""

from __future__ import annotations

from typing import Optional

from engine.batch import RowPlan
from engine.decoding.types import FINISH_LENGTH, FINISH_STOP, GenerationResult, TokenLogprob
from engine.mode import DecodingMode
from engine.request import Request, StepOutput, finish
from engine.summary import RowSummary


def advance(request: Request, info: RowSummary, plan: RowPlan, mode: DecodingMode) -> StepOutput:
    """Advance a row by its step and report what became final: the generated tokens that can no
    longer change (nothing undecided before them; for a policy that edits, the finished blocks)."""
    request.stats.nfe += 1
    request.cached = mode.cached_after(request, plan)
    offset = request.block_start - request.origin
    if plan.commits:
        stable = offset + min(info.first_undecided, request.block_length)
        if request.mirror.logprobs is not None:
            _record_logprobs(request, info, mode.blank)
        result = _denoised(request, info, mode)
        if request.policy.edits:  # it may still change its block: finished blocks only
            stable = request.block_start - request.origin
    else:  # SDAR's store pass: a finished block is now cached, and the end check follows it
        stable = offset
        request.stats.tokens_per_step.append(0)
        result = _finished_block(request)
    if result is not None:
        stable = request.tail + len(result.generated_ids)
    new_ids, new_logprobs = request.mirror.take_new_final(min(stable, request.tail + request.gen_length),
                                                          request.end_ids)
    return StepOutput(request.request_id, new_ids, info.committed, plan.fed, result, new_logprobs,
                      request.stats.cached_tokens)


def _denoised(request: Request, info: RowSummary, mode: DecodingMode) -> Optional[GenerationResult]:
    """A denoising step: the block's tokens and telemetry, and the move to the next block once the
    block ends. The row's result when the step ends it."""
    stats = request.stats
    offset = request.block_start - request.origin
    width = request.block_length
    request.mirror.tokens[offset:offset + width] = info.tokens[:width]
    stats.tokens_per_step.append(info.committed)
    stats.forced_commits += info.forced
    stats.grinding_exits += info.grinding_exit
    stats.token_edits += info.edited
    if request.step == 0 and mode.confidence_bands:
        bands = stats.first_step_confidence_bands
        bands[0] += info.band_high
        bands[1] += request.undecided - info.band_high - info.band_low
        bands[2] += info.band_low
    undecided_before = request.undecided
    request.undecided = info.undecided
    if not info.undecided:
        request.post_steps += 1  # the next forward of the block would start with no mask
    if info.end_pos < info.first_undecided and mode.ends_inside_block(request, info.end_committed):
        stats.steps_per_block.append(request.step + 1)
        return _stop_at(request, offset + info.end_pos - request.tail)
    if not request.policy.block_ends(request, info, undecided_before):
        request.step += 1
        return None
    stats.steps_per_block.append(request.step + 1)
    request.block += 1
    request.step = 0
    request.post_steps = 0
    request.undecided = request.undecided_at_block_start = width
    return None if request.params.store_pass else _finished_block(request)


def _record_logprobs(request: Request, info: RowSummary, blank: int) -> None:
    """The logprobs of the positions this step wrote a token to (undecided before it, or an edit; never
    one it left `blank`): a position's logprobs are those of the step that wrote its final token."""
    offset = request.block_start - request.origin
    k = request.params.logprobs or 0
    assert request.mirror.logprobs is not None
    for position in range(request.block_length):
        token = info.tokens[position]
        if request.mirror.tokens[offset + position] != token and token != blank:
            chosen, top = info.logprob(position)
            request.mirror.logprobs[offset + position] = TokenLogprob(token, chosen, top[:k])


def _stop_at(request: Request, end: int) -> GenerationResult:
    """The result of a row stopped at its response index `end` (an end token, nothing undecided before it)."""
    response = request.mirror.tokens[request.tail:request.tail + request.gen_length]
    if end < request.gen_length:
        return finish(request, FINISH_STOP, response[:end + 1], end)
    return finish(request, FINISH_LENGTH, response, None)  # the end token lies past gen_length


def _finished_block(request: Request) -> Optional[GenerationResult]:
    """The result when the blocks before the current one end the row, else None."""
    done = request.block_start - request.origin
    end = request.first_end(done) if request.params.stops_at_end else None
    if end is None and request.block < request.num_blocks:
        return None
    response = request.mirror.tokens[request.tail:request.tail + request.gen_length]
    if end is not None and end < request.gen_length:
        return finish(request, FINISH_STOP, response[:end + 1], end)
    end = request.first_end(request.tail + request.gen_length)  # early_exit off: the whole response
    return finish(request, FINISH_LENGTH if end is None else FINISH_STOP, response, end)
