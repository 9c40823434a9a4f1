"""Text a client sent never becomes the mask token, and a chat message never any control token.

A tokenizer matches its added tokens in any text it encodes, so a prompt that spells `<|mask|>`
would become the mask token, which the decoder then fills as part of the answer (a block-diffusion
row's first block holds the prompt's tail), and a chat message that spells `<|im_end|>` or
`<|eot_id|>` would end its turn where the user typed it. Two rules, one mechanism:

- a completions (or /tokenize) text prompt is the model's raw input, as in vLLM: a client may send a
  chat template it rendered itself (lm-evaluation-harness does), so its control tokens are parsed;
  only the mask token, which no prompt may hold, is encoded as the plain text it spells;
- a chat message's text is text: every token the tokenizer marks special (each family's mask, end,
  turn and role tokens are) is plain text in it, while the chat template's own tokens stay real.
  The tokenizer's other added tokens (Qwen's `<think>`, `<tool_call>`, FIM markers: vocabulary it
  does not mark special) stay as the tokenizer makes them.

"Plain text" is what transformers' `split_special_tokens=True` gives: text is split at each
protected token it spells, the pieces between are encoded as usual (as they are around a real
token), and each spelling contributes the ids of its plain text, computed once per tokenizer by a
copy of its backend that splits the protected tokens. Text that spells none is encoded exactly as
`encode_text` encodes it. A chat is rendered by the checkpoint's template with each protected
spelling in its messages replaced by a private-use placeholder, then encoded piece by piece.
"""

from __future__ import annotations

import json
import re
import weakref
from typing import Any, Optional

from engine.loading.tokenizer import encode_text

# A placeholder for the k-th protected token inside a rendered chat: private-use characters no
# tokenizer gives meaning to and no template changes (`trim` strips whitespace only).
_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")

_encoders: weakref.WeakKeyDictionary[Any, dict[frozenset[int], UserTextEncoder]] = weakref.WeakKeyDictionary()


class UserTextEncoder:
    """Encodes user text with every protected token spelled in it taken as plain text (an id that is
    not one of the tokenizer's added tokens cannot be spelled: it is ignored)."""

    def __init__(self, tokenizer: Any, protected_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.protected_ids = frozenset(i for i in protected_ids if i in added)
        literals = sorted({added[i].content for i in self.protected_ids if added[i].content}, key=len, reverse=True)
        # longest first: where two protected tokens start at one place, the longer is the one spelled
        self._pattern = re.compile("|".join(map(re.escape, literals))) if literals else None
        twin = _split_special_twin(tokenizer, self.protected_ids)
        self._plain = {literal: self._plain_ids(literal, twin) for literal in literals}
        # placeholders: one per protected token, and one for the opening character itself, so a
        # user's own private-use character stays what it was
        self._placeholder_texts = [*literals, _OPEN]

    def _plain_ids(self, literal: str, twin: Optional[Any]) -> list[int]:
        """The ids of `literal` as plain text: the split-special copy's, or (without one, or if it still
        gives a protected id) the ids of its two halves, each encoded the same way."""
        if twin is not None:
            ids = twin.encode(literal, add_special_tokens=False).ids
            if not self.protected_ids.intersection(ids):
                return ids
        if len(literal) == 1:
            raise ValueError(f"the tokenizer's protected token {literal!r} is a single character: text "
                             "holding it cannot be encoded as plain text")
        half = len(literal) // 2
        return [*self._encode_piece(literal[:half]), *self._encode_piece(literal[half:])]

    def _encode_piece(self, text: str) -> list[int]:
        ids = encode_text(self.tokenizer, text)
        return ids if not self.protected_ids.intersection(ids) else self._plain_ids(text, None)

    def encode(self, text: str) -> list[int]:
        """The ids of user text: protected tokens it spells are plain text."""
        if self._pattern is None:
            return encode_text(self.tokenizer, text)
        ids: list[int] = []
        start = 0
        for match in self._pattern.finditer(text):
            if match.start() > start:
                ids += encode_text(self.tokenizer, text[start:match.start()])
            ids += self._plain[match.group()]
            start = match.end()
        if start < len(text) or not ids:
            ids += encode_text(self.tokenizer, text[start:])
        return ids

    def escape(self, text: str) -> str:
        """`text` with each protected token (and each placeholder opening character) replaced by its
        placeholder, for a chat template to render."""
        if self._pattern is None and _OPEN not in text:
            return text
        index = {literal: k for k, literal in enumerate(self._placeholder_texts)}
        pattern = (re.compile(f"{self._pattern.pattern}|{_OPEN}") if self._pattern is not None
                   else re.compile(_OPEN))
        return pattern.sub(lambda m: f"{_OPEN}{index[m.group()]}{_CLOSE}", text)

    def encode_rendered(self, text: str) -> list[int]:
        """The ids of a rendered chat whose messages were escaped: the template's text (its control
        tokens real) as usual, each placeholder as the plain text of what it stands for."""
        ids: list[int] = []
        start = 0
        for match in _PLACEHOLDER.finditer(text):
            k = int(match.group(1))
            if k >= len(self._placeholder_texts):
                continue  # not one of ours (cannot come from escape(), which replaced every opening character)
            ids += encode_text(self.tokenizer, text[start:match.start()])
            placeholder = self._placeholder_texts[k]
            ids += self._plain[placeholder] if placeholder in self._plain else encode_text(self.tokenizer, placeholder)
            start = match.end()
        return ids + encode_text(self.tokenizer, text[start:])


def _split_special_twin(tokenizer: Any, protected_ids: frozenset[int]) -> Optional[Any]:
    """A copy of a fast tokenizer's backend with every protected token special and special tokens
    split (`encode_special_tokens`), or None for a tokenizer without a backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return None
    from tokenizers import Tokenizer

    spec = json.loads(backend.to_str())
    for token in spec.get("added_tokens") or []:
        if token["id"] in protected_ids:
            token["special"] = True
    twin = Tokenizer.from_str(json.dumps(spec))
    twin.no_truncation()
    twin.no_padding()
    twin.encode_special_tokens = True
    return twin


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the added tokens the tokenizer marks special."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return frozenset(i for i, token in added.items() if token.special)


def user_text_encoder(tokenizer: Any, protected_ids: frozenset[int]) -> UserTextEncoder:
    """The tokenizer's encoder for these protected ids, built once (its plain-text ids are computed
    when it is built)."""
    by_ids = _encoders.get(tokenizer)
    if by_ids is None:
        by_ids = _encoders[tokenizer] = {}
    encoder = by_ids.get(protected_ids)
    if encoder is None:
        encoder = by_ids[protected_ids] = UserTextEncoder(tokenizer, protected_ids)
    return encoder


def encode_prompt_text(tokenizer: Any, text: str, mask_id: int) -> list[int]:
    """A completions text prompt: its control tokens parsed as the tokenizer parses them, the mask
    token (`mask_id`, the checkpoint's) plain text (module docstring)."""
    return user_text_encoder(tokenizer, frozenset((mask_id,))).encode(text)


def chat_encoder(tokenizer: Any, mask_id: Optional[int] = None) -> UserTextEncoder:
    """The encoder of chat messages: every special token, and the mask token, plain text."""
    extra = frozenset() if mask_id is None else frozenset((mask_id,))
    return user_text_encoder(tokenizer, special_ids(tokenizer) | extra)
