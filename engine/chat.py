"""Turning chat messages into prompt ids with the checkpoint's own chat template."""

from __future__ import annotations

from typing import Any, Optional

from engine.user_text import chat_encoder


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    mask_id: Optional[int] = None) -> list[int]:
    """Render `messages` with the tokenizer's chat template (by default with the generation prompt)
    and encode the text; the template already writes any bos token, so none is added again. The
    template's control tokens are real; a special token (or the mask token, `mask_id`, the
    checkpoint's) that a message's text spells is plain text (engine/user_text.py)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this checkpoint's tokenizer has no chat template")
    encoder = chat_encoder(tokenizer, mask_id)
    escaped = [{**m, "content": encoder.escape(m["content"])} if isinstance(m.get("content"), str) else dict(m)
               for m in messages]
    text = tokenizer.apply_chat_template(escaped, tokenize=False, add_generation_prompt=add_generation_prompt)
    return encoder.encode_rendered(text)
