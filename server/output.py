"""The output path: from each choice's token deltas to the text a client gets, streamed or whole.

Both response kinds go through `ChoiceOutput.add`: the engine's deltas are detokenized
incrementally (each step decodes only a short window, never the whole prefix again), cut at the
first end token and at the first stop string, and what may be sent is everything except a tail that
could still begin a stop string or finish a split multi-byte character. `finish_reason_of` is the
one mapping from engine outcomes to OpenAI's finish_reason.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from engine import GenerationResult
from engine.decoding.types import TokenLogprob

# Tokens before the new ones that are decoded with them, so a word split across steps is rendered
# as the tokenizer would render it whole (vLLM keeps a similar window).
_CONTEXT_TOKENS = 6


def finish_reason_of(engine_reason: str, stopped_by_string: bool, cut_at_max_tokens: bool = False) -> str:
    """The one mapping from engine outcomes to OpenAI's finish_reason. A stop string is found in the
    text of the first max_tokens tokens only, so it wins over max_tokens when the same delta brings
    both (a block-diffusion model's whole block does)."""
    if stopped_by_string or cut_at_max_tokens:
        return "stop" if stopped_by_string else "length"
    return engine_reason if engine_reason in ("stop", "length") else "abort"


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index of the earliest stop string in text[start:] (as an index into text), or -1."""
    return min((i for i in (text.find(s, start) for s in stops if s) if i >= 0), default=-1)


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` must wait: a split multi-byte character, or a tail that
    could be the beginning of a stop string."""
    limit = len(text.rstrip("\ufffd"))
    for stop in stops:
        for k in range(min(len(stop) - 1, limit), 0, -1):
            if text[:limit].endswith(stop[:k]):
                limit -= k
                break
    return len(text) - limit


class IncrementalDetokenizer:
    """Text of a growing token sequence, decoding only the new tokens and a few before them."""

    def __init__(self, tokenizer: Optional[Any]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the decoding window
        self._read = 0  # tokens whose text is already in self.text

    def add(self, ids: Sequence[int]) -> None:
        if not ids:
            return
        self.ids.extend(ids)
        if self.tokenizer is None:  # token-id-only models: ids as text
            self.text = " ".join(map(str, self.ids))
            self._read = len(self.ids)
            return
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix:], skip_special_tokens=True)
        if after.endswith("\ufffd"):  # a multi-byte character is not complete yet: wait for more tokens
            return
        if after.startswith(before):
            self.text += after[len(before):]
        else:  # the window rendered its start differently: decode everything once
            self.text = decode(self.ids, skip_special_tokens=True)
        self._read = len(self.ids)
        self._prefix = max(0, self._read - _CONTEXT_TOKENS)

    def flush(self) -> None:
        """At the end: whatever is held back (an incomplete character) is rendered as it is."""
        if self._read < len(self.ids) and self.tokenizer is not None:
            self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            self._read = len(self.ids)


@dataclass(frozen=True)
class LoggedToken:
    """A response token with its logprobs and where its text starts in the response (vLLM's
    text_offset: the token decoded on its own, offsets summed over the tokens before it)."""

    text: str
    offset: int
    logprob: Optional[TokenLogprob]  # None: an echoed prompt's first token (nothing to condition it on)


def token_text(tokenizer: Optional[Any], token: int) -> str:
    """A token's text decoded on its own (a token-id-only model's token is its id)."""
    return str(token) if tokenizer is None else tokenizer.decode([token])


def logged_tokens(tokenizer: Optional[Any], ids: Sequence[int], logprobs: Sequence[Optional[TokenLogprob]],
                  offset: int = 0) -> list[LoggedToken]:
    """Each token with its logprobs and where its text starts, counting from `offset`."""
    out = []
    for token, logprob in zip(ids, logprobs, strict=False):
        text = token_text(tokenizer, token)
        out.append(LoggedToken(text, offset, logprob))
        offset += len(text)
    return out


@dataclass(frozen=True)
class Echo:
    """An echoed prompt: its text and, with logprobs, its tokens' likelihood estimates."""

    text: str
    logged: Optional[list[LoggedToken]]


