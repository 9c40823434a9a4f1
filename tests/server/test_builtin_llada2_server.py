"""The built-in LLaDA2-format model (MoE, block diffusion) served by the real server answers the
README's arithmetic with the worked result, by its default decoding and by LLaDA2.1's token editing
(`block-edit`): both README problems as chat messages (the README's chat curl, its name in `model`),
and the addition as a plain completion. The README's plain running total is the one it gets wrong
(one digit, under every decoder: docs/models.md), so it is not asked here."""

from __future__ import annotations

import httpx
import pytest
from serverproc import REPO, readme_curls, running_server

from tinymodels.checker import is_correct

pytestmark = pytest.mark.slow
MODEL = REPO / "models" / "llada2-tiny"


@pytest.mark.skipif(not (MODEL / "model.safetensors").is_file(), reason="the built-in model is not in this tree")
def test_the_readme_arithmetic_is_answered_by_the_llada2_built_in():
    curls = dict(readme_curls())
    chat, plain = curls["/v1/chat/completions"], curls["/v1/completions"]
    problems = [chat["messages"][-1]["content"], plain["prompt"]]
    requests = [("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": q}]}, q) for q in problems]
    requests.append(("/v1/completions", {**plain, "prompt": problems[0]}, problems[0]))
    with running_server("--model", str(MODEL)) as (base, _):
        for decoding in (None, {"policy": "block-edit"}):
            for path, body, question in requests:
                request = {**body, "model": MODEL.name, **({"decoding": decoding} if decoding else {})}
                choice = httpx.post(base + path, json=request, timeout=120).json()["choices"][0]
                text = choice["message"]["content"] if "messages" in body else choice["text"]
                assert is_correct(question, text), (decoding, path, question, text)
                assert choice["finish_reason"] == "stop"
