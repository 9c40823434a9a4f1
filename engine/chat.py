"""Turning chat messages into prompt ids with the checkpoint's own chat template."""

from __future__ import annotations

from typing import Any

from engine.user_text import escape_messages, user_text_encoder


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Render `messages` with the tokenizer's chat template (by default with the generation prompt)
    and encode the text; the template already writes any bos token, so none is added again. The
    template's control tokens are real; a control token a message's text spells is plain text
    (engine/user_text.py)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this checkpoint's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(escape_messages(tokenizer, messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    return user_text_encoder(tokenizer).encode_rendered(text)
