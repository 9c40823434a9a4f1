"""--max-decode-steps on a real server: a choice that may take more decode steps is refused with a 400
naming the field that sets its step count; one within the cap, or decoding nothing, is served."""

from __future__ import annotations

import httpx
import pytest
from serverproc import running_server

pytestmark = pytest.mark.slow
PROMPT = "<|user|>00457+00038<|assistant|>"
CAP = 64


def test_requests_over_the_step_cap_get_a_400_naming_the_field():
    with running_server("--max-decode-steps", str(CAP)) as (base, _):
        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(f"{base}{path}", json=body, timeout=120)

        refused = {  # body -> the field named
            "max_tokens": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 128, "decoding": {"policy": "fixed"}}),
            "decoding.steps": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 128, "decoding": {"steps": 128}}),
            "max_completion_tokens": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1+1"}],
                                                               "max_completion_tokens": 100}),
            # threshold commits at least a token a step: one step per canvas token, whatever `steps` says
            "max_tokens ": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 128,
                                                "decoding": {"policy": "threshold", "steps": 64}}),
        }
        for field, (path, body) in refused.items():
            response = post(path, body)
            assert response.status_code == 400, (field, response.text)
            error = response.json()["error"]
            assert error["code"] == "decode_steps_exceeded" and error["param"] == field.strip()
            assert "--max-decode-steps" in error["message"] and "128" in error["message"]
        served = [("/v1/completions", {"prompt": PROMPT, "max_tokens": 128, "decoding": {"steps": CAP}}),
                  ("/v1/completions", {"prompt": PROMPT, "max_tokens": CAP, "n": 2}),
                  ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1,
                                       "decoding": {"score_samples": 2}})]
        for path, body in served:
            response = post(path, body)
            assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["logprobs"]["tokens"]  # the echoed prompt, scored
