"""How a row advances from its step's host summary (the scheduler's postprocess): its block's
tokens and telemetry, when the block ends, and when the row ends.

A block ends when no mask is left, except for `block-edit` (LLaDA2.1's decoder), whose block ends
as the official `generate()` loop does: a forward that started with no mask and edited nothing
ends it; once the last mask is filled, each further forward is a post step, and the block ends
before the forward that would be post step `max_post_steps + 1`. Edits may mask tokens again, so
the engine bounds a block at `max_steps_per_block` forwards, the last of which fills the block.

A masked-diffusion row (LLaDA, Dream) ends at the step that leaves an end token with no mask
before it (early exit), or after its last block. A block-diffusion row ends at an end token in a
finished block (LLaDA2.0's check after every block, SDAR's, and LLaDA2.1's `eos_early_stop`), or
with `eos_early_stop` for the other policies inside its block, at a step that commits an end token
with no mask before the first one (LLaDA2.0's in-loop check).
"""

from __future__ import annotations

from typing import Optional

from engine.decoding.types import FINISH_LENGTH, FINISH_STOP, GenerationResult
from engine.request import Request, finish
from engine.summary import RowSummary


def advance(request: Request, info: RowSummary, storing: bool) -> Optional[GenerationResult]:
    """Advance a row by its step: a denoising step updates its block and moves to the next block
    once the block ends. A block-diffusion row's clean prefix is cached after any of its forwards
    (with the exact cache); SDAR's store pass, when on, finishes a block: the end check follows it,
    as in SDAR's decoders. The row's result when the step ends it."""
    stats = request.stats
    stats.nfe += 1
    if request.block_causal and request.params.cache != "none":
        request.cached = request.block_start  # the forward wrote every clean token before the block
    if storing:
        stats.tokens_per_step.append(0)
        return _finished_block(request)
    offset = request.block_start - request.origin
    width = request.block_length
    request.generated[offset:offset + width] = info.tokens[:width]
    stats.tokens_per_step.append(info.committed)
    stats.forced_commits += info.forced
    stats.grinding_exits += info.grinding_exit
    stats.token_edits += info.edited
    if request.step == 0:
        bands = stats.first_step_confidence_bands
        bands[0] += info.band_high
        bands[1] += request.masked_now - info.band_high - info.band_low
        bands[2] += info.band_low
    masked_before = request.masked_now
    request.masked_now = info.still_masked
    if _stops_inside_block(request, info):
        stats.steps_per_block.append(request.step + 1)
        return _stop_at(request, offset + info.end_pos - request.tail)
    if not _block_ends(request, info, masked_before):
        request.step += 1
        return None
    stats.steps_per_block.append(request.step + 1)
    request.block += 1
    request.step = 0
    request.post_steps = 0
    request.masked_now = request.masked_at_block_start = width
    return None if request.params.store_pass else _finished_block(request)


def _stops_inside_block(request: Request, info: RowSummary) -> bool:
    """An end token with no mask before it in the block (the blocks before this one are finished and
    hold none): early exit (masked diffusion), or LLaDA2.0's eos_early_stop, at a step that committed one."""
    if info.end_pos >= info.first_masked:
        return False
    if not request.block_causal:
        return request.params.stops_at_end
    return request.params.eos_early_stop and not request.edits and info.end_committed > 0


def _block_ends(request: Request, info: RowSummary, masked_before: int) -> bool:
    """Whether the row's block ends with this step (`masked_before`: its masks when the step began)."""
    if not request.edits:
        return info.still_masked == 0
    p = request.params
    if masked_before == 0 and info.edited == 0:
        return True
    if request.at_step_limit:  # this step filled the block
        return True
    if info.still_masked:
        return False
    request.post_steps += 1  # the next forward would start with no mask: a post step
    return request.post_steps > p.max_post_steps


def _stop_at(request: Request, end: int) -> GenerationResult:
    """The result of a row stopped at its response index `end` (an end token, nothing masked before)."""
    response = request.generated[request.tail:request.tail + request.gen_length]
    if end < request.gen_length:
        return finish(request, FINISH_STOP, response[:end + 1], end)
    return finish(request, FINISH_LENGTH, response, None)  # the end token lies past gen_length


def _finished_block(request: Request) -> Optional[GenerationResult]:
    """The result when the blocks before the current one end the row, else None."""
    done = request.block_start - request.origin
    end = request.first_end(done) if request.params.stops_at_end else None
    if end is None and request.block < request.num_blocks:
        return None
    response = request.generated[request.tail:request.tail + request.gen_length]
    if end is not None and end < request.gen_length:
        return finish(request, FINISH_STOP, response[:end + 1], end)
    end = request.first_end(request.tail + request.gen_length)  # early_exit off: the whole response
    return finish(request, FINISH_LENGTH if end is None else FINISH_STOP, response, end)
