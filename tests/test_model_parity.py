"""Our LLaDA and Dream forward passes against the official code's outputs (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine import load_model
from engine.models.transformer import positions_from_attention_mask

ATOL = 1e-4


def _max_diff_on_real(ours: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    real = mask.bool()
    return (ours[real] - ref[real]).abs().max().item()


@pytest.mark.parametrize("name", ["llada", "dream"])
def test_logits_and_hidden_states_match_official(name, fixtures, llada_model, dream_model):
    model = llada_model if name == "llada" else dream_model
    data = load_file(fixtures / f"{name}_forward.safetensors")
    hidden: list[torch.Tensor] = []
    with torch.no_grad():
        logits = model(data["input_ids"], hidden_states_out=hidden)
    assert logits.shape == data["logits"].shape
    torch.testing.assert_close(logits, data["logits"], atol=ATOL, rtol=0)
    assert len(hidden) == data["hidden_states"].shape[0]
    for ours, ref in zip(hidden, data["hidden_states"], strict=True):
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_llada_padded_matches_mask_honouring_variant(fixtures, llada_model):
    data = load_file(fixtures / "llada_forward_padmask_variant.safetensors")
    mask = data["attention_mask_padded"]
    assert (mask == 0).any(), "the fixture must contain padding"
    with torch.no_grad():
        logits = llada_model(data["input_ids_padded"], attention_mask=mask)
    assert _max_diff_on_real(logits, data["logits_padded"], mask) < ATOL


def test_dream_padded_matches_official(fixtures, dream_model):
    data = load_file(fixtures / "dream_forward.safetensors")
    mask = data["attention_mask_padded"]
    # Our default positions from the mask are exactly the official generation code's tok_idx.
    assert torch.equal(positions_from_attention_mask(mask), data["position_ids_padded"])
    with torch.no_grad():
        logits = dream_model(data["input_ids_padded"], attention_mask=mask)
    assert _max_diff_on_real(logits, data["logits_padded"], mask) < ATOL
    # ... and the unmasked call differs there, so the check above has teeth.
    assert _max_diff_on_real(data["logits_padded_without_mask"], data["logits_padded"], mask) > 1e-2


@pytest.mark.parametrize("name", ["llada", "dream"])
def test_left_padding_gives_each_real_token_its_unpadded_logits(name, llada_model, dream_model):
    model = llada_model if name == "llada" else dream_model
    pad = model.special.pad_id
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 200, (n,), generator=gen) for n in (12, 7, 3)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask)
        for i, row in enumerate(rows):
            alone = model(row[None])[0]
            torch.testing.assert_close(batched[i, width - len(row):], alone, atol=ATOL, rtol=0)


def test_dream_exposes_shift_llada_does_not(llada_model, dream_model):
    assert dream_model.logits_shifted and not llada_model.logits_shifted


def test_dream_uses_grouped_kv_heads(dream_model):
    assert dream_model.config.num_kv_heads < dream_model.config.num_heads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_loads_and_tracks_float32(fixtures, dtype):
    data = load_file(fixtures / "llada_forward.safetensors")
    model = load_model(fixtures / "llada_tiny", dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    with torch.no_grad():
        logits = model(data["input_ids"]).float()
    # Low precision rounds; the argmax of most positions must still agree with float32.
    agree = (logits.argmax(-1) == data["logits"].argmax(-1)).float().mean().item()
    assert agree > 0.8
    assert (logits - data["logits"]).abs().mean().item() < 0.5


def test_dtype_accepts_names(fixtures):
    assert load_model(fixtures / "dream_tiny", dtype="bf16").dtype == torch.bfloat16
