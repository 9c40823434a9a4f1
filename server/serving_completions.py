"""/v1/completions: prompts as text, token ids or lists of either; `echo` (with logprobs, the prompt's
likelihood estimates: lm-evaluation-harness's loglikelihood requests); the legacy logprobs object."""

from __future__ import annotations

from typing import Any, Optional

from engine import RequestError
from engine.decoding import DecodeParams
from engine.decoding.types import TokenLogprob
from engine.user_text import encode_prompt_text
from server.errors import APIError, QueueFull, ShuttingDown, engine_error
from server.output import ChoiceOutput, Echo, LoggedToken, logged_tokens
from server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage, now
from server.serving_base import ServingBase


def completion_logprobs(choice: ChoiceOutput, logged: list[LoggedToken], echoed: Optional[list[LoggedToken]] = None,
                        shift: int = 0) -> Optional[CompletionLogprobs]:
    """The legacy completions `logprobs` object of these tokens, after the echoed prompt's when given,
    the generated tokens' offsets moved past the prompt text by `shift` (None when not asked for)."""
    if choice.logged is None:
        return None
    entries = [*(echoed or []), *(LoggedToken(e.text, e.offset + shift, e.logprob) for e in logged)]
    tops: list[Optional[dict[str, float]]] = []
    for entry in entries:
        if entry.logprob is None:
            tops.append(None)
            continue
        top = {choice.token_text(token): value for token, value in entry.logprob.top}
        top.setdefault(entry.text, entry.logprob.logprob)
        tops.append(top)
    return CompletionLogprobs(tokens=[e.text for e in entries],
                              token_logprobs=[None if e.logprob is None else e.logprob.logprob for e in entries],
                              top_logprobs=tops, text_offset=[e.offset for e in entries])


class CompletionServing(ServingBase):
    prompt_field = "prompt"
    logprobs_field = "logprobs"
    id_prefix = "cmpl"
    chunk_type = CompletionResponse

    def logprobs_asked(self, body: Any) -> Optional[int]:
        return body.logprobs

    def prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str):
            texts: list[Any] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        else:
            texts = list(prompt)
        if not texts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        prompts = []
        for item in texts:
            if isinstance(item, str):
                if self.loop.tokenizer is None:
                    raise APIError(400, "this model has no tokenizer: send prompts as token ids", param="prompt")
                prompts.append(encode_prompt_text(self.loop.tokenizer, item, self.loop.mask_id))
            else:
                prompts.append(list(item))
        return prompts

    async def prepare(self, body: CompletionRequest, prompts: list[list[int]], params: DecodeParams,
                      choices: list[ChoiceOutput]) -> None:
        """With `echo`: each prompt's text and, with logprobs, its per-token likelihood estimates
        (engine.scoring, run on the engine thread between steps)."""
        if not body.echo:
            return
        tokenizer = self.loop.tokenizer
        echoes = []
        for ids in prompts:
            text = tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))
            if params.logprobs is None:
                echoes.append(Echo(text, None))
                continue
            try:
                scores = await self.loop.score(ids, params.score_samples, body.seed or 0)
            except (RequestError, ShuttingDown, QueueFull) as err:
                raise engine_error(err, "prompt", {"score_samples": "decoding.score_samples", "echo": "echo"},
                                   retry_after=self.loop.retry_after()) from None
            values = [None if v is None else TokenLogprob(t, v) for t, v in zip(ids, scores, strict=True)]
            echoes.append(Echo(text, logged_tokens(tokenizer, ids, values)))
        for choice in choices:
            choice.echo = echoes[choice.index // body.n]

    def response(self, response_id: str, choices: list[ChoiceOutput], usage: Usage) -> Any:
        return CompletionResponse(
            id=response_id, created=now(), model=self.settings.model_name, usage=usage,
            choices=[CompletionChoice(index=c.index, text=(c.echo.text if c.echo else "") + c.text,
                                      finish_reason=c.finish_reason,
                                      logprobs=completion_logprobs(c, c.take_logprobs(), *_echoed(c)),
                                      decoding=self.summary(c)) for c in choices])

    def opening_chunks(self, response_id: str, created: int, choices: list[ChoiceOutput]) -> list[Any]:
        """The echoed prompt of each choice that echoes, in a chunk before its completion's."""
        return [CompletionResponse(id=response_id, created=created, model=self.settings.model_name, choices=[
            CompletionChoice(index=c.index, text=c.echo.text, finish_reason=None,
                             logprobs=completion_logprobs(c, [], c.echo.logged or []))])
            for c in choices if c.echo is not None]

    def chunk(self, response_id: str, created: int, choice: ChoiceOutput, text: Optional[str], last: bool,
              usage: Optional[Usage]) -> Any:
        logged = choice.take_logprobs()
        shift = len(choice.echo.text) if choice.echo else 0
        return CompletionResponse(id=response_id, created=created, model=self.settings.model_name, usage=usage,
                                  choices=[CompletionChoice(
                                      index=choice.index, text=text or "",
                                      finish_reason=choice.finish_reason if last else None,
                                      decoding=self.summary(choice) if last else None,
                                      logprobs=completion_logprobs(choice, logged, shift=shift) if logged else None)])


def _echoed(choice: ChoiceOutput) -> tuple[Optional[list[LoggedToken]], int]:
    """The echoed prompt's logged tokens and the length of its text (what generated offsets move by)."""
    if choice.echo is None:
        return None, 0
    return choice.echo.logged, len(choice.echo.text)
