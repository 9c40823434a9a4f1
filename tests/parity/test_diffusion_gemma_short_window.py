"""DiffusionGemma's cache when the sliding window is shorter than the prompt and than a canvas, against
the official code (transformers 5.23.0) in `tests/data/diffusion_gemma_short_window/` (its README says
how it was made): a sliding layer's ring must hold exactly the positions the official `DynamicCache`
retains (the last `sliding_window - 1`), after the padded prompt prefill and after a commit pass that
writes more positions than the ring holds, and the next canvas's logits must be the official ones.
A seeded request to the engine on a batch-of-one golden run of that checkpoint (a prompt longer than
the window, canvases longer than the ring) gives the official `generate()`'s tokens. Every size, id
and setting comes from the fixture files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine import load_model
from engine.decoding.params import DecodeParams
from engine.engine import Engine
from engine.models.diffusion_gemma import DiffusionGemmaModel
from engine.models.gemma4_cache import Gemma4Cache

DATA = Path(__file__).resolve().parents[1] / "data" / "diffusion_gemma_short_window"
STATE_ATOL = 1e-5  # keys and values (the shared fixture README's section 3.1)
LOGITS_ATOL = 5e-4  # decoder logits (the same section)
GOLDEN = sorted((DATA / "golden").glob("*.json"))


@pytest.fixture(scope="module")
def model() -> DiffusionGemmaModel:
    loaded = load_model(DATA / "dg_tiny")
    assert isinstance(loaded, DiffusionGemmaModel)
    return loaded


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return load_file(DATA / "dg_forward.safetensors")


@pytest.fixture(scope="module")
def info() -> dict[str, Any]:
    with safe_open(DATA / "dg_forward.safetensors", "pt") as f:
        return json.loads(f.metadata()["info"])


def test_the_window_is_shorter_than_the_prompt_and_the_canvas(model, ref, info) -> None:
    """What makes this set different from the shared one: the ring is overrun by the prompt and by
    every canvas, so a test or a cache that reads a position off the ring after it was overwritten fails."""
    window = json.loads((DATA / "dg_tiny" / "config.json").read_text())["text_config"]["sliding_window"]
    sliding = [i for i, is_sliding in enumerate(info["cache_after_prefill"]["is_sliding"]) if is_sliding]
    assert model.gemma.retained == window - 1 == max(info["cache_after_enc2"]["retained"][i] for i in sliding)
    assert window - 1 < ref["enc2_input_ids"].shape[1] == model.canvas_length
    assert window < int(ref["enc_attention_mask"].sum(dim=1).min())


def _ring_in_position_order(cache: Gemma4Cache, layer: int, store: list[torch.Tensor]) -> torch.Tensor:
    """A sliding layer's ring [B, kv_heads, held, head_dim], oldest position first (the official cache's order)."""
    ring = cache.ring_positions(cache.length)
    held = int((ring[0] >= 0).sum())
    assert bool(((ring >= 0).sum(dim=1) == held).all())
    order = ring.argsort(dim=1)[:, -held:]
    rows = store[layer][:cache.slots]
    return rows.gather(2, order[:, None, :, None].expand(-1, rows.shape[1], -1, rows.shape[3]))


def _assert_holds(cache: Gemma4Cache, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """The layer holds `keys`/`values` [B, kv_heads, held, head_dim], the official cache's last positions.
    Left pads are not compared (their keys are never attended to; README of the shared set, section 3)."""
    if cache.sliding[layer]:
        ours_k, ours_v = (_ring_in_position_order(cache, layer, s) for s in (cache.keys, cache.values))
    else:
        held = int(cache.length[0])
        ours_k, ours_v = cache.keys[layer][:, :, :held], cache.values[layer][:, :, :held]
    assert ours_k.shape == keys.shape, f"layer {layer}: {ours_k.shape[2]} positions held, officially {keys.shape[2]}"
    real = cache.attendable[:, int(cache.length[0]) - keys.shape[2]:int(cache.length[0])]
    for ours, official in ((ours_k, keys), (ours_v, values)):
        torch.testing.assert_close(ours.transpose(1, 2)[real], official.transpose(1, 2)[real], atol=STATE_ATOL, rtol=0)


def test_the_cache_holds_the_official_positions_after_the_prefill_and_a_commit_pass(model, ref, info) -> None:
    width = ref["dec2_attention_mask_2d"].shape[1]
    cache = model.new_cache(ref["enc_input_ids"].shape[0], width)
    model.encode(ref["enc_input_ids"], cache, attention_mask=ref["enc_attention_mask"])
    for layer, retained in enumerate(info["cache_after_prefill"]["retained"]):
        _assert_holds(cache, layer, ref[f"enc_k_{layer}"][:, :, -retained:], ref[f"enc_v_{layer}"][:, :, -retained:])
    model.decode(ref["dec_canvas_A"], cache)  # a decoder pass in between leaves nothing behind
    model.encode(ref["enc2_input_ids"], cache)
    assert cache.length.tolist() == [info["cache_after_enc2"]["seq_length"][0]] * cache.slots
    for layer in range(len(model.layers)):
        _assert_holds(cache, layer, ref[f"cache2_k_{layer}"], ref[f"cache2_v_{layer}"])
    logits = model.decode(ref["dec2_canvas_C"], cache)
    torch.testing.assert_close(logits, ref["dec2_logits_C_sc_off"], atol=LOGITS_ATOL, rtol=0)


def _batch_of_one(path: Path) -> bool:
    return json.loads(path.read_text())["settings"]["batch_size"] == 1


@pytest.mark.parametrize("path", [p for p in GOLDEN if _batch_of_one(p)], ids=lambda p: p.stem)
def test_a_seeded_request_gives_the_official_tokens(model, path: Path) -> None:
    run = json.loads(path.read_text())
    g = run["effective_generation_config"]
    adaptive = g["stability_threshold"] is not None and g["confidence_threshold"] is not None
    params = DecodeParams(gen_length=g["max_new_tokens"], max_denoising_steps=g["max_denoising_steps"],
                          entropy_bound=float(g["sampler_config"]["entropy_bound"]), t_min=g["t_min"], t_max=g["t_max"],
                          stability_threshold=g["stability_threshold"], confidence_threshold=g["confidence_threshold"],
                          adaptive_stop=adaptive, seed=run["settings"]["torch_manual_seed"])
    [result] = Engine.from_model(model, max_batch=1).generate([run["prompt_ids"][0]], params)
    generated = run["output"]["generated"][0]
    end = set(g["eos_token_id"])
    cut = next((i + 1 for i, token in enumerate(generated) if token in end), len(generated))
    assert result.generated_ids == generated[:cut]
    assert result.stats.steps_per_block == [c["n_steps"] for c in run["canvases"]]
