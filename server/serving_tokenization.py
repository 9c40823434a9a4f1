"""vLLM's /tokenize, /detokenize and /tokenizer_info: the ids the generating endpoints would decode
from, and what a client needs to tokenize as the server does (lm-eval's remote tokenizer reads it)."""

from __future__ import annotations

from typing import Union

from engine.user_text import encode_prompt_text
from server.engine_loop import EngineLoop
from server.errors import APIError
from server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from server.serving_base import check_model
from server.serving_chat import chat_ids


class TokenizationServing:
    def __init__(self, loop: EngineLoop, model_name: str) -> None:
        self.loop = loop
        self.model_name = model_name

    def tokenize(self, body: Union[TokenizeCompletionRequest, TokenizeChatRequest]) -> TokenizeResponse:
        check_model(body.model, self.model_name)
        tokenizer = self.loop.tokenizer
        if isinstance(body, TokenizeChatRequest):
            ids = chat_ids(self.loop, body.messages, body.add_generation_prompt)
        else:
            if tokenizer is None:
                raise APIError(400, "this model has no tokenizer", param="prompt")
            ids = encode_prompt_text(tokenizer, body.prompt, self.loop.mask_id)
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs and tokenizer is not None else None
        return TokenizeResponse(count=len(ids), max_model_len=self.loop.max_model_len, tokens=ids, token_strs=strs)

    def tokenizer_info(self) -> TokenizerInfo:
        tokenizer = self.loop.tokenizer
        if tokenizer is None:
            raise APIError(404, "this model has no tokenizer", code="not_found")
        return TokenizerInfo(tokenizer_class=type(tokenizer).__name__, eos_token=tokenizer.eos_token,
                             bos_token=tokenizer.bos_token, pad_token=tokenizer.pad_token,
                             chat_template=getattr(tokenizer, "chat_template", None),
                             model_max_length=self.loop.max_model_len)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model, self.model_name)
        if self.loop.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        vocab = self.loop.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=self.loop.tokenizer.decode(body.tokens))
