"""The released SDAR-8B-Chat and LLaDA2-mini metadata (no weights): configs, weight names, special
ids, tokenizer and chat template; and `inspect` on them and on the tiny block fixtures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import CheckpointError, load_tokenizer
from engine.inspect import describe_checkpoint, format_report
from engine.loading.checkpoint import CheckpointFiles
from engine.models import model_class_for
from engine.models.weight_names import expected_weights


@pytest.fixture(scope="module")
def real(fixtures) -> Path:
    return fixtures / "real"


@pytest.fixture(scope="module")
def llada2_real_config(real) -> dict[str, Any]:
    """LLaDA2.1-mini's config.json as its Hub page shows it, completed (the excerpt stops at
    `transformers_version`) from inclusionAI/dFactory's verbatim LLaDA2-mini config."""
    observed = json.loads((real / "llada2.0-mini" / "hub_config_observed.json").read_text())["llada2.1_mini"]
    dfactory = json.loads((real / "llada2.0-mini" / "dfactory_llada2_mini_config.json").read_text())
    return {**{k: v for k, v in dfactory.items() if k not in observed}, **observed}


def _meta_model(cls, config, special=None):
    with torch.device("meta"):
        return cls(config, special)


def _assert_table_covers_every_parameter(model, table) -> None:
    params = dict(model.named_parameters())
    rows: dict[str, int] = {}
    for param, shard in table.values():
        assert param in params
        if shard is None:
            rows[param] = params[param].shape[0]
        else:
            module = model.get_submodule(param.rsplit(".", 1)[0])
            rows[param] = rows.get(param, 0) + module.shard_offsets[shard][1]
    assert rows == {name: p.shape[0] for name, p in params.items()}


def test_sdar_config_parses_into_real_architecture(real):
    checkpoint = CheckpointFiles.open(real / "sdar-8b-chat")
    cls = model_class_for(checkpoint.config)
    config = cls.parse_config(checkpoint.config)
    assert cls.architecture == "sdar"
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (4096, 36, 32, 8)
    assert (config.intermediate_size, config.vocab_size, config.head_dim) == (12288, 151936, 128)
    assert config.rope_theta == 1e6 and config.rms_norm_eps == 1e-6 and config.rotary_dim == 128
    assert config.qk_norm and config.norm_scale_in_float32 and not config.qkv_bias
    assert not config.tie_word_embeddings and not config.logits_shifted and config.moe is None
    assert config.block_size == 4


def test_sdar_head_dim_is_read_not_derived(real):
    """SDAR-4B: hidden 2560 over 32 heads would give 80, but its head_dim is 128."""
    hf = json.loads((real / "sdar-8b-chat" / "config.json").read_text())
    hf.update(hidden_size=2560, intermediate_size=9728)
    config = model_class_for(hf).parse_config(hf)
    assert config.head_dim == 128 and config.q_size == 4096


def test_sdar_weight_table_maps_every_real_tensor(real):
    checkpoint = CheckpointFiles.open(real / "sdar-8b-chat")
    cls = model_class_for(checkpoint.config)
    config = cls.parse_config(checkpoint.config)
    index_names = set(checkpoint.weight_index())
    assert len(index_names) == 399
    table = expected_weights(config)
    assert set(table) == index_names
    model = _meta_model(cls, config, checkpoint.special_tokens())
    _assert_table_covers_every_parameter(model, table)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 8.19


def test_sdar_special_ids_from_files(real):
    special = CheckpointFiles.open(real / "sdar-8b-chat").special_tokens()
    assert special.mask_id == 151669
    assert special.eos_ids == (151645, 151643)  # generation_config: <|im_end|>, <|endoftext|>
    assert special.eot_id == 151645 and special.pad_id == 151643 and special.bos_id == 151643


def test_sdar_tokenizer_and_chat_template(real):
    """added_tokens.json calls id 151669 `<MASK>`, tokenizer_config.json `<|MASK|>`; the tokenizer
    follows the latter, and the stale name does not refuse it."""
    tokenizer = load_tokenizer(real / "sdar-8b-chat")
    assert tokenizer.encode("Hello world, 12+35=47!", add_special_tokens=False) == \
        [9707, 1879, 11, 220, 16, 17, 10, 18, 20, 28, 19, 22, 0]
    assert tokenizer.mask_token == "<|MASK|>" and tokenizer.convert_tokens_to_ids("<|MASK|>") == 151669
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode(text, add_special_tokens=False) == [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]


