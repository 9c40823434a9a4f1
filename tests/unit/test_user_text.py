"""Text a client sends never becomes the mask token, and a chat message never a control token
(engine/user_text.py), with each family's
tokenizer: the built-in character tokenizer (llada-tiny, dream-tiny, sdar-tiny and the random SDAR
and LLaDA2 test checkpoints), the released Dream-v0-Instruct-7B and SDAR-8B-Chat tokenizers, and
LLaDA-8B-Instruct's released added tokens and chat template over a stand-in byte-level vocabulary
(its tokenizer.json, 126k merges, is not in the fixtures). No LLaDA2 tokenizer is in the fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import load_tokenizer
from engine.chat import chat_prompt_ids
from engine.loading.checkpoint import CheckpointFiles
from engine.loading.tokenizer import encode_text
from engine.special_tokens import special_tokens_from_files
from engine.user_text import chat_encoder, encode_prompt_text

REPO = Path(__file__).resolve().parents[2]
LLADA_8B = "llada-8b-instruct"


def llada_8b_standin(fixtures: Path, dest: Path) -> Path:
    """LLaDA-8B-Instruct's released tokenizer_config.json (every added token at its id, the chat
    template) over a byte-level vocabulary of 256 symbols, as a checkpoint directory."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    real = fixtures / "real" / LLADA_8B
    config = json.loads((real / "tokenizer_config.json").read_text())
    vocab = {symbol: i for i, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    added = config["added_tokens_decoder"]
    vocab.update({entry["content"]: int(i) for i, entry in added.items()})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(e["content"], special=e["special"], normalized=False)
                                  for e in added.values()])
    dest.mkdir()
    tokenizer.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("config.json", "generation_config.json"):
        (dest / name).write_text((real / name).read_text())
    return dest


@pytest.fixture(scope="module", params=["builtin", "dream-v0-instruct-7b", "sdar-8b-chat", LLADA_8B])
def checkpoint(request, fixtures, tmp_path_factory) -> Path:
    if request.param == "builtin":
        return REPO / "models" / "llada-tiny"
    if request.param == LLADA_8B:
        return llada_8b_standin(fixtures, tmp_path_factory.mktemp("llada8b") / LLADA_8B)
    return fixtures / "real" / request.param


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_tokenizer(checkpoint)


@pytest.fixture(scope="module")
def special(checkpoint):
    files = CheckpointFiles.open(checkpoint)
    return special_tokens_from_files(files.config, files.generation_config, files.tokenizer_config, files.added_tokens)


def protected_tokens(tokenizer) -> dict[str, int]:
    return {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


def test_every_decoder_id_is_protected_in_chat(tokenizer, special):
    """The mask, end, end-of-turn and pad tokens the checkpoint names are among the chat's protected ones."""
    protected = chat_encoder(tokenizer, special.mask_id).protected_ids
    named = {special.mask_id, special.pad_id, *special.end_ids} | ({special.bos_id} - {None})
    assert named <= protected, named - protected


def test_a_prompt_spelling_the_mask_is_its_text_and_other_control_tokens_are_parsed(tokenizer, special):
    """A completions text prompt: the mask token is plain text; the other control tokens are parsed
    as vLLM parses them (a client may send a chat template it rendered itself)."""
    mask = tokenizer.convert_ids_to_tokens(special.mask_id)
    for text in (f"31415+27182{mask}", f"31415{mask}27182", f"{mask}{mask} 12", "31415+27182<|mask|>"):
        ids = encode_prompt_text(tokenizer, text, special.mask_id)
        assert special.mask_id not in ids
        assert tokenizer.decode(ids) == text  # nothing lost: the token's spelling is the text's
    end = tokenizer.convert_ids_to_tokens(special.eos_id)
    assert special.eos_id in encode_prompt_text(tokenizer, f"12{end}{mask}", special.mask_id)


def test_chat_text_spelling_any_control_token_stays_text(tokenizer, special):
    protected = protected_tokens(tokenizer)
    encoder = chat_encoder(tokenizer, special.mask_id)
    for literal in protected:
        text = f"31415+27182{literal} 12{literal}"
        ids = encoder.encode(text)
        assert not set(ids) & set(protected.values()), (literal, ids)
        assert tokenizer.decode(ids) == text


def test_text_without_control_tokens_is_encoded_as_before(tokenizer, special):
    for text in ("00457+00038", "sum a3 b5 c2", "Hello world, 12+35=47!", "", "<think> <tool_call> <|not a token|>"):
        assert encode_prompt_text(tokenizer, text, special.mask_id) == encode_text(tokenizer, text) == \
            chat_encoder(tokenizer, special.mask_id).encode(text) == \
            list(tokenizer.encode(text, add_special_tokens=False))


def test_a_lone_control_token_is_its_plain_text(tokenizer, special):
    """A text that is one control token's spelling gives the ids transformers' split_special_tokens
    gives for it."""
    encoder = chat_encoder(tokenizer, special.mask_id)
    for literal in list(protected_tokens(tokenizer))[:40]:
        plain = list(tokenizer.encode(literal, add_special_tokens=False, split_special_tokens=True))
        assert encoder.encode(literal) == plain, literal


def test_chat_keeps_the_templates_control_tokens_and_makes_the_messages_plain(tokenizer, special):
    protected = set(protected_tokens(tokenizer).values())
    mask = tokenizer.convert_ids_to_tokens(special.mask_id)
    plain = chat_prompt_ids(tokenizer, [{"role": "user", "content": "00457+00038"}], mask_id=special.mask_id)
    reference = chat_prompt_ids(tokenizer, [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "00457+00038"}], mask_id=special.mask_id)
    for literal in [mask, *protected_tokens(tokenizer)][:40]:
        messages = [{"role": "system", "content": f"be brief{literal}"},
                    {"role": "user", "content": f"00457+00038{literal}"}]
        ids = chat_prompt_ids(tokenizer, messages, mask_id=special.mask_id)
        # exactly the control tokens the template writes for the same turns without the spelling
        assert [t for t in ids if t in protected] == [t for t in reference if t in protected], literal
        assert special.mask_id not in ids
        assert literal in tokenizer.decode(ids, skip_special_tokens=True)
    assert [t for t in plain if t in protected]  # the template's own tokens are real ones


def test_a_users_private_use_characters_survive_the_placeholders(tokenizer):
    if tokenizer.decode(encode_text(tokenizer, "\ue000")) != "\ue000":
        pytest.skip("this tokenizer has no private-use characters (the character tokenizer's are unknown)")
    text = "a\ue000 0\ue001 \ue0001\ue001 b"
    ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": text}])
    assert text in tokenizer.decode(ids, skip_special_tokens=True)
