"""Special token ids, read from the checkpoint's own files and never written into code.

Sources, in order of precedence:
- mask: `config.json` `mask_token_id`, then `generation_config.json`, then the tokenizer's
  `mask_token`, then the tokenizer's special token `<|mask|>` (LLaDA2's: its config and generation
  config name no mask id; the official `generate()` takes it as an argument whose default is that
  token's id);
- eos: `generation_config.json` `eos_token_id` (an int or a list), then `config.json`, then the
  tokenizer's `eos_token`;
- eot (end of turn): the special token the chat template writes right after an assistant message
  (`<|eot_id|>` for LLaDA, `<|im_end|>` for Dream), found by rendering the template;
- pad: `config.json`, then `generation_config.json`, then the tokenizer's `pad_token`, else eos;
- bos: `generation_config.json`, then `config.json`, else none.
A multimodal config (DiffusionGemma) keeps its text model's ids under `text_config`: they count as
`config.json`'s where the top level names none. A uniform-noise model (DiffusionGemma) has no mask
token: its `mask_id` is None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from engine.chat_template import render_chat_template
from engine.errors import CheckpointError

_PROBE_REPLY = "cai_dllm_probe_reply"
# The mask token's text in a tokenizer that declares no `mask_token` (LLaDA2's).
MASK_TOKEN_TEXT = "<|mask|>"


@dataclass(frozen=True)
class SpecialTokens:
    mask_id: Optional[int]  # None: a model without a mask token (DiffusionGemma)
    eos_ids: tuple[int, ...]
    pad_id: int
    bos_id: Optional[int] = None
    eot_id: Optional[int] = None

    @property
    def eos_id(self) -> int:
        return self.eos_ids[0]

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Every id that ends a response: the eos ids and the end-of-turn id."""
        ids = list(self.eos_ids)
        if self.eot_id is not None and self.eot_id not in ids:
            ids.append(self.eot_id)
        return tuple(ids)


def added_token_ids(tokenizer_config: dict[str, Any], extra: Optional[dict[str, int]] = None,
                    special_only: bool = False) -> dict[str, int]:
    """content -> id for the tokens listed in `added_tokens_decoder` (and `added_tokens.json`)."""
    ids: dict[str, int] = {}
    if not special_only:
        ids.update(extra or {})
    for token_id, entry in (tokenizer_config.get("added_tokens_decoder") or {}).items():
        if special_only and not entry.get("special", False):
            continue
        ids[entry["content"]] = int(token_id)
    return ids


def _token_content(value: Any) -> Optional[str]:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _tokenizer_id(tokenizer_config: dict[str, Any], key: str, added: dict[str, int]) -> Optional[int]:
    content = _token_content(tokenizer_config.get(key))
    return added.get(content) if content is not None else None


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def end_of_turn_id(tokenizer_config: dict[str, Any], added: dict[str, int]) -> Optional[int]:
    """The special token the chat template writes right after an assistant message's content."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # a list of named templates; the default one is used for chat
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        return None
    strings = {key: _token_content(tokenizer_config.get(key)) or ""
               for key in ("bos_token", "eos_token", "pad_token", "unk_token")}
    try:
        text = render_chat_template(
            template,
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE_REPLY}],
            add_generation_prompt=False, **strings)
    except Exception:  # a template that needs more than plain messages: no eot can be inferred
        return None
    after = text[text.rfind(_PROBE_REPLY) + len(_PROBE_REPLY):]
    matches = [content for content in added if content and after.startswith(content)]
    return added[max(matches, key=len)] if matches else None


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def special_tokens_from_files(config: dict[str, Any], generation_config: Optional[dict[str, Any]],
                              tokenizer_config: Optional[dict[str, Any]],
                              added_tokens: Optional[dict[str, int]] = None,
                              needs_mask: bool = True) -> SpecialTokens:
    text = config.get("text_config")
    if isinstance(text, dict):
        config = {**text, **{k: v for k, v in config.items() if v is not None}}
    gen = generation_config or {}
    tok = tokenizer_config or {}
    added = added_token_ids(tok, added_tokens)
    special_added = added_token_ids(tok, special_only=True) or added

    mask_id = _first(config.get("mask_token_id"), gen.get("mask_token_id"),
                     _tokenizer_id(tok, "mask_token", added), special_added.get(MASK_TOKEN_TEXT))
    if mask_id is None and needs_mask:
        raise CheckpointError(f"no mask token id: neither config.json nor generation_config.json has a "
                              f"mask_token_id, and the tokenizer config names no mask_token and has no "
                              f"{MASK_TOKEN_TEXT} special token; a masked diffusion model needs one (add "
                              f"mask_token_id to generation_config.json)")
    eos_ids = (_as_id_tuple(gen.get("eos_token_id")) or _as_id_tuple(config.get("eos_token_id"))
               or _as_id_tuple(_tokenizer_id(tok, "eos_token", added)))
    if not eos_ids:
        raise CheckpointError("no eos token id in config.json, generation_config.json or the tokenizer config")
    pad_id = _first(config.get("pad_token_id"), gen.get("pad_token_id"),
                    _tokenizer_id(tok, "pad_token", added), eos_ids[0])
    bos_id = _first(gen.get("bos_token_id"), config.get("bos_token_id"))
    return SpecialTokens(mask_id=None if mask_id is None else int(mask_id), eos_ids=eos_ids, pad_id=int(pad_id),
                         bos_id=None if bos_id is None else int(bos_id),
                         eot_id=end_of_turn_id(tok, special_added))
