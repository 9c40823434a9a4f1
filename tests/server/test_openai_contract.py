"""The contract OpenAI and vLLM clients expect, on the real server with the real `openai` client:
max_tokens as a ceiling, vLLM's sampling fields, logprobs (whole and streamed), echo and likelihood
scoring, /tokenize, /detokenize, /tokenizer_info, models/{id}, CORS and --chat-template."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from serverproc import running_server

pytestmark = pytest.mark.slow
ORIGIN = "http://dashboard.example"
CHAT = [{"role": "user", "content": "00457+00038"}]
PROMPT = "<|user|>00457+00038<|assistant|>"
ANSWER = "7+8+0=15;5+3+1=09;4+0+0=04;0+0+0=00;0+0+0=00;=000495"  # what llada-tiny answers, 52 tokens


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with running_server("--allowed-origins", json.dumps([ORIGIN]),
                        "--default-decoding", json.dumps({"score_samples": 4})) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_max_tokens_is_a_ceiling(client):
    whole = client.completions.create(model="llada-tiny", prompt=PROMPT, max_tokens=128)
    assert whole.choices[0].text == ANSWER and whole.choices[0].finish_reason == "stop"
    cut = client.completions.create(model="llada-tiny", prompt=PROMPT, max_tokens=40)  # a canvas of 64
    assert cut.choices[0].text == ANSWER[:40] and cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens == 40
    pieces = list(client.completions.create(model="llada-tiny", prompt=PROMPT, max_tokens=40, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == ANSWER[:40]
    assert pieces[-1].choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="llada-tiny", messages=CHAT, max_completion_tokens=10)
    assert len(chat.choices[0].message.content) == 10 and chat.choices[0].finish_reason == "length"


def test_a_plain_completion_is_answered_as_the_chat_form(client):
    # the bare problem text, as a /v1/completions user sends it: no chat template around it
    plain = client.completions.create(model="llada-tiny", prompt="00457+00038", max_tokens=128)
    assert plain.choices[0].text == ANSWER and plain.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model="llada-tiny", messages=CHAT)
    assert chat.choices[0].message.content == ANSWER


def test_vllm_sampling_fields_are_taken(client, server):
    extra = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.0, "presence_penalty": 0, "logit_bias": {}}
    out = client.completions.create(model="llada-tiny", prompt=PROMPT, max_tokens=64, extra_body=extra)
    assert out.choices[0].text == ANSWER  # greedy: the filters keep the best token
    forced = client.completions.create(model="llada-tiny", prompt=PROMPT, max_tokens=64,
                                       extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.choices[0].text.startswith(ANSWER)
    assert forced.usage.completion_tokens == 64
    # top_k 1 leaves one token to sample: every seed gives the same text (confidences are of the
    # filtered distribution, as in Dream, so the commit order may differ from unfiltered greedy)
    texts = {client.completions.create(model="llada-tiny", prompt=PROMPT, max_tokens=64, temperature=1.0, seed=seed,
                                       extra_body={"top_k": 1}).choices[0].text for seed in (1, 2, 3)}
    assert len(texts) == 1
    # JSON Schema's integers include 7.0; content may be null or text parts
    body = {"prompt": PROMPT, "max_tokens": 7.0, "n": 1.0, "seed": 3.0}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 7
    messages = [{"role": "system", "content": None},
                {"role": "user", "content": [{"type": "text", "text": "00457+00038"}]}]
    response = httpx.post(f"{server}/v1/chat/completions", json={"messages": messages}, timeout=60)
    # null content is the empty text, and text parts are the text (the tiny model never saw a
    # system turn, so its answer is compared with the same chat written out, not with ANSWER)
    written = [{"role": "system", "content": ""}, {"role": "user", "content": "00457+00038"}]
    same = httpx.post(f"{server}/v1/chat/completions", json={"messages": written}, timeout=60)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == same.json()["choices"][0]["message"]["content"]
    parts = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": [{"type": "text", "text": "00457+00038"}]}]})
    assert parts.json()["choices"][0]["message"]["content"] == ANSWER


@pytest.mark.parametrize("field,value", [("presence_penalty", 0.5), ("frequency_penalty", -1),
                                         ("repetition_penalty", 1.2), ("best_of", 2), ("logit_bias", {"5": 1})])
def test_non_neutral_values_of_unimplemented_fields_are_refused_by_name(server, field, value):
    response = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPT, field: value}, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field and error["code"] == "unsupported_parameter"
    assert "not supported" in error["message"]


def test_completion_logprobs_whole_and_streamed(client):
    whole = client.completions.create(model="llada-tiny", prompt=PROMPT, max_tokens=64, logprobs=3).choices[0]
    lp = whole.logprobs
    # the text's tokens, then the end token that ended it (as vLLM reports it; not in the text)
    assert "".join(lp.tokens[:-1]) == whole.text == ANSWER and lp.tokens[-1] == "<|end|>"
    assert lp.text_offset == list(range(len(ANSWER) + 1))
    assert all(v <= 0 for v in lp.token_logprobs)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == value and max(top.values()) == value and len(top) <= 4  # greedy
    tokens, values = [], []
    for chunk in client.completions.create(model="llada-tiny", prompt=PROMPT, max_tokens=64, logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
    assert tokens == lp.tokens and values == lp.token_logprobs


def test_chat_logprobs_whole_and_streamed(client):
    whole = client.chat.completions.create(model="llada-tiny", messages=CHAT, logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert "".join(e.token for e in content[:-1]) == ANSWER and content[-1].token == "<|end|>"
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob for e in content)
    assert content[0].bytes == list(content[0].token.encode())
    streamed = []
    for chunk in client.chat.completions.create(model="llada-tiny", messages=CHAT, logprobs=True, top_logprobs=2,
                                                stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="llada-tiny", messages=CHAT, top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"


def test_echo_scores_the_prompt(client):
    scored = client.completions.create(model="llada-tiny", prompt=PROMPT + ANSWER, max_tokens=0, echo=True,
                                       logprobs=1, seed=5).choices[0]
    assert scored.text == PROMPT + ANSWER and scored.finish_reason == "length"
    lp = scored.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(lp.token_logprobs) == 13 + len(ANSWER)  # two markers, 11 characters, the answer
    again = client.completions.create(model="llada-tiny", prompt=PROMPT + ANSWER, max_tokens=0, echo=True,
                                      logprobs=1, seed=5).choices[0]
    assert again.logprobs.token_logprobs == lp.token_logprobs  # seeded
    wrong = ANSWER.replace("495", "594")
    other = client.completions.create(model="llada-tiny", prompt=PROMPT + wrong, max_tokens=0, echo=True,
                                      logprobs=1, seed=5).choices[0]
    assert sum(lp.token_logprobs[13:]) > sum(other.logprobs.token_logprobs[13:])
    # lm-eval's request: one generated token after the echoed prompt, streamed the same way
    lm_eval_style = client.completions.create(model="llada-tiny", prompt=PROMPT, max_tokens=1, echo=True, logprobs=1,
                                              temperature=0).choices[0]
    assert len(lm_eval_style.logprobs.tokens) == 14 and lm_eval_style.text.startswith(PROMPT)
    chunks = list(client.completions.create(model="llada-tiny", prompt=PROMPT, max_tokens=1, echo=True, logprobs=1,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == lm_eval_style.text


def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(model="llada-tiny", prompt=PROMPT, max_tokens=64, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == len(ANSWER) + 1  # the end token counts
    assert chunks[-1].usage.completion_tokens == len(ANSWER) + 1 and not chunks[-1].choices


def test_completion_tokens_count_the_end_token_as_the_logprobs_do(client):
    for stream in (False, True):
        out = client.completions.create(model="llada-tiny", prompt=PROMPT, max_tokens=128, logprobs=1, stream=stream,
                                        **({"stream_options": {"include_usage": True}} if stream else {}))
        chunks = list(out) if stream else [out]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        usage = chunks[-1].usage
        assert text == ANSWER and tokens[-1] == "<|end|>"
        assert usage.completion_tokens == len(tokens) == len(ANSWER) + 1


def test_tokenize_detokenize_tokenizer_info_and_model_retrieve(client, server):
    tokens = httpx.post(f"{server}/tokenize", json={"prompt": "0457", "return_token_strs": True}).json()
    assert tokens["count"] == 4 and tokens["token_strs"] == list("0457") and tokens["max_model_len"] > 0
    chat = httpx.post(f"{server}/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] == 13  # the template's two markers around the eleven characters
    back = httpx.post(f"{server}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": "0457"}
    both = httpx.post(f"{server}/tokenize", json={"prompt": "x", "messages": CHAT})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
    info = httpx.get(f"{server}/tokenizer_info").json()
    assert info["eos_token"] and "<|assistant|>" in info["chat_template"]
    assert client.models.retrieve("llada-tiny").id == "llada-tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_cors_for_named_origins_only(server):
    asked = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "content-type"}
    preflight = httpx.options(f"{server}/v1/completions", headers=asked)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    stranger = httpx.options(f"{server}/v1/completions", headers={**asked, "Origin": "http://elsewhere.example"})
    assert "access-control-allow-origin" not in stranger.headers


def test_chat_template_override_and_cors_off_by_default(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<|user|>{{ m['content'] }} please{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    with running_server("--chat-template", str(template)) as (base, _):
        ids = httpx.post(f"{base}/tokenize", json={"messages": CHAT}).json()["tokens"]
        text = httpx.post(f"{base}/detokenize", json={"tokens": ids}).json()["prompt"]
        assert "00457+00038 please" in text
        response = httpx.post(f"{base}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4},
                              headers={"Origin": ORIGIN})
        assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
