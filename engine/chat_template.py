"""Rendering a checkpoint's Jinja chat template without a tokenizer object.

Hugging Face renders templates in a sandboxed Jinja environment with `trim_blocks` and
`lstrip_blocks`; this does the same, so the special-token probe in `special_tokens.py` sees exactly
the text that `tokenizer.apply_chat_template` produces.
"""

from __future__ import annotations

from typing import Any, NoReturn

from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise(message: str) -> NoReturn:
    raise ValueError(f"chat template error: {message}")


def render_chat_template(template: str, messages: list[dict[str, str]], *,
                         add_generation_prompt: bool, **variables: Any) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(template).render(messages=messages,
                                            add_generation_prompt=add_generation_prompt, **variables)
