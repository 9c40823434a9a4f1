"""Turning chat messages into prompt ids with the checkpoint's own chat template."""

from __future__ import annotations

from typing import Any

from engine.loading.tokenizer import encode_text


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Render `messages` with the tokenizer's chat template (by default with the generation prompt)
    and encode the text; the template already writes any bos token, so none is added again."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this checkpoint's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return encode_text(tokenizer, text)
