"""Our DiffusionGemma forwards against the official code's (transformers 5.23.0, float32, CPU), from
`diffusion_gemma/dg_forward.safetensors`: the encoder prefill (hidden states, keys, values), the
self-conditioning module, the decoder with self-conditioning off and on, the commit pass and the
next canvas, and the attention masks each pass used. Pad positions are not compared (the official
pads get a zero attention output, ours attend everywhere: neither is ever read). Every size and id
comes from the fixture files, so another fixture set of the same layout runs unchanged. Where CUDA
is present every test also runs there (float32, same bounds), and bfloat16 is checked against the
float32 reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine import load_model
from engine.loading.safetensors_stream import read_header
from engine.loading.weights import plan_weights
from engine.models.diffusion_gemma import DiffusionGemmaModel
from engine.models.gemma4_cache import CachePass, Gemma4Cache
from engine.models.moe import MOE_KERNELS

LOGITS_ATOL = 5e-4  # the bound: the official float32 decoder is itself ~1e-4 from float64 math
BATCHING_ATOL = 1e-4  # the same math over other key widths and masks (another SDPA kernel): rounding only
STATE_ATOL = 1e-5  # hidden states, keys, values, self-conditioning tensors
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs CUDA"))]


def _close(ours: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    torch.testing.assert_close(ours, ref.to(ours.device, ours.dtype), atol=atol, rtol=0)


@pytest.fixture(scope="module")
def dg_dir(fixtures) -> Path:
    return fixtures / "diffusion_gemma"


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(scope="module")
def model(dg_dir, device) -> DiffusionGemmaModel:
    loaded = load_model(dg_dir / "dg_tiny", device=device)
    assert isinstance(loaded, DiffusionGemmaModel)
    return loaded


@pytest.fixture(scope="module")
def ref(dg_dir, device) -> dict[str, torch.Tensor]:
    return {name: t.to(device) for name, t in load_file(dg_dir / "dg_forward.safetensors").items()}


@pytest.fixture(scope="module")
def info(dg_dir) -> dict:
    with safe_open(dg_dir / "dg_forward.safetensors", "pt") as f:
        return json.loads(f.metadata()["info"])


def _prefilled(model: DiffusionGemmaModel, ref: dict[str, torch.Tensor], slots: int = 0,
               hidden: list[torch.Tensor] | None = None) -> Gemma4Cache:
    """A cache wide enough for the whole fixture, after the padded prompt prefill."""
    width = ref["dec2_attention_mask_2d"].shape[1]
    cache = model.new_cache(max(slots, ref["enc_input_ids"].shape[0]), width)
    model.encode(ref["enc_input_ids"], cache, attention_mask=ref["enc_attention_mask"], hidden_states_out=hidden)
    return cache


def _cached(cache: Gemma4Cache, layer: int, positions: torch.Tensor, store: list[torch.Tensor]) -> torch.Tensor:
    """[B, kv_heads, len(positions), head_dim] as the official cache lays them out."""
    columns = torch.remainder(positions, cache.retained) if cache.sliding[layer] else positions
    return store[layer][:len(cache.length), :, columns.to(store[layer].device)]


def _real(mask_2d: torch.Tensor) -> torch.Tensor:
    return mask_2d.bool()


def test_checkpoint_is_fully_mapped(model, dg_dir) -> None:
    """Every tensor of the checkpoint is loaded or recognised (the vision tower); the encoder and the
    decoder share the weights, not their layer scalars."""
    files = sorted((dg_dir / "dg_tiny").glob("*.safetensors"))
    names = {name for f in files for name in read_header(f)}
    planned = {p.entry.name for placements in plan_weights(model, files).values() for p in placements}
    skipped = names - planned
    vision = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
    assert skipped and all(n.startswith(vision) for n in skipped)
    weights = load_file(files[0])
    for i, layer in enumerate(model.layers):
        _close(layer.encoder_scalar, weights[f"model.encoder.language_model.layers.{i}.layer_scalar"], 0)
        _close(layer.decoder_scalar, weights[f"model.decoder.layers.{i}.layer_scalar"], 0)
    assert model.lm_head.weight is model.embed.weight
    assert model.special is not None and model.special.mask_id is None


def test_config_from_the_fixture(model, dg_dir, info) -> None:
    config = json.loads((dg_dir / "dg_tiny" / "config.json").read_text())
    text = config["text_config"]
    gemma = model.gemma
    assert list(gemma.layer_types) == info["layer_types"] == text["layer_types"]
    assert gemma.canvas_length == config["canvas_length"]
    assert gemma.retained == text["sliding_window"] - 1 == info["cache_after_prefill"]["retained"][0]
    overrides = text.get("per_layer_config") or {
        str(i): {"head_dim": text["global_head_dim"], "num_key_value_heads": text["num_global_key_value_heads"]}
        for i, kind in enumerate(text["layer_types"]) if kind == "full_attention"}
    for layer, override in overrides.items():
        kind = gemma.attention(int(layer))
        assert (kind.head_dim, kind.num_kv_heads) == (override["head_dim"], override["num_key_value_heads"])
    assert gemma.sliding.head_dim == text["head_dim"] and gemma.sliding.num_kv_heads == text["num_key_value_heads"]
    generation = json.loads((dg_dir / "dg_tiny" / "generation_config.json").read_text())
    assert model.special.eos_ids == tuple(generation["eos_token_id"])
    assert model.special.pad_id == generation["pad_token_id"]


def test_encoder_prefill(model, ref, info) -> None:
    hidden: list[torch.Tensor] = []
    cache = _prefilled(model, ref, hidden=hidden)
    real = _real(ref["enc_attention_mask"])
    _close(torch.stack(hidden)[:, real], ref["enc_hidden_states"][:, real], STATE_ATOL)
    _close(hidden[-1][real], ref["enc_last_hidden_state"][real], STATE_ATOL)
    prompt_len = ref["enc_input_ids"].shape[1]
    assert cache.length.tolist() == [prompt_len] * cache.slots
    for layer, retained in enumerate(info["cache_after_prefill"]["retained"]):
        positions = torch.arange(prompt_len - retained, prompt_len, device=real.device)
        kept = real[:, positions]
        for store, name in ((cache.keys, "enc_k"), (cache.values, "enc_v")):
            ours = _cached(cache, layer, positions, store).transpose(1, 2)[kept]
            _close(ours, ref[f"{name}_{layer}"][:, :, positions].transpose(1, 2)[kept], STATE_ATOL)


def test_self_conditioning_module(model, ref) -> None:
    _close(model.embed_tokens(ref["dec_canvas_A"]), ref["sc_inputs_embeds"], 0)
    assert model.embed_scale().item() == ref["embed_scale"].item()
    _close(model.soft_embeddings(ref["sc_logits"]), ref["sc_soft_embeddings"], STATE_ATOL)
    _close(model.self_conditioning(ref["sc_inputs_embeds"], ref["sc_soft_embeddings"]), ref["sc_out"], STATE_ATOL)
    zero = torch.zeros_like(ref["sc_soft_embeddings"])
    _close(model.self_conditioning(ref["sc_inputs_embeds"], zero), ref["sc_out_zero"], STATE_ATOL)
    _close(model.self_conditioning(ref["sc_inputs_embeds"], None), ref["sc_out_zero"], STATE_ATOL)


@pytest.mark.parametrize("kernel", MOE_KERNELS)
def test_decoder_logits(model, ref, kernel) -> None:
    if kernel == "grouped_mm" and model.device.type == "cuda":
        pytest.skip("CUDA's grouped_mm takes bfloat16 only (PyTorch's documentation): test_bfloat16_on_cuda runs it")
    model.set_moe_kernel(kernel)
    try:
        cache = _prefilled(model, ref)
        lengths = cache.length.clone()
        hidden: list[torch.Tensor] = []
        _close(model.decode(ref["dec_canvas_A"], cache, hidden_states_out=hidden), ref["dec_logits_A_sc_off"],
               LOGITS_ATOL)
        _close(torch.stack(hidden), ref["dec_hidden_states_A_sc_off"], STATE_ATOL * 10)
        soft = model.soft_embeddings(ref["sc_logits"])
        _close(model.decode(ref["dec_canvas_A"], cache, self_conditioning=soft), ref["dec_logits_A_sc_on"],
               LOGITS_ATOL)
        _close(model.decode(ref["dec_canvas_B"], cache, self_conditioning=soft), ref["dec_logits_B_sc_on"],
               LOGITS_ATOL)
        # a zero soft embedding is the first step exactly
        zero = torch.zeros_like(soft)
        _close(model.decode(ref["dec_canvas_A"], cache, self_conditioning=zero), ref["dec_logits_A_sc_off"],
               LOGITS_ATOL)
        assert torch.equal(cache.length, lengths), "the decoder never advances the cache"
    finally:
        model.set_moe_kernel(None)


def test_commit_pass_and_next_canvas(model, ref, info) -> None:
    cache = _prefilled(model, ref)
    model.decode(ref["dec_canvas_A"], cache)  # a decoder pass in between leaves nothing behind
    hidden: list[torch.Tensor] = []
    model.encode(ref["enc2_input_ids"], cache, hidden_states_out=hidden)
    _close(hidden[-1], ref["enc2_last_hidden_state"], STATE_ATOL)
    after = info["cache_after_enc2"]
    assert cache.length.tolist() == [after["seq_length"][0]] * cache.slots
    start, canvas = ref["enc_input_ids"].shape[1], ref["enc2_input_ids"].shape[1]
    positions = torch.arange(start, start + canvas, device=cache.length.device)
    for layer in range(len(model.layers)):
        # a sliding layer holds only the canvas's last `retained` positions when the canvas is longer
        kept = slice(max(0, canvas - after["retained"][layer]), canvas)
        _close(_cached(cache, layer, positions[kept], cache.keys), ref[f"enc2_k_{layer}"][:, :, kept], STATE_ATOL)
        _close(_cached(cache, layer, positions[kept], cache.values), ref[f"enc2_v_{layer}"][:, :, kept], STATE_ATOL)
        held = after["retained"][layer]
        if cache.sliding[layer]:
            assert held == cache.retained
        else:
            assert held == after["seq_length"][layer]
    _close(model.decode(ref["dec2_canvas_C"], cache), ref["dec2_logits_C_sc_off"], LOGITS_ATOL)


def _official_key_order(view: CachePass, mask: torch.Tensor, sliding: bool, keys: int) -> torch.Tensor:
    """Our mask [B, 1, Lq|1, K] over the official key axis: a sliding layer's ring in position order
    (the official cache keeps its retained positions in order), a full layer's first `keys` columns."""
    if not sliding:
        return mask[..., :keys]
    ring = view.cache.ring_positions(view.positions[:, 0])
    filled = int((ring[0] >= 0).sum())
    order = ring.argsort(dim=1)[:, -filled:] if filled else ring[:, :0]
    ring_part = mask[..., :view.cache.retained].gather(-1, order[:, None, None, :].expand(*mask.shape[:3], -1))
    return torch.cat((ring_part, mask[..., view.cache.retained:]), dim=-1)


