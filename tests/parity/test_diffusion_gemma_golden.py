"""The official `generate()` loop of DiffusionGemma (transformers 5.23.0) replayed on our model's
forwards against the golden runs in `diffusion_gemma/golden/`, token for token and step for step,
with the random draws the fixture recorded (the official loop draws the canvas, the samples and the
renoise tokens from one global generator: section 4.2 of the fixture README).

`replay` below is a test oracle, not the product: it says the model is right for whole runs (every
decision of the entropy-bound sampler and of the stop rule depends on the logits), and it is the
reference loop the engine's uniform-noise decoding mode is checked against. It follows the fixture
README's section 5.4-5.5 (temperature schedule, entropy-bound acceptance, renoising, frozen stopped
rows, stable-and-confident stop, argmax commit, eos/pad handling, tokens_per_forward)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES

from engine import load_model
from engine.models.diffusion_gemma import DiffusionGemmaModel

ENTROPY_ATOL = 1e-3  # the official float32 entropies vs ours (every recorded decision has a larger margin)

GOLDEN = sorted(FIXTURES.glob("diffusion_gemma/golden/*.json"))


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def model(fixtures, request) -> DiffusionGemmaModel:
    loaded = load_model(fixtures / "diffusion_gemma" / "dg_tiny", device=request.param)
    assert isinstance(loaded, DiffusionGemmaModel)
    return loaded


class _Draws:
    """The recorded draws, taken in the official call order."""

    def __init__(self, draws: list[dict[str, Any]], device: torch.device) -> None:
        self._draws: Iterator[dict[str, Any]] = iter(draws)
        self.device = device
        self.taken = 0

    def take(self, fn: str, shape: tuple[int, int]) -> torch.Tensor:
        draw = next(self._draws)
        self.taken += 1
        assert draw["fn"] == fn, f"draw {self.taken - 1} is a {draw['fn']}, the loop wants a {fn}"
        return torch.tensor(draw["values"], dtype=torch.long, device=self.device).view(shape)


def _as_list(value: Any) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def replay(model: DiffusionGemmaModel, run: dict[str, Any]) -> dict[str, Any]:
    """Run the official loop on `run`'s prompt, settings and draws; check every step against the
    record on the way; return the outputs."""
    gen = run["effective_generation_config"]
    batch, canvas_length = run["settings"]["batch_size"], model.canvas_length
    assert canvas_length == run["settings"]["canvas_length"]
    steps_max, bound = gen["max_denoising_steps"], gen["sampler_config"]["entropy_bound"]
    stability, confidence = gen["stability_threshold"], gen["confidence_threshold"]
    adaptive = stability is not None and confidence is not None
    device = model.device
    eos, pad = torch.tensor(_as_list(gen["eos_token_id"]), device=device), gen["pad_token_id"]
    shape = (batch, canvas_length)
    draws = _Draws(run["draws"], device)
    prompt = torch.tensor(run["input_ids"], device=device)
    canvases_max = math.ceil(gen["max_new_tokens"] / canvas_length)
    cache = model.new_cache(batch, prompt.shape[1] + canvases_max * canvas_length)
    to_encode = prompt
    encode_mask = None if run["attention_mask"] is None else torch.tensor(run["attention_mask"], device=device)
    finished_sequences = torch.zeros(batch, dtype=torch.bool, device=device)
    passes = torch.zeros(batch, dtype=torch.long, device=device)
    generated: list[torch.Tensor] = []
    for index in range(canvases_max):
        record = run["canvases"][index]
        model.encode(to_encode, cache, attention_mask=encode_mask)
        canvas = draws.take("randint", shape)
        if index == 0 and run["given_decoder_input_ids"] is not None:
            # the draw above is made and discarded
            canvas = torch.tensor(run["given_decoder_input_ids"], device=device)
        argmax, soft = canvas, None
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        history = torch.full((max(stability or 0, 0), *shape), -1, dtype=torch.long, device=device)
        done_steps = 0
        for cur_step in range(steps_max, 0, -1):
            step = record["steps"][done_steps]
            done_steps += 1
            passes += ~(finished | finished_sequences)
            temperature = gen["t_min"] + (gen["t_max"] - gen["t_min"]) * (
                torch.tensor(cur_step, dtype=torch.int32) / steps_max)
            assert temperature.item() == torch.tensor(step["temperature"], dtype=torch.float32).item()
            assert canvas.tolist() == step["canvas_in"], f"canvas {index} step {done_steps}: canvas_in"
            scaled = model.decode(canvas, cache, self_conditioning=soft) / temperature
            sampled = draws.take("multinomial", shape)
            entropy = torch.distributions.Categorical(logits=scaled).entropy()
            torch.testing.assert_close(entropy.cpu(), torch.tensor(step["entropy"]), atol=ENTROPY_ATOL, rtol=0)
            ascending, order = entropy.sort(dim=-1)
            accepted = torch.zeros(shape, dtype=torch.bool, device=device).scatter(
                -1, order, ascending.cumsum(-1) - ascending <= bound)
            assert accepted.long().tolist() == step["accepted"], f"canvas {index} step {done_steps}: accepted"
            new_canvas = torch.where(accepted, sampled, draws.take("randint", shape))
            new_argmax, new_soft = scaled.argmax(-1), model.soft_embeddings(scaled)
            if adaptive:  # stopped rows keep their canvas, argmax and self-conditioning input
                new_argmax = torch.where(finished[:, None], argmax, new_argmax)
                new_canvas = torch.where(finished[:, None], canvas, new_canvas)
                if soft is not None:
                    new_soft = torch.where(finished[:, None, None], soft, new_soft)
                stable = (history == new_argmax).all(-1).all(0)
                history = torch.cat((history[1:], new_argmax[None]))[:len(history)]
                finished = finished | (stable & (entropy.mean(-1) < confidence))
                assert finished.tolist() == step["finished_denoising_out"], f"canvas {index} step {done_steps}: stop"
            assert new_argmax.tolist() == step["argmax"], f"canvas {index} step {done_steps}: argmax"
            canvas, argmax, soft = new_canvas, new_argmax, new_soft
            if finished.all():
                break
        assert done_steps == record["n_steps"]
        committed = argmax.clone()
        assert committed.tolist() == record["finalize"]["committed_argmax_canvas"]
        if len(eos) and pad is not None:
            is_eos = torch.isin(committed, eos)
            committed[finished_sequences] = pad
            seen = is_eos.cumsum(-1)
            committed[(seen > 0) & ~((seen == 1) & is_eos)] = pad  # every token after the first eos
            finished_sequences = finished_sequences | is_eos.any(-1)
        assert committed.tolist() == record["finalize"]["canvas_after_finalize"]
        generated.append(committed)
        if finished_sequences.all():
            break
        to_encode, encode_mask = committed, None
    assert len(generated) == len(run["canvases"]) and draws.taken == len(run["draws"])
    tokens = torch.cat(generated, dim=1)
    valid = (tokens != pad).sum(-1) if pad is not None else torch.full((batch,), tokens.shape[1], device=device)
    return {"generated": tokens.tolist(), "tokens_per_forward": (valid / passes).float().tolist(),
            "passes": passes.tolist()}


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_run(model, path: Path) -> None:
    run = json.loads(path.read_text())
    ours = replay(model, run)
    assert ours["generated"] == run["output"]["generated"]
    assert ours["passes"] == run["counts"]["decoder_passes_per_row_official"]
    official = torch.tensor([int(h, 16) for h in run["output"]["tokens_per_forward_f32_hex"]], dtype=torch.int32)
    assert torch.equal(torch.tensor(ours["tokens_per_forward"], dtype=torch.float32).view(torch.int32), official)
