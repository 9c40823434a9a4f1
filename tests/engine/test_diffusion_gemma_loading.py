"""DiffusionGemma's checkpoint handling around the parity fixture: the loader's name/shape checks,
the config fields it refuses, both config spellings of the full layers' shapes, `inspect`, and the
cache's growth and slot reuse (the engine's uniform-noise mode serving it: tests/engine/test_uniform_engine.py)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import CheckpointError, load_model
from engine.inspect import describe_checkpoint
from engine.loading.safetensors_stream import read_header
from engine.models.diffusion_gemma import DiffusionGemmaModel

VISION = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


@pytest.fixture(scope="module")
def source(fixtures) -> Path:
    return fixtures / "diffusion_gemma" / "dg_tiny"


@pytest.fixture
def copy(source, tmp_path) -> Path:
    dest = tmp_path / "dg"
    shutil.copytree(source, dest)
    return dest


def _edit_config(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def _edit_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors")


def test_inspect_counts_what_the_file_holds(source) -> None:
    report = describe_checkpoint(source)
    header = read_header(source / "model.safetensors")
    text = [e for name, e in header.items() if not name.startswith(VISION)]
    encoder_scalars = [name for name in header if ".encoder.language_model." in name]
    # the encoder's scalars are its only tensors of its own: the rest is shared with the decoder
    assert report["parameters"] == sum(torch.Size(e.shape).numel() for e in text)
    assert report["weights"] == {"files": 1, "bytes": (source / "model.safetensors").stat().st_size, "status": "ok",
                                 "not_loaded": len(header) - len(text)}
    assert report["architecture"] == "DiffusionGemma" and encoder_scalars
    config = json.loads((source / "config.json").read_text())
    assert report["canvas_length"] == config["canvas_length"]
    assert report["special_ids"]["mask"] is None


def _layer_of_kind(path: Path, kind: str) -> int:
    types = json.loads((path / "config.json").read_text())["text_config"]["layer_types"]
    return types.index(kind)


@pytest.mark.parametrize(("edit", "named"), [
    (lambda w, s, f: w.pop(f"model.decoder.layers.{s}.self_attn.v_proj.weight"), "missing from the checkpoint"),
    (lambda w, s, f: w.pop(f"model.encoder.language_model.layers.{f}.layer_scalar"), "missing from the checkpoint"),
    (lambda w, s, f: w.update({f"model.decoder.layers.{f}.self_attn.v_proj.weight": torch.zeros(1)}), "not part of"),
    (lambda w, s, f: w.update({"model.decoder.norm.weight": torch.zeros(3)}), "model.decoder.norm.weight has shape"),
], ids=["sliding-v_proj-missing", "encoder-scalar-missing", "full-layer-v_proj", "bad-shape"])
def test_loader_names_the_bad_tensor(copy, edit, named) -> None:
    sliding, full = _layer_of_kind(copy, "sliding_attention"), _layer_of_kind(copy, "full_attention")
    _edit_weights(copy, lambda weights: edit(weights, sliding, full))
    with pytest.raises(CheckpointError, match=named):
        load_model(copy)


@pytest.mark.parametrize(("edit", "field"), [
    (lambda c: c["text_config"].update(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (lambda c: c["text_config"].update(hidden_activation="silu"), "hidden_activation"),
    (lambda c: c.update(tie_word_embeddings=False), "tie_word_embeddings"),
    (lambda c: c["text_config"].pop("num_experts"), "num_experts"),
    (lambda c: c["text_config"]["per_layer_config"].update(
        {str(c["text_config"]["layer_types"].index("sliding_attention")): {"head_dim": 8}}), "per_layer_config"),
    (lambda c: c["text_config"]["rope_parameters"]["full_attention"].update(rope_type="yarn"), "rope_type"),
    (lambda c: c.pop("text_config"), "text_config"),
])
def test_config_refusals_name_the_field(copy, edit, field) -> None:
    _edit_config(copy, edit)
    with pytest.raises(CheckpointError, match=field):
        load_model(copy)


def test_constructor_key_spelling_of_the_full_layers(copy, source) -> None:
    """Files written before transformers saved `per_layer_config` carry `global_head_dim` and
    `num_global_key_value_heads`: the same model."""
    def respell(config: dict[str, Any]) -> None:
        text = config["text_config"]
        [override] = {json.dumps(v, sort_keys=True) for v in text.pop("per_layer_config").values()}
        shape = json.loads(override)
        text.update(global_head_dim=shape["head_dim"], num_global_key_value_heads=shape["num_key_value_heads"])

    _edit_config(copy, respell)
    assert DiffusionGemmaModel.parse_config(json.loads((copy / "config.json").read_text())) == \
        DiffusionGemmaModel.parse_config(json.loads((source / "config.json").read_text()))


def test_cache_growth_and_slot_reuse(source) -> None:
    model = load_model(source)
    assert isinstance(model, DiffusionGemmaModel)
    prompt = torch.arange(3, 3 + model.gemma.retained + 4)[None]  # longer than a sliding ring
    small = model.new_cache(2, prompt.shape[1])
    model.encode(prompt, small, rows=torch.tensor([1]))
    small.reserve(prompt.shape[1] + model.canvas_length)
    big = model.new_cache(2, prompt.shape[1] + model.canvas_length)
    # the columns the small cache had: attention over more (masked) columns rounds otherwise
    model.encode(prompt, big, rows=torch.tensor([1]), width=prompt.shape[1])
    canvas = torch.arange(5, 5 + model.canvas_length)[None]
    rows = torch.tensor([1])
    torch.testing.assert_close(model.decode(canvas, small, rows=rows), model.decode(canvas, big, rows=rows),
                               atol=0, rtol=0)
    big.admit(1)  # a new request in slot 1 sees nothing of the old one
    fresh = model.new_cache(2, big.width)
    model.encode(prompt[:, :5], big, rows=rows)
    model.encode(prompt[:, :5], fresh, rows=rows)
    torch.testing.assert_close(model.decode(canvas, big, rows=rows), model.decode(canvas, fresh, rows=rows),
                               atol=1e-5, rtol=0)


def test_chunked_prefill_is_exact(source) -> None:
    """A prompt longer than the sliding ring, encoded in one call or in chunks, gives the same cache."""
    model = load_model(source)
    assert isinstance(model, DiffusionGemmaModel)
    prompt = torch.arange(3, 3 + 2 * model.gemma.retained + 3)[None]
    whole, chunked = (model.new_cache(1, prompt.shape[1] + model.canvas_length) for _ in range(2))
    model.encode(prompt, whole)
    for chunk in prompt.split(model.gemma.retained // 2 + 1, dim=1):
        model.encode(chunk, chunked)
    canvas = torch.arange(5, 5 + model.canvas_length)[None]
    # the same math over other key widths: rounding only
    torch.testing.assert_close(model.decode(canvas, chunked), model.decode(canvas, whole), atol=1e-4, rtol=0)
