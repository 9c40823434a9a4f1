"""Loading from local checkpoint directories: sharded files, tied heads and every error users can hit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import CheckpointError, DeviceError, load_model
from engine.loading.checkpoint import WEIGHTS_INDEX


def _shard(src: Path, dest: Path, parts: int) -> list[str]:
    """Rewrite src/model.safetensors as `parts` shards plus an index in dest."""
    dest.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, dest / name)
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    weight_map, files = {}, []
    for part in range(parts):
        file = f"model-{part + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: tensors[n] for n in names[part::parts]}
        save_file(chunk, dest / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in chunk})
        files.append(file)
    (dest / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


@pytest.mark.parametrize("name", ["llada_tiny", "dream_tiny"])
def test_sharded_checkpoint_loads_identically(name, fixtures, tmp_path):
    _shard(fixtures / name, tmp_path / "sharded", parts=3)
    single = load_model(fixtures / name)
    sharded = load_model(tmp_path / "sharded")
    ids = torch.randint(0, single.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(single(ids), sharded(ids))


def test_missing_shard_file_is_named(fixtures, tmp_path):
    files = _shard(fixtures / "llada_tiny", tmp_path / "sharded", parts=2)
    (tmp_path / "sharded" / files[1]).unlink()
    with pytest.raises(CheckpointError, match=files[1]):
        load_model(tmp_path / "sharded")


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_missing_config(llada_copy):
    (llada_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        load_model(llada_copy)


def test_invalid_config_json(llada_copy):
    (llada_copy / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(llada_copy)


def test_missing_weights_file(llada_copy):
    (llada_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_model(llada_copy)


def test_unknown_architecture(llada_copy):
    config = json.loads((llada_copy / "config.json").read_text())
    config.update(architectures=["MysteryLM"], model_type="mystery")
    (llada_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"unknown architecture.*MysteryLM"):
        load_model(llada_copy)


def test_unsupported_config_value_is_named(llada_copy):
    config = json.loads((llada_copy / "config.json").read_text())
    config["alibi"] = True
    (llada_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="alibi"):
        load_model(llada_copy)


def _rewrite_weights(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_weight_is_named(llada_copy):
    _rewrite_weights(llada_copy, lambda t: t.pop("model.transformer.blocks.1.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*blocks\.1\.up_proj\.weight"):
        load_model(llada_copy)


def test_misshaped_weight_is_named(llada_copy):
    name = "model.transformer.blocks.0.k_proj.weight"
    rows, cols = load_file(llada_copy / "model.safetensors")[name].shape

    def edit(t):
        t[name] = torch.zeros(rows // 2, cols)
    _rewrite_weights(llada_copy, edit)
    with pytest.raises(CheckpointError,
                       match=rf"blocks\.0\.k_proj\.weight has shape \[{rows // 2}, {cols}\].*\[{rows}, {cols}\]"):
        load_model(llada_copy)


def test_unexpected_weight_is_named(llada_copy):
    layers = json.loads((llada_copy / "config.json").read_text())["n_layers"]
    extra = f"model.transformer.blocks.{layers}.q_proj.weight"  # a layer past the last

    def edit(t):
        t[extra] = t["model.transformer.blocks.0.q_proj.weight"].clone()
    _rewrite_weights(llada_copy, edit)
    with pytest.raises(CheckpointError, match=rf"blocks\.{layers}\.q_proj\.weight"):
        load_model(llada_copy)


def test_truncated_weights_file(llada_copy):
    data = (llada_copy / "model.safetensors").read_bytes()
    (llada_copy / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"truncated|byte range"):
        load_model(llada_copy)


def test_tied_head_needs_no_head_weight(llada_copy):
    config = json.loads((llada_copy / "config.json").read_text())
    config["weight_tying"] = True
    (llada_copy / "config.json").write_text(json.dumps(config))
    _rewrite_weights(llada_copy, lambda t: t.pop("model.transformer.ff_out.weight"))
    model = load_model(llada_copy)
    assert model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()
    hidden: list[torch.Tensor] = []
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]]), hidden_states_out=hidden)
    torch.testing.assert_close(logits, hidden[-1] @ model.embed.weight.T)


def test_gqa_llada(llada_copy):
    """LLaDA with fewer KV heads than the fixture's (and than query heads): the k/v projections shrink
    and the model still runs."""
    config = json.loads((llada_copy / "config.json").read_text())
    heads = config["n_heads"]
    kv_heads = max(d for d in range(1, config.get("n_kv_heads") or heads) if heads % d == 0)
    head_dim = config["d_model"] // heads
    config["n_kv_heads"] = kv_heads
    (llada_copy / "config.json").write_text(json.dumps(config))

    def edit(t):
        for i in range(config["n_layers"]):
            for proj in ("k_proj", "v_proj"):
                name = f"model.transformer.blocks.{i}.{proj}.weight"
                t[name] = t[name][:kv_heads * head_dim].clone()
    _rewrite_weights(llada_copy, edit)
    model = load_model(llada_copy)
    assert model.config.num_kv_heads == kv_heads
    # Grouped heads must equal plain multi-head attention with each KV head repeated per group.
    ids = torch.randint(0, config["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(3))
    from engine.models import attention

    layer = model.layers[0].attn
    q = torch.randn(1, 4, 9, 16)
    k, v = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    grouped = attention.sdpa_attention(q, k, v, None)
    dense = attention.sdpa_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), None)
    torch.testing.assert_close(grouped, dense)
    assert layer.qkv_proj.weight.shape[0] == config["d_model"] + 2 * kv_heads * head_dim
    assert model(ids).shape == (1, 9, config["vocab_size"])


def test_unknown_dtype(fixtures):
    with pytest.raises(DeviceError, match="int8"):
        load_model(fixtures / "llada_tiny", dtype=torch.int8)
    with pytest.raises(DeviceError, match="float64x"):
        load_model(fixtures / "llada_tiny", dtype="float64x")


def test_cuda_without_gpu(fixtures, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="no CUDA GPU"):
        load_model(fixtures / "llada_tiny", device="cuda")


def test_bfloat16_on_gpu_without_bf16(fixtures, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    with pytest.raises(DeviceError, match="V100 does not support bfloat16"):
        load_model(fixtures / "llada_tiny", device="cuda", dtype="bfloat16")


def test_unknown_device_type(fixtures):
    with pytest.raises(DeviceError, match="not supported"):
        load_model(fixtures / "llada_tiny", device="meta")


def test_flash_attn_request_without_cuda_fails_clearly(fixtures):
    with pytest.raises(ValueError, match="flash-attn"):
        load_model(fixtures / "llada_tiny", use_flash_attn=True)


def test_cpu_uses_sdpa(llada_model):
    assert llada_model.attention_backend == "sdpa"


def test_loaded_model_is_inference_only(llada_model):
    assert not llada_model.training
    assert not any(p.requires_grad for p in llada_model.parameters())
