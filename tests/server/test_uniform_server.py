"""DiffusionGemma's uniform-noise mode served by the real server, driven by real clients: the fixture
checkpoint (random weights) with the built-in character tokenizer, token-id prompts, every answer
compared with `Engine.generate` on the same directory (a seeded request's tokens are its own:
engine/decoding/draws.py). Whole and streamed completions (a canvas streams whole, once committed),
max_tokens off the canvas (cut there), logprobs, usage, and what the mode refuses naming the field
(likelihood scoring included)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import FIXTURES
from serverproc import running_server

from engine import DecodeParams, Engine
from tinymodels import char_tokenizer as chars

pytestmark = pytest.mark.slow
CHECKPOINT = FIXTURES / "diffusion_gemma" / "dg_tiny"
CANVAS = json.loads((CHECKPOINT / "config.json").read_text())["canvas_length"]
FIXTURE_STEPS = json.loads((CHECKPOINT / "generation_config.json").read_text())["max_denoising_steps"]
PROMPT = chars.build_tokenizer().encode("00457+00038").ids  # ids of the tokenizer the copy is served with
MAX_TOKENS = CANVAS + max(1, CANVAS // 4)  # not a multiple of the canvas: two canvases decoded, the rest dropped
DECODING = {"max_denoising_steps": 6}
CHECKPOINT_STEPS = 4  # the copy's generation_config.json max_denoising_steps (below the fixture's)
STEP_CAP = 2 * DECODING["max_denoising_steps"]  # --max-decode-steps: the requests above fit it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("dg") / "dg-tiny"
    shutil.copytree(CHECKPOINT, dest)
    chars.write_tokenizer_files(dest)
    generation = json.loads((dest / "generation_config.json").read_text())
    (dest / "generation_config.json").write_text(json.dumps({**generation, "max_denoising_steps": CHECKPOINT_STEPS}))
    return dest


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[str]:
    with running_server("--model", str(model_dir), "--max-batch", "4", "--max-decode-steps", str(STEP_CAP)) \
            as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oracle(model_dir: Path) -> Engine:
    from engine import EngineConfig

    return Engine(EngineConfig(model=str(model_dir), max_batch=1))


def _expected(oracle: Engine, seed: int) -> list[int]:
    canvas = -(-MAX_TOKENS // oracle.model.canvas_length) * oracle.model.canvas_length
    [result] = oracle.generate([PROMPT], DecodeParams(gen_length=canvas, seed=seed, **DECODING))
    return result.response_ids[:MAX_TOKENS]


def test_a_completion_is_the_engines_cut_at_max_tokens(client, oracle) -> None:
    expected = _expected(oracle, seed=3)
    choice = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       seed=3, logprobs=2, extra_body={"decoding": DECODING}).choices[0]
    assert choice.text == oracle.tokenizer.decode(expected, skip_special_tokens=True)
    assert choice.finish_reason == ("length" if len(expected) == MAX_TOKENS else "stop")
    assert len(choice.logprobs.tokens) == len(expected)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)


def test_the_openai_sdks_default_sampling_fields_are_served(client, oracle) -> None:
    """temperature 1 and top_p 1, as the SDKs and most clients send them, decode as the schedule does."""
    expected = _expected(oracle, seed=4)
    choice = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       seed=4, temperature=1.0, top_p=1.0, extra_body={"decoding": DECODING}).choices[0]
    assert choice.text == oracle.tokenizer.decode(expected, skip_special_tokens=True)


def test_a_stream_brings_whole_canvases_and_the_same_text(server, client, oracle) -> None:
    body = {"model": client.models.list().data[0].id, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "seed": 5,
            "decoding": DECODING, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    expected = _expected(oracle, seed=5)
    assert text == oracle.tokenizer.decode(expected, skip_special_tokens=True)
    deltas = [e for e in events if e["choices"] and e["choices"][0]["text"]]
    assert len(deltas) <= -(-MAX_TOKENS // oracle.model.canvas_length)  # at most one delta a canvas


@pytest.mark.parametrize("extra,param,code", [
    ({"echo": True, "logprobs": 1, "max_tokens": 0}, "echo", "scoring_unsupported"),
    ({"top_p": 0.9}, "top_p", "invalid_decoding"),
    ({"top_k": 5}, "top_k", "invalid_decoding"),
    ({"decoding": {"policy": "cai"}}, "decoding.policy", "invalid_decoding"),
    ({"decoding": {"block_length": CANVAS // 2}}, "decoding.block_length", "invalid_decoding"),  # not the canvas
    ({"decoding": {"entropy_bound": 0}}, "decoding.entropy_bound", "invalid_decoding"),
    ({"decoding": {"cfg_scale": 1.0}}, "decoding.cfg_scale", "invalid_decoding"),
])
def test_what_the_uniform_mode_refuses_names_the_field(server, client, extra, param, code) -> None:
    body = {"model": client.models.list().data[0].id, "prompt": PROMPT, "max_tokens": 8, **extra}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == code


def test_the_step_cap_counts_the_checkpoints_steps_per_canvas(server, client) -> None:
    """--max-decode-steps reads max_denoising_steps as the engine resolves it: the checkpoint's
    generation_config value when the request sets none, the request's when it does."""
    body = {"model": client.models.list().data[0].id, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "seed": 1}
    canvases = -(-MAX_TOKENS // CANVAS)
    # served only if the copy's checkpoint value counts, not the fixture's
    assert canvases * CHECKPOINT_STEPS <= STEP_CAP < canvases * FIXTURE_STEPS
    assert httpx.post(f"{server}/v1/completions", json=body, timeout=120).status_code == 200
    over = {**body, "decoding": {"max_denoising_steps": STEP_CAP // canvases + 1}}
    response = httpx.post(f"{server}/v1/completions", json=over, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("decoding.max_denoising_steps", "decode_steps_exceeded")
