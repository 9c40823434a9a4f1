"""Our LLaDA and Dream forward passes against the official code's outputs (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine import load_model
from engine.models.kv_cache import CacheWrite, KVStore
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
    rows = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in (12, 7, 3)]
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


@pytest.mark.parametrize("name", ["llada", "dream"])
def test_logits_at_some_positions_are_the_full_forwards_and_write_the_same_cache(name, llada_model, dream_model):
    """`logits_at` makes the last layer compute the wanted positions alone (past its keys and
    values): the logits there, and every layer's keys and values written to a cache, are the full
    forward's, with a padding mask, as [B, K] indices and as the first K positions."""
    model = llada_model if name == "llada" else dream_model
    config = model.config
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (3, 20), generator=gen)
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 15:] = 0
    at = torch.tensor([[3, 4, 5, 19], [0, 7, 14, 2], [18, 17, 1, 0]])

    def store() -> KVStore:
        return KVStore.empty(config.num_layers, 3, config.num_kv_heads, 20, config.head_dim, model.dtype,
                             model.device)

    def forward(logits_at, cache_store):
        write = CacheWrite(cache_store, torch.arange(20).expand(3, 20), attend_to_cache=False)
        with torch.no_grad():
            return model(ids, attention_mask=mask, cache=write, logits_at=logits_at)

    full_store, some_store, first_store = store(), store(), store()
    full = forward(None, full_store)
    some = forward(at, some_store)
    first = forward(6, first_store)
    assert some.shape == (3, 4, config.vocab_size) and first.shape == (3, 6, config.vocab_size)
    torch.testing.assert_close(some, full.gather(1, at[..., None].expand(-1, -1, full.shape[-1])), atol=1e-5, rtol=0)
    torch.testing.assert_close(first, full[:, :6], atol=1e-5, rtol=0)
    for cached in (some_store, first_store):
        for ours, ref in zip(cached.keys + cached.values, full_store.keys + full_store.values, strict=True):
            assert torch.equal(ours, ref)