def test_llada2_config_parses_into_real_architecture(llada2_real_config):
    cls = model_class_for(llada2_real_config)
    config = cls.parse_config(llada2_real_config)
    assert cls.architecture == "llada2"
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (2048, 20, 16, 4)
    assert (config.intermediate_size, config.vocab_size, config.head_dim, config.rotary_dim) == (5120, 157184, 128, 64)
    assert config.rope_theta == 600000 and config.rms_norm_eps == 1e-6 and config.qk_norm
    moe = config.moe
    assert moe is not None
    assert (moe.num_experts, moe.experts_per_token, moe.num_groups, moe.topk_group) == (256, 8, 8, 4)
    assert (moe.expert_intermediate_size, moe.num_shared_experts, moe.first_dense_layers) == (512, 1, 1)
    assert moe.routed_scaling_factor == 2.5 and config.block_size is None


def test_llada2_weight_table_covers_the_real_model(llada2_real_config):
    cls = model_class_for(llada2_real_config)
    config = cls.parse_config(llada2_real_config)
    table = expected_weights(config)
    # per layer: attention 4 + QK-norm 2; layer 0 a dense MLP (3); 19 MoE layers: router 2, 256 x 3
    # experts, shared expert 3; plus embeddings, final norm, head
    assert len(table) == 20 * 6 + 3 + 19 * (2 + 256 * 3 + 3) + 3
    assert "model.layers.19.mlp.experts.255.down_proj.weight" in table
    assert "model.layers.0.mlp.gate_proj.weight" in table and "model.layers.1.mlp.gate_proj.weight" not in table
    _assert_table_covers_every_parameter(_meta_model(cls, config), table)


def test_llada2_config_without_its_flags_is_refused(llada2_real_config):
    """A config.json that omits `use_bias` gets the class default (true): a bias we do not compute."""
    hf = {k: v for k, v in llada2_real_config.items() if k != "use_bias"}
    with pytest.raises(CheckpointError, match="use_bias"):
        model_class_for(hf).parse_config(hf)


def test_inspect_describes_the_real_block_models(real, llada2_real_config, tmp_path):
    sdar = describe_checkpoint(real / "sdar-8b-chat")
    assert sdar["architecture"] == "SDAR" and sdar["parameters"] == 8_190_735_360
    assert sdar["block_size"] == 4 and sdar["head_dim"] == 128 and sdar["dtype"] == "bfloat16"
    assert sdar["special_ids"] == {"mask": 151669, "eos": [151645, 151643], "eot": 151645, "pad": 151643,
                                   "bos": 151643}
    assert sdar["chat_template"] is True and "block-causal" in sdar["attention"]
    (tmp_path / "config.json").write_text(json.dumps(llada2_real_config))
    llada2 = describe_checkpoint(tmp_path)
    assert llada2["architecture"] == "LLaDA2" and llada2["dtype"] == "bfloat16"
    assert round(llada2["parameters"] / 1e9, 2) == 16.26  # "16B total, 1.4B active"
    assert round(llada2["active_parameters"] / 1e9, 2) == 1.43
    assert llada2["rotary_dims"] == 64 and "256 routed, 8 per token" in llada2["experts"]
    assert str(llada2["special_ids"]).startswith("not loadable") and "mask" in str(llada2["special_ids"])
    assert "active_parameters  1,432,973,056 (1.43B)" in format_report(llada2)


def test_inspect_describes_the_tiny_block_fixtures(fixtures):
    for config_path in sorted((fixtures / "block").glob("*/*/config.json")):
        hf = json.loads(config_path.read_text())
        report = describe_checkpoint(config_path.parent)
        assert report["weights"]["status"] == "ok", report["weights"]
        assert report["layers"] == hf["num_hidden_layers"] and report["head_dim"] == hf["head_dim"]
        assert report["block_size"] == hf.get("block_size", report["block_size"])
        if "num_experts" in hf:
            assert report["active_parameters"] < report["parameters"]
