"""/v1/chat/completions: messages through the checkpoint's chat template; the chat logprobs object;
chunks that open with the assistant's role."""

from __future__ import annotations

from typing import Any, Optional

from engine.chat import chat_prompt_ids
from server.engine_loop import EngineLoop
from server.errors import APIError
from server.output import ChoiceOutput, LoggedToken
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    TokenLogprobEntry,
    TopLogprob,
    Usage,
    now,
)
from server.serving_base import CHAT_TEMPLATE_ERROR, LOGPROBS_REQUIRED, ServingBase


def chat_ids(loop: EngineLoop, chat: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    """The token ids of `chat` rendered by the checkpoint's chat template."""
    tokenizer = loop.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in chat]
    try:
        return chat_prompt_ids(tokenizer, messages, add_generation_prompt=add_generation_prompt, mask_id=loop.mask_id)
    except Exception as err:  # the checkpoint's template refused these messages
        raise APIError(400, f"the chat template cannot render these messages: {err}", param="messages",
                       code=CHAT_TEMPLATE_ERROR) from None


def chat_logprobs(choice: ChoiceOutput, logged: list[LoggedToken]) -> Optional[ChatLogprobs]:
    """The chat `logprobs` object of these tokens (None when not asked for)."""
    if choice.logged is None:
        return None

    def top(text: str, value: float) -> dict[str, Any]:
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return ChatLogprobs(content=[TokenLogprobEntry(
        **top(e.text, e.logprob.logprob),
        top_logprobs=[TopLogprob(**top(choice.token_text(t), v)) for t, v in e.logprob.top])
        for e in logged if e.logprob is not None])


class ChatServing(ServingBase):
    prompt_field = "messages"
    logprobs_field = "top_logprobs"
    id_prefix = "chatcmpl"
    chunk_type = ChatCompletionChunk

    def prompts(self, body: Any) -> list[list[int]]:
        return [chat_ids(self.loop, body.messages, add_generation_prompt=True)]

    def logprobs_asked(self, body: Any) -> Optional[int]:
        if body.logprobs:
            return body.top_logprobs or 0
        if body.top_logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code=LOGPROBS_REQUIRED)
        return None

    def response(self, response_id: str, choices: list[ChoiceOutput], usage: Usage) -> Any:
        return ChatCompletionResponse(
            id=response_id, created=now(), model=self.settings.model_name, usage=usage,
            choices=[ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                                finish_reason=c.finish_reason, logprobs=chat_logprobs(c, c.take_logprobs()),
                                decoding=self.summary(c)) for c in choices])

    def opening_chunks(self, response_id: str, created: int, choices: list[ChoiceOutput]) -> list[Any]:
        """Each choice's first chunk: the assistant's role and no text, as OpenAI's streams open."""
        return [ChatCompletionChunk(id=response_id, created=created, model=self.settings.model_name, choices=[
            ChatStreamChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))]) for c in choices]

    def chunk(self, response_id: str, created: int, choice: ChoiceOutput, text: Optional[str], last: bool,
              usage: Optional[Usage]) -> Any:
        logged = choice.take_logprobs()
        return ChatCompletionChunk(id=response_id, created=created, model=self.settings.model_name, usage=usage,
                                   choices=[ChatStreamChoice(
                                       index=choice.index, delta=ChatDelta(content=text),
                                       finish_reason=choice.finish_reason if last else None,
                                       decoding=self.summary(choice) if last else None,
                                       logprobs=chat_logprobs(choice, logged) if logged else None)])