@pytest.mark.parametrize("stage", ["enc", "dec", "enc2", "dec2"])
def test_attention_masks(model, ref, stage) -> None:
    """Each pass lets each real query see exactly the keys the official masks allow."""
    cache = _prefilled(model, ref) if stage != "enc" else model.new_cache(2, ref["dec2_attention_mask_2d"].shape[1])
    if stage == "dec2":
        model.encode(ref["enc2_input_ids"], cache)
    ids = {"enc": "enc_input_ids", "dec": "dec_canvas_A", "enc2": "enc2_input_ids", "dec2": "dec2_canvas_C"}[stage]
    batch, length = ref[ids].shape
    view = CachePass(cache, batch, length, encoder=stage.startswith("enc"),
                     attendable_new=ref["enc_attention_mask"] if stage == "enc" else None)
    queries = (_real(ref["enc_attention_mask"]) if stage == "enc"
               else torch.ones(batch, length, dtype=torch.bool, device=ref[ids].device))
    for kind, mask in (("full", view.full_mask), ("sliding", view.sliding_mask)):
        official = ref[f"{stage}_mask_{kind}_attention"]
        ours = _official_key_order(view, mask, kind == "sliding", official.shape[-1])
        ours = ours.expand(-1, -1, length, -1)
        assert torch.equal(ours[:, 0][queries], official[:, 0][queries]), f"{stage} {kind} mask"


