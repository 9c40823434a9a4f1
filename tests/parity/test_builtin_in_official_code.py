"""The built-in DiffusionGemma-format model (`models/diffusiongemma-tiny`) in the official code, unpatched:
`DiffusionGemmaForBlockDiffusion.from_pretrained` and its own `generate()` (transformers' DiffusionGemma,
the version the project's environment installs; skipped, saying so, where that transformers has no
DiffusionGemma). A config the official code cannot run (a null `image_token_id` made every `generate()`
call raise) fails here. The official loop answers held-out problems, and a seeded request to the engine
gives the tokens `torch.manual_seed(seed)` + the official `generate()` give: the same model, the same
draws from one stream (the fixture README's section 4.4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig
from tinymodels.checker import is_correct
from tinymodels.evaluate import prompt_ids
from tinymodels.tasks import sample

official = pytest.importorskip("transformers.models.diffusion_gemma",
                               reason="the installed transformers has no DiffusionGemma (added in 5.23)")

BUILTIN = Path(__file__).resolve().parents[2] / "models" / "diffusiongemma-tiny"
# Held-out problems of the three kinds the model learned (tinymodels/tasks.py: the eval split).
HELD_OUT = ("00453+31982", "89420-08652", "sum a3 b5 c2 d1 e5 f3 g0")
SEED = 7


@pytest.fixture(scope="module")
def engine() -> Engine:
    if not (BUILTIN / "model.safetensors").is_file():
        pytest.skip("models/diffusiongemma-tiny is not in this checkout")
    return Engine(EngineConfig(model=str(BUILTIN), max_batch=1))


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    model = official.DiffusionGemmaForBlockDiffusion.from_pretrained(BUILTIN, dtype=torch.float32)
    return model.eval()


def _official_tokens(hf_model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The official loop's new tokens up to and including the first end id (it pads what follows)."""
    torch.manual_seed(SEED)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens)
    generated = out.sequences[0, len(prompt):].tolist()
    end = set(hf_model.generation_config.eos_token_id)
    cut = next((i + 1 for i, token in enumerate(generated) if token in end), len(generated))
    return generated[:cut]


@pytest.mark.parametrize("problem_text", HELD_OUT)
def test_the_official_generate_answers_and_a_seeded_request_matches_it(engine, hf_model, problem_text) -> None:
    problem = next(p for p in sample(3000, seed=0, split="eval") if p.prompt == problem_text)
    prompt = prompt_ids(engine, problem, "chat")
    max_new_tokens = engine.default_params().gen_length
    tokens = _official_tokens(hf_model, prompt, max_new_tokens)
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert is_correct(problem.prompt, text), (problem.prompt, text)
    params = engine.default_params().with_overrides(seed=SEED, gen_length=max_new_tokens)
    [result] = engine.generate([prompt], params)
    assert result.generated_ids == tokens[:max_new_tokens]
