"""The released LLaDA-8B-Instruct and Dream-v0-Instruct-7B metadata (no weights): configs, weight
names, special ids, tokenizers and chat templates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import CheckpointError, load_tokenizer
from engine.loading.checkpoint import CheckpointFiles
from engine.models import model_class_for
from engine.models.weight_names import expected_weights
from engine.special_tokens import MASK_TOKEN_TEXT


@pytest.fixture(scope="module")
def real(fixtures) -> Path:
    return fixtures / "real"


def _config(path: Path):
    checkpoint = CheckpointFiles.open(path)
    cls = model_class_for(checkpoint.config)
    return cls, cls.parse_config(checkpoint.config), checkpoint


def test_llada_config_parses_into_real_architecture(real):
    cls, config, _ = _config(real / "llada-8b-instruct")
    assert cls.architecture == "llada"
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (4096, 32, 32, 32)
    assert (config.intermediate_size, config.vocab_size, config.head_dim) == (12288, 126464, 128)
    assert config.rope_theta == 500000.0 and config.rms_norm_eps == 1e-5
    assert not config.qkv_bias and not config.tie_word_embeddings and config.rope_in_float32
    assert not config.logits_shifted


def test_dream_config_parses_into_real_architecture(real):
    cls, config, _ = _config(real / "dream-v0-instruct-7b")
    assert cls.architecture == "dream"
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (3584, 28, 28, 4)
    assert (config.intermediate_size, config.vocab_size, config.head_dim) == (18944, 152064, 128)
    assert config.rope_theta == 1e6 and config.rms_norm_eps == 1e-6
    assert config.qkv_bias and not config.tie_word_embeddings and config.logits_shifted


@pytest.mark.parametrize("name,count", [("llada-8b-instruct", 291), ("dream-v0-instruct-7b", 339)])
def test_weight_table_maps_every_real_tensor(real, name, count):
    cls, config, checkpoint = _config(real / name)
    index_names = set(checkpoint.weight_index())
    assert len(index_names) == count
    table = expected_weights(config)
    assert set(table) == index_names
    # Every mapped parameter exists in the model and is fully covered by its shards.
    with torch.device("meta"):
        model = cls(config, checkpoint.special_tokens())
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


def test_real_parameter_counts(real):
    for name, billions in (("llada-8b-instruct", 8.02), ("dream-v0-instruct-7b", 7.62)):
        cls, config, checkpoint = _config(real / name)
        with torch.device("meta"):
            model = cls(config, checkpoint.special_tokens())
        assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == billions


def test_llada_special_ids_from_files(real):
    special = CheckpointFiles.open(real / "llada-8b-instruct").special_tokens()
    assert special.mask_id == 126336
    assert special.eos_ids == (126081,)
    assert special.eot_id == 126348  # <|eot_id|>, found by rendering the chat template
    assert special.pad_id == 126081 and special.bos_id == 126080
    assert special.end_ids == (126081, 126348)


def test_dream_special_ids_from_files(real):
    special = CheckpointFiles.open(real / "dream-v0-instruct-7b").special_tokens()
    assert special.mask_id == 151666
    assert special.eos_ids == (151643,)
    assert special.eot_id == 151645  # <|im_end|>
    assert special.pad_id == 151643 and special.bos_id == 151643


def test_special_ids_follow_the_files_not_the_code(real, tmp_path):
    dest = tmp_path / "llada"
    shutil.copytree(real / "llada-8b-instruct", dest)
    config = json.loads((dest / "config.json").read_text())
    config["mask_token_id"] = 7
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    special = CheckpointFiles.open(dest).special_tokens()
    assert special.mask_id == 7 and special.eos_ids == (5, 6)


def _dream_without_mask_id(real, tmp_path) -> tuple[Path, int]:
    """A copy of Dream's metadata whose config and tokenizer config name no mask id; and the id of
    the tokenizer's `<|mask|>` special token, which still names one."""
    dest = tmp_path / "dream"
    shutil.copytree(real / "dream-v0-instruct-7b", dest)
    config = json.loads((dest / "config.json").read_text())
    del config["mask_token_id"]
    (dest / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((dest / "tokenizer_config.json").read_text())
    del tok_config["mask_token"]
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_config))
    added = tok_config["added_tokens_decoder"]
    [mask_id] = [int(i) for i, token in added.items() if token["content"] == MASK_TOKEN_TEXT]
    return dest, mask_id


