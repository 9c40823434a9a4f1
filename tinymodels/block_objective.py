"""The block-diffusion objective (SDAR, BD3-LM) for the built-in SDAR-format model.

An example is one row [prompt | response | end fill], not left-padded: blocks count from the row's
first token, exactly as the engine counts them at inference, so the prompt's tail shares a block
with the start of the response. The fill runs to the end of the block that holds the first end
token plus one whole block of end tokens, so the model learns to close a response and that the
block after it is all end tokens; rows of a micro-batch are right-padded with more end tokens
(block-causal attention: nothing later changes an earlier token's output).

One forward per micro-batch over [noisy copy | clean copy], both at positions 0..L-1, under one
boolean mask: a noisy token of block b sees the noisy tokens of block b and the clean tokens of
blocks < b; a clean token sees the clean tokens of blocks <= b (so the clean half is the cached
context of the decoder). The noisy copy starts at the first block any row can mask: blocks made of
prompt only in every row carry no loss.

The mask ratio t ~ U(eps, 1) is drawn per block, not per example: at inference every block is
denoised on its own from all-masked, so each block of every example is a training problem at its
own noise level (one ratio per example would give all the blocks of a sequence the same level).
Only response and fill positions can be masked (prompt tokens in a noisy block stay clean); the
loss is the 1/t-weighted cross-entropy on the masked noisy positions, normalised by a fixed length
so that micro-batches of different lengths weigh their tokens the same.

LLaDA2.1's token-to-token (editing) objective, an option (`edit_noise` > 0): each response position
of a noisy block left visible is replaced by a random ordinary token with probability `edit_noise`,
and the cross-entropy on every visible response position of the noisy blocks (weight 1: restore
the replaced ones, keep the rest) is added to the masked positions' loss, over the same
normaliser. The decoder's editing rule (`block-edit`) rewrites a visible token of the current
block when the model predicts another token there with high confidence; trained only on masked
positions, a model's outputs at visible positions would be untrained. Like LLaDA2.1's released
recipe, the corruptions are random tokens, not the model's own drafts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.block_transformer import BlockDiffusionTransformer

MIN_MASK_RATIO = 1e-3  # t is never 0, so 1/t stays finite


def encode_rows(prompts: list[list[int]], responses: list[list[int]], block_size: int, end_id: int,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, L] (rows right-padded with end tokens, L a multiple of `block_size`) and the maskable
    positions [B, L] (True after the prompt)."""
    lengths = []
    for prompt, response in zip(prompts, responses, strict=True):
        closed = -(-(len(prompt) + len(response) + 1) // block_size) * block_size  # to the end token's block end
        lengths.append(closed + block_size)  # and one whole block of end tokens
    width = max(lengths)
    ids = torch.full((len(prompts), width), end_id, dtype=torch.long)
    maskable = torch.ones_like(ids, dtype=torch.bool)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        row = prompt + response
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        maskable[i, :len(prompt)] = False
    return ids, maskable


def noisy_clean_mask(noisy_positions: torch.Tensor, clean_positions: torch.Tensor,
                     block_size: int) -> torch.Tensor:
    """[1, 1, N + C, N + C] bool (True = may attend) over the sequence [noisy | clean] (see the module
    docstring)."""
    positions = torch.cat([noisy_positions, clean_positions])
    noisy = torch.cat([torch.ones_like(noisy_positions, dtype=torch.bool),
                       torch.zeros_like(clean_positions, dtype=torch.bool)])
    block = torch.div(positions, block_size, rounding_mode="floor")
    query_block, key_block = block[:, None], block[None, :]
    query_noisy, key_noisy = noisy[:, None], noisy[None, :]
    same_block_noisy = query_noisy & key_noisy & (key_block == query_block)
    earlier_clean = query_noisy & ~key_noisy & (key_block < query_block)
    clean_context = ~query_noisy & ~key_noisy & (key_block <= query_block)
    return (same_block_noisy | earlier_clean | clean_context)[None, None]


def block_diffusion_loss(model: BlockDiffusionTransformer, ids: torch.Tensor, maskable: torch.Tensor,
                         block_size: int, generator: torch.Generator, normaliser: int,
                         edit_noise: float = 0.0, edit_vocab: int = 0) -> torch.Tensor:
    """Mean over the rows of the 1/t-weighted masked cross-entropy (t per block), divided by
    `normaliser`; with `edit_noise` > 0 plus the editing objective's visible-position cross-entropy
    (see the module docstring), random tokens drawn from ids [0, `edit_vocab`). Randomness comes
    from the CPU `generator` whatever device the model is on."""
    batch, width = ids.shape
    blocks = width // block_size
    if width % block_size:
        raise ValueError(f"row length {width} is not a multiple of the block size {block_size}")
    t_block = MIN_MASK_RATIO + (1 - MIN_MASK_RATIO) * torch.rand(batch, blocks, generator=generator)
    t = t_block.repeat_interleave(block_size, dim=1)  # [B, L]
    masked = maskable.cpu() & (torch.rand(ids.shape, generator=generator) < t)
    first = int(maskable.any(dim=0).nonzero()[0]) // block_size * block_size  # first block with a maskable position
    device = ids.device
    visible = (maskable.cpu() & ~masked)[:, first:]
    noisy = ids[:, first:].cpu().masked_fill(masked[:, first:], model.special.mask_id)
    if edit_noise > 0:
        if edit_vocab < 1:
            raise ValueError("the editing objective needs edit_vocab, the ids random tokens are drawn from")
        replaced = visible & (torch.rand(visible.shape, generator=generator) < edit_noise)
        noisy = torch.where(replaced, torch.randint(0, edit_vocab, visible.shape, generator=generator), noisy)
    masked, t, noisy = masked[:, first:].to(device), t[:, first:].to(device), noisy.to(device)
    noisy_positions = torch.arange(first, width, device=device)
    clean_positions = torch.arange(width, device=device)
    attention = noisy_clean_mask(noisy_positions, clean_positions, block_size)
    logits = model(torch.cat([noisy, ids], dim=1), torch.cat([noisy_positions, clean_positions])[None],
                   block_size=block_size, attention_mask=attention, logits_at=width - first)
    token_loss = F.cross_entropy(logits.float().transpose(1, 2), ids[:, first:], reduction="none")
    weight = masked / t
    if edit_noise > 0:
        weight = weight + visible.to(device)
    return ((token_loss * weight).sum(dim=1) / normaliser).mean()