def test_rows_at_their_own_positions(model, ref) -> None:
    """Slots at different lengths in one call (the engine's batches): each prompt prefilled alone,
    unpadded, into its own slot, then both canvases decoded and committed together, give what each
    row gets alone."""
    mask = _real(ref["enc_attention_mask"])
    prompts = [ref["enc_input_ids"][r, mask[r]][None] for r in range(mask.shape[0])]
    width = ref["dec2_attention_mask_2d"].shape[1]
    slots = torch.tensor([2, 0], device=model.device)  # any slot order
    together = model.new_cache(3, width)
    alone = [model.new_cache(1, width) for _ in prompts]
    for row, prompt in enumerate(prompts):
        model.encode(prompt, together, rows=slots[row:row + 1])
        model.encode(prompt, alone[row])
    assert together.length[slots].tolist() == [p.shape[1] for p in prompts]
    for canvas_name in ("dec_canvas_A", "dec2_canvas_C"):
        canvas = ref[canvas_name]
        batched = model.decode(canvas, together, rows=slots)
        for row in range(len(prompts)):
            _close(batched[row], model.decode(canvas[row:row + 1], alone[row])[0], BATCHING_ATOL)
        model.encode(ref["enc2_input_ids"], together, rows=slots)
        for row in range(len(prompts)):
            model.encode(ref["enc2_input_ids"][row:row + 1], alone[row])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", MOE_KERNELS)
