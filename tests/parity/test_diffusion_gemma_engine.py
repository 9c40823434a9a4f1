"""The engine's uniform-noise mode (engine/uniform_mode.py, policy dg-official) against the golden
runs of the official DiffusionGemma `generate()` in `diffusion_gemma/golden/`.

Each request draws from its own stream, the official loop from one stream for the whole batch
(fixture README section 4.4). So each row of a run is given the recorded draws sliced to it (its
values of every draw, for the steps it ran itself), and the engine, batching the run's rows
together, must produce every row's official tokens and steps per canvas. A batch-of-one run's
stream is also what a seeded request draws: with the run's seed and no replay, the engine gives its
tokens (a seeded request reproduces `torch.manual_seed(seed)` + `generate()`).

Runs the engine cannot express are left out, saying why: a given first canvas (decoder_input_ids),
end ids other than the checkpoint's, left padding (the engine never pads: logits move by up to
2.9e-4, README section 3). Every size, id and setting is read from the fixture files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES

from engine import load_model
from engine.decoding.params import DecodeParams
from engine.engine import Engine
from engine.request import Request

GOLDEN = sorted(FIXTURES.glob("diffusion_gemma/golden/*.json"))
# One run per behaviour, for CI time (tests/parity/test_diffusion_gemma_golden.py checks every run
# through the reference loop): the default settings, a batch of two, the adaptive stop off, an end
# token, the stop rule's other thresholds. Left out here: c8_mnt20 (max_new_tokens; the cut is
# tests/engine/test_uniform_engine.py's), c8_eb0p02 / c8_eb0p5 (other entropy bounds), c8_pair_alone
# (its rows alone: c8_pair_batch2 batches them), c8_stab2. A fixture set without these names runs whole.
REPRESENTATIVE = ("c8_default", "c8_pair_batch2", "c8_conf_none", "c8_eos_natural", "c8_stab0_conf0p05")
ENGINE_RUNS = [p for p in GOLDEN if p.stem in REPRESENTATIVE] or GOLDEN
CHECKPOINT = FIXTURES / "diffusion_gemma" / "dg_tiny"


def _run(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _why_not(run: dict[str, Any]) -> str:
    checkpoint_eos = json.loads((CHECKPOINT / "generation_config.json").read_text()).get("eos_token_id")
    if run["given_decoder_input_ids"] is not None:
        return "a given first canvas (decoder_input_ids) is not a request field"
    if run["effective_generation_config"].get("eos_token_id") != checkpoint_eos:
        return "end ids other than the checkpoint's"
    if run["attention_mask"] is not None:
        return "left padding (the engine never pads a prompt)"
    return ""


def _params(run: dict[str, Any]) -> DecodeParams:
    g = run["effective_generation_config"]
    adaptive = g["stability_threshold"] is not None and g["confidence_threshold"] is not None
    return DecodeParams(gen_length=g["max_new_tokens"], max_denoising_steps=g["max_denoising_steps"],
                        entropy_bound=float(g["sampler_config"]["entropy_bound"]), t_min=g["t_min"], t_max=g["t_max"],
                        stability_threshold=g["stability_threshold"] if adaptive else None,
                        confidence_threshold=g["confidence_threshold"] if adaptive else None,
                        adaptive_stop=adaptive, seed=run["settings"]["torch_manual_seed"])


class RowDraws:
    """Row `row`'s values of the run's draws, for the steps it ran (a stopped row draws nothing more)."""

    def __init__(self, run: dict[str, Any], row: int) -> None:
        draws, self.values = run["draws"], []
        for canvas in run["canvases"]:
            index = canvas["draw_index_init"]
            self.values.append(draws[index]["values"][row])
            stop = canvas["row_stop_step"][row] or canvas["n_steps"]
            for step in canvas["steps"][:stop]:
                at = step["draw_index_multinomial"]
                width = len(draws[at + 1]["values"][row])
                self.values.append(draws[at]["values"][row * width:(row + 1) * width])
                self.values.append(draws[at + 1]["values"][row])
        self.taken = 0

    def _next(self) -> torch.Tensor:
        self.taken += 1
        return torch.tensor([self.values[self.taken - 1]])

    def canvas(self, shape: tuple[int, int]) -> torch.Tensor:
        return self._next()

    def samples(self, probabilities: torch.Tensor) -> torch.Tensor:
        return self._next()

    renoise = canvas


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_model(load_model(CHECKPOINT), max_batch=2)


def _official_rows(run: dict[str, Any]) -> list[list[int]]:
    """Each row's generated tokens up to its first end id (the official loop pads what follows)."""
    end = set(run["effective_generation_config"]["eos_token_id"])
    rows = []
    for generated in run["output"]["generated"]:
        cut = next((i + 1 for i, t in enumerate(generated) if t in end), len(generated))
        rows.append(generated[:cut])
    return rows


@pytest.mark.parametrize("path", ENGINE_RUNS, ids=[p.stem for p in ENGINE_RUNS])
def test_the_engine_reproduces_every_row_with_its_own_draws(engine, path: Path) -> None:
    run = _run(path)
    if _why_not(run):
        pytest.skip(_why_not(run))
    draws = {f"row-{b}": RowDraws(run, b) for b in range(run["settings"]["batch_size"])}

    def replay(request: Request) -> RowDraws:
        return draws[request.request_id]

    engine.slots.make_draws = replay
    for b, prompt in enumerate(run["prompt_ids"]):
        engine.add_request(prompt, _params(run), f"row-{b}")
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.result is not None:
                results[out.request_id] = out.result
    engine.reset()
    for b, official in enumerate(_official_rows(run)):
        result = results[f"row-{b}"]
        stop_steps = [c["row_stop_step"][b] or c["n_steps"] for c in run["canvases"]]
        assert result.stats.steps_per_block == stop_steps[:len(result.stats.steps_per_block)]
        # a whole canvas is decoded; the response is cut at max_new_tokens (c8_mnt20: 20 of 24)
        assert result.generated_ids == official[:run["effective_generation_config"]["max_new_tokens"]]
        assert draws[f"row-{b}"].taken == len(draws[f"row-{b}"].values)


def test_a_seeded_request_draws_what_the_official_loop_draws_after_manual_seed(engine) -> None:
    run = _run(next(p for p in GOLDEN if _run(p)["settings"]["batch_size"] == 1 and not _why_not(_run(p))))
    [result] = engine.generate([run["prompt_ids"][0]], _params(run))
    assert result.generated_ids == _official_rows(run)[0][:run["effective_generation_config"]["max_new_tokens"]]