def test_a_mask_id_named_nowhere_but_the_mask_special_token_is_that_token(real, tmp_path):
    """LLaDA2's case: no file names a mask id; its tokenizer's `<|mask|>` is the official default."""
    dest, mask_id = _dream_without_mask_id(real, tmp_path)
    assert CheckpointFiles.open(dest).special_tokens().mask_id == mask_id


def test_missing_mask_id_is_an_error(real, tmp_path):
    dest, _ = _dream_without_mask_id(real, tmp_path)
    for name in ("tokenizer_config.json", "added_tokens.json"):
        data = json.loads((dest / name).read_text())
        if name == "added_tokens.json":
            data = {text: i for text, i in data.items() if text != MASK_TOKEN_TEXT}
        else:
            data["added_tokens_decoder"] = {i: t for i, t in data["added_tokens_decoder"].items()
                                            if t["content"] != MASK_TOKEN_TEXT}
        (dest / name).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="mask"):
        CheckpointFiles.open(dest).special_tokens()


@pytest.fixture(scope="module")
def dream_tokenizer(real):
    return load_tokenizer(real / "dream-v0-instruct-7b")


def test_dream_tokenizer_encodes_like_the_original(dream_tokenizer):
    text = "Hello world, 12+35=47!"
    ids = dream_tokenizer.encode(text, add_special_tokens=False)
    assert ids == [9707, 1879, 11, 220, 16, 17, 10, 18, 20, 28, 19, 22, 0]
    assert dream_tokenizer.decode(ids) == text


def test_dream_tokenizer_round_trips(dream_tokenizer):
    for text in ("Bonjour, ça va? 你好，世界 🙂", "  two  spaces\nand a newline\t", "x = [1, 2, 3]"):
        assert dream_tokenizer.decode(dream_tokenizer.encode(text, add_special_tokens=False)) == text


def test_dream_added_tokens_keep_their_ids(dream_tokenizer):
    ids = dream_tokenizer.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>"])
    assert ids == [151643, 151644, 151645, 151665, 151666]
    assert dream_tokenizer.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)[::2] == [151644, 151645]


def test_dream_chat_template_renders(dream_tokenizer):
    text = dream_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                               add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_dream_tokenizer_never_runs_remote_code(real, tmp_path):
    dest = tmp_path / "dream"
    shutil.copytree(real / "dream-v0-instruct-7b", dest)
    marker = tmp_path / "remote-code-ran"
    (dest / "tokenization_dream.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    tokenizer = load_tokenizer(dest)
    assert tokenizer.encode("hi", add_special_tokens=False) == [6023]
    assert not marker.exists()


def _llada_with_stand_in_vocab(real: Path, dest: Path) -> None:
    """LLaDA's tokenizer.json did not come with the fixtures: a small word-level vocabulary with the
    real added tokens at their real ids stands in for it."""
    shutil.copytree(real / "llada-8b-instruct", dest)
    tok_config = json.loads((dest / "tokenizer_config.json").read_text())
    added = [{"id": int(i), "content": e["content"], "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": e.get("special", True)}
             for i, e in tok_config["added_tokens_decoder"].items()]
    vocab = {word: i for i, word in enumerate(["[UNK]", "user", "assistant", "system", "hi", "there"])}
    vocab.update({a["content"]: a["id"] for a in added})
    tokenizer_json = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    }
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer_json))


def test_llada_chat_template_renders(real, tmp_path):
    _llada_with_stand_in_vocab(real, tmp_path / "llada")
    tokenizer = load_tokenizer(tmp_path / "llada")
    messages = [{"role": "user", "content": "hi there"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nhi there<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[:3] == [126080, 126346, 1]
    assert 126348 in ids and ids[-1] == 126347
    assert tokenizer.convert_tokens_to_ids("<|mdm_mask|>") == 126336


def test_tokenizer_with_shifted_added_token_is_refused(real, tmp_path):
    _llada_with_stand_in_vocab(real, tmp_path / "llada")
    data = json.loads((tmp_path / "llada" / "tokenizer.json").read_text())
    for entry in data["added_tokens"]:
        if entry["content"] == "<|eot_id|>":
            entry["id"] = 126349
    data["model"]["vocab"]["<|eot_id|>"] = 126349
    (tmp_path / "llada" / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="eot_id"):
        load_tokenizer(tmp_path / "llada")


def test_missing_tokenizer_is_an_error(fixtures):
    with pytest.raises(CheckpointError, match="no tokenizer"):
        load_tokenizer(fixtures / "llada_tiny")
