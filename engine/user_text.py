"""Text a client sent never becomes a control token.

A tokenizer matches its added tokens in any text it encodes, so a prompt that spells `<|mask|>`
(or `<|im_end|>`, `<|eot_id|>`, ...) would become that token: the decoder then fills the prompt's
mask position, or the chat turn ends where the user typed it. Here every *protected* token -- each
added token the tokenizer marks special (every family's mask, end, turn and role tokens are) -- is
encoded as the plain text it spells when it appears in text a user sent, the way transformers'
`split_special_tokens=True` encodes it; the tokenizer's other added tokens (Qwen's `<think>`,
`<tool_call>`, FIM markers: ordinary vocabulary, not marked special) stay as the tokenizer makes
them.

Text is split at each protected token it spells: the pieces between are encoded as usual and each
spelled token contributes the ids of its plain text (those ids are computed once per tokenizer, by a
copy of its backend with every protected token special and special tokens split). So the text
around a spelled token is tokenized as it is around a real one, and text without any is encoded
exactly as `encode_text` encodes it.

A chat is rendered by the checkpoint's template with each protected token its messages spell
replaced by a private-use placeholder, so the template's own control tokens stay real and only the
messages' text is made plain.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Sequence
from typing import Any, Optional

from engine.loading.tokenizer import encode_text

# A placeholder for the k-th protected token inside a rendered chat: private-use characters no
# tokenizer gives meaning to and no template changes (`trim` strips whitespace only).
_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")

_encoders: weakref.WeakKeyDictionary[Any, UserTextEncoder] = weakref.WeakKeyDictionary()


class UserTextEncoder:
    """Encodes user text with every protected token spelled in it taken as plain text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.protected_ids = frozenset(i for i, token in added.items() if token.special)
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


def user_text_encoder(tokenizer: Any) -> UserTextEncoder:
    """The tokenizer's encoder, built once (its plain-text ids are computed when it is built)."""
    encoder = _encoders.get(tokenizer)
    if encoder is None:
        encoder = _encoders[tokenizer] = UserTextEncoder(tokenizer)
    return encoder


def encode_user_text(tokenizer: Any, text: str) -> list[int]:
    """`text` as a client sent it: every protected token it spells is plain text (module docstring)."""
    return user_text_encoder(tokenizer).encode(text)


def escape_messages(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with their text escaped for `UserTextEncoder.encode_rendered`."""
    encoder = user_text_encoder(tokenizer)
    return [{**m, "content": encoder.escape(m["content"])} if isinstance(m.get("content"), str) else dict(m)
            for m in messages]
