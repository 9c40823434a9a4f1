"""The two ways a problem reaches a built-in model: as a chat message (`/v1/chat/completions`
applies the chat template) or as the whole prompt (`/v1/completions` sends the text as it is).
Both are trained and both are evaluated."""

from __future__ import annotations

from tinymodels import char_tokenizer as chars

PROMPT_FORMS = ("chat", "plain")


def prompt_text(problem_text: str, form: str) -> str:
    """The exact text the model sees before its canvas."""
    if form == "chat":
        return chars.render_user_prompt(problem_text)
    if form == "plain":
        return problem_text
    raise ValueError(f"prompt form must be one of {', '.join(PROMPT_FORMS)}, got {form!r}")
