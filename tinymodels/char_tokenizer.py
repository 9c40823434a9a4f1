"""The built-in models' character-level tokenizer, saved as standard Hugging Face files.

One id per printable ASCII character and newline, plus special tokens; a chat template in the same
spirit as the real models' (role tags, an end token after each assistant turn), so chat requests
are rendered the same way for the tiny models as for LLaDA-8B or Dream-7B.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
UNK, MASK, END, USER, ASSISTANT, SYSTEM = ("<|unk|>", "<|mask|>", "<|end|>", "<|user|>", "<|assistant|>",
                                          "<|system|>")
SPECIALS = [UNK, MASK, END, USER, ASSISTANT, SYSTEM]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}<|end|>"
    "{% else %}{{ raise_exception('roles are system, user and assistant') }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def vocabulary() -> dict[str, int]:
    return {token: i for i, token in enumerate(CHARS + SPECIALS)}


def special_id(token: str) -> int:
    return vocabulary()[token]


def build_tokenizer() -> Tokenizer:
    vocab = vocabulary()
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # every character is a token
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


def render_user_prompt(content: str) -> str:
    """The chat template's text for one user message with the generation prompt."""
    return f"{USER}{content}{ASSISTANT}"


def write_tokenizer_files(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(dest / "tokenizer.json"))
    vocab = vocabulary()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "unk_token": UNK, "mask_token": MASK, "eos_token": END, "pad_token": END,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(vocab[t]): {"content": t, "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False, "special": True}
                                 for t in SPECIALS},
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dest / "special_tokens_map.json").write_text(json.dumps(
        {"unk_token": UNK, "mask_token": MASK, "eos_token": END, "pad_token": END}, indent=2) + "\n")