class ChoiceOutput:
    """One choice's text as its deltas arrive; `take()` gives what may be sent now.

    The response ends at the first end token, the first stop string or after `max_tokens` tokens
    (the engine's canvas is whole blocks, so it may hold more: they are cut here, finish_reason
    "length"). With `logprobs`, each kept token's logprobs are logged, and `take_logprobs()` gives
    those of the tokens whose text has been taken."""

    def __init__(self, index: int, request_id: str, prompt_ids: Sequence[int], tokenizer: Optional[Any],
                 end_ids: Collection[int], stops: Sequence[str], max_tokens: Optional[int] = None,
                 logprobs: bool = False, first_of_prompt: bool = True) -> None:
        self.index = index
        self.first_of_prompt = first_of_prompt  # the prompt's tokens are counted with this choice only
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.end_ids = end_ids
        self.stops = [s for s in stops if s]
        self.max_tokens = max_tokens
        self.text = ""
        self.sent = 0
        self.ended = False  # an end token, a stop string or max_tokens was reached: nothing after it counts
        self.end_generated = False  # the response ended at an end token the model generated (it counts)
        self.stopped_by_string = False
        self.cut_at_max_tokens = False
        self.logged: Optional[list[LoggedToken]] = [] if logprobs else None
        self._logged_sent = 0
        self.echo: Optional[Echo] = None  # the prompt, when the request asked for it back
        self.result: Optional[GenerationResult] = None
        self.summary_at_stop: Optional[Any] = None  # the decoding summary when the output path ended it
        self.finish_reason: Optional[str] = None
        self.joules: Optional[float] = None
        self.completion_count = 0  # set when the choice finishes (server.serving)
        self.cached_tokens = 0  # its prompt tokens the engine restored from its prefix cache
        self._searched = 0  # text before this index holds no stop string

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> list[int]:
        return self.detokenizer.ids

    def add(self, ids: Sequence[int], logprobs: Sequence[TokenLogprob] = ()) -> None:
        if self.ended:
            return
        end: Optional[int] = None  # where an end token cuts the response
        cut = next((i for i, t in enumerate(ids) if t in self.end_ids), None)
        if cut is not None:
            end, ids, self.ended = cut, ids[:cut], True
        # as in vLLM, the end token counts as a token: a response of max_tokens tokens never gets it
        wanted = len(self.token_ids) + len(ids) + (end is not None)
        if self.max_tokens is not None and (wanted > self.max_tokens or
                                            (wanted == self.max_tokens and end is None)):
            self.cut_at_max_tokens = True
            ids, self.ended, end = ids[:self.max_tokens - len(self.token_ids)], True, None
        self.end_generated = end is not None
        if self.logged is not None:
            # the end token is logged too (a client scoring max_tokens: 1 expects that many entries)
            self._log(ids, logprobs[:len(ids)])
            if end is not None and end < len(logprobs):
                self._log([logprobs[end].token_id], [logprobs[end]])
        self.detokenizer.add(ids)
        if self.ended:
            self.detokenizer.flush()
        self._update_text()

    def _update_text(self) -> None:
        text = self.detokenizer.text
        if self.stops:
            longest = max(map(len, self.stops))
            at = find_stop(text, self.stops, max(0, self._searched - longest + 1))
            self._searched = len(text)
            if at >= 0:
                text, self.ended, self.stopped_by_string = text[:at], True, True
        self.text = text

    def _log(self, ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> None:
        assert self.logged is not None
        offset = self.logged[-1].offset + len(self.logged[-1].text) if self.logged else 0
        self.logged.extend(logged_tokens(self.tokenizer, ids, logprobs, offset))

    def token_text(self, token: int) -> str:
        return token_text(self.tokenizer, token)

    def finish(self, result: Optional[GenerationResult], joules: Optional[float] = None) -> None:
        """The engine finished the row (result), or a stop string or max_tokens ended it early (None)."""
        self.result = result
        self.joules = joules
        if not self.ended:
            self.detokenizer.flush()
            self._update_text()
        self.ended = True
        self.finish_reason = finish_reason_of(result.finish_reason if result else "stop", self.stopped_by_string,
                                              self.cut_at_max_tokens)

    def finish_unstarted(self) -> None:
        """max_tokens 0: nothing is generated, the response ends at once ("length")."""
        self.cut_at_max_tokens = True
        self.finish(None)

    @property
    def stopped_early(self) -> bool:
        """The response ended before the engine finished the row: its row can be freed now."""
        return self.stopped_by_string or self.cut_at_max_tokens

    def take_logprobs(self) -> list[LoggedToken]:
        """Logged tokens not given out yet whose text starts inside what has been taken (all that
        the response keeps once it has finished)."""
        if self.logged is None:
            return []
        limit = len(self.text) if self.finished else self.sent
        end = self._logged_sent
        while end < len(self.logged) and (self.logged[end].offset < limit or
                                          (self.finished and not self.stopped_by_string)):
            end += 1
        piece, self._logged_sent = self.logged[self._logged_sent:end], end
        return piece

    def take(self) -> str:
        """Text not sent yet that can no longer change."""
        limit = len(self.text) if self.ended else len(self.text) - held_back(self.text, self.stops)
        if limit <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent:limit], limit
        return piece

    @property
    def generated_count(self) -> int:
        """Tokens generated so far, the end token included once it comes (as vLLM counts them)."""
        return len(self.token_ids) + self.end_generated

    def completion_tokens(self, count_text: Any) -> int:
        """Tokens of the response: the generated ones and the end token, or, when a stop string cut
        the text, the text re-encoded (`count_text(text)`)."""
        if self.stopped_by_string:
            return count_text(self.text)
        return self.generated_count
