"""The built-in LLaDA2-format model (MoE, block diffusion) served by the real server answers the
README's two curl requests (its name in `model`), chat and plain, with the worked result, by its
default decoding and by LLaDA2.1's token editing (`block-edit`)."""

from __future__ import annotations

import httpx
import pytest
from serverproc import REPO, readme_curls, running_server

from tinymodels.checker import is_correct

pytestmark = pytest.mark.slow
MODEL = REPO / "models" / "llada2-tiny"


@pytest.mark.skipif(not (MODEL / "model.safetensors").is_file(), reason="the built-in model is not in this tree")
def test_the_readme_curls_are_answered_by_the_llada2_built_in():
    curls = readme_curls()
    assert {path for path, _ in curls} == {"/v1/chat/completions", "/v1/completions"}
    with running_server("--model", str(MODEL)) as (base, _):
        for decoding in (None, {"policy": "block-edit"}):
            for path, body in curls:
                request = {**body, "model": MODEL.name, **({"decoding": decoding} if decoding else {})}
                reply = httpx.post(base + path, json=request, timeout=120).json()
                choice = reply["choices"][0]
                text = choice["message"]["content"] if "messages" in body else choice["text"]
                question = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
                assert is_correct(question, text), (decoding, question, text)
                assert choice["finish_reason"] == "stop"
