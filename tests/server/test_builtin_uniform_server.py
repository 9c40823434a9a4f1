"""The built-in DiffusionGemma-format model served by the real server answers the README's two curl
requests (its name in `model`, a `seed`: a uniform-noise model samples, and a seeded request's tokens
are its own), chat and plain, with the worked result the README shows."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from serverproc import REPO, running_server

from tinymodels.checker import is_correct

pytestmark = pytest.mark.slow
MODEL = REPO / "models" / "diffusiongemma-tiny"


def readme_curls() -> list[tuple[str, dict]]:
    """(path, JSON body) of each curl of the README's first block that talks to the bundled model."""
    block = next(b for b in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
                 if "curl -s http://127.0.0.1:8000" in b)
    return [(path, json.loads(body)) for path, body in
            re.findall(r"curl -s http://127\.0\.0\.1:8000(\S+) .*?-d '(.*?)'", block, re.S)]


@pytest.mark.skipif(not (MODEL / "model.safetensors").is_file(), reason="the built-in model is not in this tree")
def test_the_readme_curls_are_answered_by_the_diffusion_gemma_built_in():
    curls = readme_curls()
    assert {path for path, _ in curls} == {"/v1/chat/completions", "/v1/completions"}
    with running_server("--model", str(MODEL)) as (base, _):
        for path, body in curls:
            request = {**body, "model": MODEL.name, "seed": 0}
            reply = httpx.post(base + path, json=request, timeout=120).json()
            choice = reply["choices"][0]
            text = choice["message"]["content"] if "messages" in body else choice["text"]
            question = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
            assert is_correct(question, text), (question, text)
            assert choice["finish_reason"] == "stop"