def test_bfloat16_on_cuda(dg_dir, kernel) -> None:
    """bfloat16, the released weights' dtype, through every pass on CUDA with each expert kernel,
    against the float32 reference: finite, and the decoder's argmax mostly the same."""
    ref = {name: t.to("cuda") for name, t in load_file(dg_dir / "dg_forward.safetensors").items()}
    model = load_model(dg_dir / "dg_tiny", device="cuda", dtype="bfloat16")
    assert isinstance(model, DiffusionGemmaModel)
    model.set_moe_kernel(kernel)
    cache = model.new_cache(ref["enc_input_ids"].shape[0], ref["dec2_attention_mask_2d"].shape[1])
    model.encode(ref["enc_input_ids"], cache, attention_mask=ref["enc_attention_mask"])
    soft = model.soft_embeddings(ref["sc_logits"].to(model.dtype))  # the official loop feeds them in that dtype
    outputs = {"dec_logits_A_sc_off": model.decode(ref["dec_canvas_A"], cache),
               "dec_logits_B_sc_on": model.decode(ref["dec_canvas_B"], cache, self_conditioning=soft)}
    model.encode(ref["enc2_input_ids"], cache)
    outputs["dec2_logits_C_sc_off"] = model.decode(ref["dec2_canvas_C"], cache)
    for name, logits in outputs.items():
        official = ref[name]
        assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
        agreement = (logits.argmax(-1) == official.argmax(-1)).float().mean().item()
        print(f"{kernel} {name}: max |bf16 - fp32| {(logits - official).abs().max().item():.3g}, "
              f"mean {(logits - official).abs().mean().item():.3g}, argmax agreement {agreement:.3f}")
        assert agreement >= 0.8, f"{name}: bfloat16 argmax agrees with float32 at {agreement:.3f}"
