"""`encode_text` (the backend's single-text encode) gives exactly transformers' `encode` ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import load_tokenizer
from engine.chat import chat_prompt_ids
from engine.loading.tokenizer import encode_text

REPO = Path(__file__).resolve().parents[2]

TEXTS = ("Hello world, 12+35=47!", "Bonjour, ça va? 你好，世界 🙂", "  two  spaces\nand a newline\t", "",
         "<|im_start|>hi<|im_end|> <|mask|> <|endoftext|>", "<|mdm_mask|><|eot_id|>7+8=15 carry 1; answer 405")


@pytest.fixture(scope="module", params=["builtin", "dream"])
def tokenizer(request, fixtures):
    path = REPO / "models" / "llada-tiny" if request.param == "builtin" else fixtures / "real" / "dream-v0-instruct-7b"
    return load_tokenizer(path)


def test_encode_text_matches_transformers_encode(tokenizer):
    for text in TEXTS:
        assert encode_text(tokenizer, text) == list(tokenizer.encode(text, add_special_tokens=False)), text


def test_chat_prompt_ids_match_transformers_encode(tokenizer):
    """Messages that spell no control token: exactly transformers' rendering and encoding (one that
    does is tests/unit/test_user_text.py's)."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12+35? <think>"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat_prompt_ids(tokenizer, messages) == list(tokenizer.encode(text, add_special_tokens=False))


def test_backend_state_that_transformers_would_reset_takes_the_transformers_path(fixtures):
    tokenizer = load_tokenizer(fixtures / "real" / "dream-v0-instruct-7b")
    text = "one two three four five six"
    full = list(tokenizer.encode(text, add_special_tokens=False))
    tokenizer.backend_tokenizer.enable_truncation(max_length=2)
    assert encode_text(tokenizer, text) == full
