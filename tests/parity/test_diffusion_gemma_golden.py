"""The official `generate()` loop of DiffusionGemma (transformers 5.23.0) replayed on our model's
forwards against the golden runs in `diffusion_gemma/golden/`, token for token and step for step,
with the random draws the fixture recorded (the official loop draws the canvas, the samples and the
renoise tokens from one global generator: section 4.2 of the fixture README).

The loop is `tinymodels.dg_reference.generate`, a reference of the official one (not the product):
this test says the model is right for whole runs (every decision of the entropy-bound sampler and of
the stop rule depends on the logits) and that the reference loop is the official one, which makes it
the loop the engine's uniform-noise decoding mode is checked against and the one the built-in
model's held-out accuracy is measured with (tinymodels/dg_evaluate.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES

from engine import load_model
from engine.models.diffusion_gemma import DiffusionGemmaModel
from tinymodels.dg_reference import CanvasReport, OfficialSettings, StepReport, generate

ENTROPY_ATOL = 1e-3  # the official float32 entropies vs ours (every recorded decision has a larger margin)

GOLDEN = sorted(FIXTURES.glob("diffusion_gemma/golden/*.json"))


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def model(fixtures, request) -> DiffusionGemmaModel:
    loaded = load_model(fixtures / "diffusion_gemma" / "dg_tiny", device=request.param)
    assert isinstance(loaded, DiffusionGemmaModel)
    return loaded


class RecordedDraws:
    """The recorded draws, taken in the official call order (`engine.decoding.draws.Draws`)."""

    def __init__(self, draws: list[dict[str, Any]], device: torch.device) -> None:
        self._draws: Iterator[dict[str, Any]] = iter(draws)
        self.device = device
        self.taken = 0

    def _take(self, fn: str, shape: tuple[int, ...]) -> torch.Tensor:
        draw = next(self._draws)
        self.taken += 1
        assert draw["fn"] == fn, f"draw {self.taken - 1} is a {draw['fn']}, the loop wants a {fn}"
        return torch.tensor(draw["values"], dtype=torch.long, device=self.device).view(shape)

    def canvas(self, shape: tuple[int, int]) -> torch.Tensor:
        return self._take("randint", shape)

    def samples(self, probabilities: torch.Tensor) -> torch.Tensor:
        return self._take("multinomial", tuple(probabilities.shape[:-1]))

    renoise = canvas


def replay(model: DiffusionGemmaModel, run: dict[str, Any]) -> dict[str, Any]:
    """Run the reference loop on `run`'s prompt, settings and draws; check every step against the
    record on the way; return the outputs."""
    settings = OfficialSettings.from_generation_config(run["effective_generation_config"])
    assert model.canvas_length == run["settings"]["canvas_length"]
    device = model.device
    draws = RecordedDraws(run["draws"], device)
    mask = None if run["attention_mask"] is None else torch.tensor(run["attention_mask"], device=device)
    given = run["given_decoder_input_ids"]

    def check_step(step: StepReport) -> None:
        record = run["canvases"][step.canvas_index]["steps"][step.step - 1]
        where = f"canvas {step.canvas_index} step {step.step}"
        assert step.temperature is not None
        assert step.temperature.item() == torch.tensor(record["temperature"], dtype=torch.float32).item(), where
        assert step.canvas_in.tolist() == record["canvas_in"], f"{where}: canvas_in"
        torch.testing.assert_close(step.entropy.cpu(), torch.tensor(record["entropy"]), atol=ENTROPY_ATOL, rtol=0)
        assert step.accepted.long().tolist() == record["accepted"], f"{where}: accepted"
        if settings.adaptive_stop:
            assert step.finished.tolist() == record["finished_denoising_out"], f"{where}: stop"
        assert step.argmax.tolist() == record["argmax"], f"{where}: argmax"

    def check_canvas(canvas: CanvasReport) -> None:
        record = run["canvases"][canvas.canvas_index]
        assert canvas.steps == record["n_steps"]
        assert canvas.committed.tolist() == record["finalize"]["committed_argmax_canvas"]
        assert canvas.after_finalize.tolist() == record["finalize"]["canvas_after_finalize"]

    out = generate(model, torch.tensor(run["input_ids"], device=device), settings, draws, attention_mask=mask,
                   first_canvas=None if given is None else torch.tensor(given, device=device),
                   on_step=check_step, on_canvas=check_canvas)
    assert len(out.steps_per_canvas) == len(run["canvases"]) and draws.taken == len(run["draws"])
    return {"generated": out.tokens.tolist(), "tokens_per_forward": out.tokens_per_forward.tolist(),
            "passes": out.passes.tolist()}


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_run(model, path: Path) -> None:
    run = json.loads(path.read_text())
    ours = replay(model, run)
    assert ours["generated"] == run["output"]["generated"]
    assert ours["passes"] == run["counts"]["decoder_passes_per_row_official"]
    official = torch.tensor([int(h, 16) for h in run["output"]["tokens_per_forward_f32_hex"]], dtype=torch.int32)
    assert torch.equal(torch.tensor(ours["tokens_per_forward"], dtype=torch.float32).view(torch.int32), official)
