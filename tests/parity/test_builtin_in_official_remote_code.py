"""The built-in LLaDA, Dream and SDAR models (`models/{llada,dream,sdar}-tiny`) in their official Hugging
Face remote code: the directory loads with `from_pretrained(dir, trust_remote_code=True)` once the released
configs' `auto_map` is added, and the official decoder runs on held-out problems. LLaDA's `generate.py`
`generate` and SDAR's `generate.py` `block_diffusion_generate` answer them, and their tokens equal the
engine's under the matching policy; Dream's `diffusion_generate` with the checkpoint's generation_config
decodes every prompt to an end token (its tokens are not compared: see DREAM). A checkpoint file the
official code cannot read fails here.

No package ships that code and the project never copies it, so the test takes it from a directory named by
CAI_DLLM_OFFICIAL_CODE, and skips, saying so, when the variable is unset or a family's folder is missing:

    $CAI_DLLM_OFFICIAL_CODE/llada/  modeling_llada.py configuration_llada.py generate.py
    $CAI_DLLM_OFFICIAL_CODE/dream/  modeling_dream.py configuration_dream.py generation_utils.py
    $CAI_DLLM_OFFICIAL_CODE/sdar/   modeling_sdar.py configuration_sdar.py
                                    fused_linear_diffusion_cross_entropy.py generate.py

tests/fixtures/README.md and tests/fixtures/block/sdar/README.md name each file (repository, commit, path,
sha256). A family folder may hold `venv/`, an environment with the transformers that code was written
for (4.46.2 for LLaDA and Dream, 4.52.4 and triton for SDAR): the official decoder runs in
`venv/bin/python` when it exists, else in this interpreter (tests/parity/official_decode.py, which
imports nothing from the project). docs/models.md says how the official run stands for each built-in.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from itertools import cycle
from pathlib import Path
from typing import Any

import pytest

from engine import DecodeParams, Engine, EngineConfig
from tinymodels.checker import is_correct
from tinymodels.evaluate import PROMPT_FORMS, prompt_ids
from tinymodels.tasks import sample

MODELS = Path(__file__).resolve().parents[2] / "models"
RUNNER = Path(__file__).with_name("official_decode.py")
OFFICIAL_CODE = os.environ.get("CAI_DLLM_OFFICIAL_CODE")
# Held-out problems of the three kinds the models learned (tinymodels/tasks.py: the eval split).
HELD_OUT = ("00453+31982", "89420-08652", "sum a3 b5 c2 d1 e5 f3 g0")
# the official runs take 1-2 minutes on 2 shared CPU cores (Dream's and LLaDA's 128 whole-canvas forwards a prompt)
RUN_TIMEOUT_S = 600


@dataclass(frozen=True)
class Family:
    """A built-in, the official files its remote code needs and the `auto_map` its released config has."""

    builtin: str
    files: tuple[str, ...]
    auto_map: dict[str, str]


FAMILIES = {
    "llada": Family("llada-tiny", ("modeling_llada.py", "configuration_llada.py", "generate.py"),
                    {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"}),
    "dream": Family("dream-tiny", ("modeling_dream.py", "configuration_dream.py", "generation_utils.py"),
                    {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"}),
    "sdar": Family("sdar-tiny", ("modeling_sdar.py", "configuration_sdar.py",
                                 "fused_linear_diffusion_cross_entropy.py", "generate.py"),
                   {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                    "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"}),
}


@dataclass(frozen=True)
class Run:
    """One official decoder setting and the engine policy that matches it."""

    family: str
    name: str
    # (the engine, the checkpoint's generation_config) -> (the official decoder's kwargs, the engine's params)
    settings: Callable[[Engine, dict[str, Any]], tuple[dict[str, Any], DecodeParams]]
    greedy: bool = False  # SDAR: torch.multinomial taken as the argmax (its decoder has no temperature 0)


def _llada_fixed(engine: Engine, _: dict[str, Any]) -> tuple[dict[str, Any], DecodeParams]:
    """generate() one token a step over the engine's default canvas and block."""
    default = engine.default_params()
    official = {"steps": default.gen_length, "gen_length": default.gen_length, "block_length": default.block_length,
                "temperature": 0.0, "cfg_scale": 0.0, "remasking": "low_confidence",
                "mask_id": engine.model.special.mask_id}
    return official, DecodeParams(policy="fixed", gen_length=default.gen_length, block_length=default.block_length,
                                  steps=default.gen_length, early_exit=False)


def _dream_generation_config(engine: Engine, generation: dict[str, Any]) -> tuple[dict[str, Any], DecodeParams]:
    """diffusion_generate() with the checkpoint's generation_config (its alg, steps and eps) as it loads."""
    gen_length = engine.default_params().gen_length
    return {"max_new_tokens": gen_length}, DecodeParams(
        policy=f"dream-{generation['alg']}", gen_length=gen_length, block_length=gen_length,
        steps=generation["steps"], eps=generation["eps"], early_exit=False)


def _sdar(strategy: str, policy: str, threshold: float | None = None) -> Callable[..., tuple[dict, DecodeParams]]:
    def settings(engine: Engine, _: dict[str, Any]) -> tuple[dict[str, Any], DecodeParams]:
        """block_diffusion_generate() over the trained block, one step a block position (as SDAR's static
        decoder needs), stopping at the checkpoint's end ids; its defaults for the sampling filters."""
        default = engine.default_params()
        block, gen_length = default.block_length, default.gen_length
        official = {"mask_id": engine.model.special.mask_id, "gen_length": gen_length, "block_length": block,
                    "denoising_steps": block, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                    "remasking_strategy": strategy, "stopping_criteria_idx": list(engine.model.special.end_ids)}
        extra = {}
        if threshold is not None:
            official["confidence_threshold"] = threshold
            extra["threshold"] = threshold
        params = DecodeParams(policy=policy, gen_length=gen_length, block_length=block,
                              steps=block * -(-gen_length // block), store_pass=True, temperature=0.0, **extra)
        return official, params
    return settings


RUNS = (
    Run("llada", "fixed", _llada_fixed),
    Run("sdar", "static", _sdar("low_confidence_static", "block-static"), greedy=True),
    Run("sdar", "dynamic-0.9", _sdar("low_confidence_dynamic", "block-dynamic", 0.9), greedy=True),
)


def _official_dir(family: str) -> Path:
    if not OFFICIAL_CODE:
        pytest.skip("CAI_DLLM_OFFICIAL_CODE is not set: no official remote code to run (the module docstring "
                    "gives the layout)")
    folder = Path(OFFICIAL_CODE) / family
    missing = [name for name in FAMILIES[family].files if not (folder / name).is_file()]
    if missing:
        pytest.skip(f"{folder} lacks {', '.join(missing)}")
    return folder


def _scratch_checkpoint(family: str, official: Path, dest: Path) -> Path:
    """The built-in's files, the official .py files beside them, and the released config's auto_map."""
    spec = FAMILIES[family]
    builtin = MODELS / spec.builtin
    dest.mkdir(parents=True)
    for path in builtin.iterdir():
        if path.is_file() and path.name != "config.json":
            (dest / path.name).symlink_to(path)
    for name in spec.files:
        shutil.copy(official / name, dest / name)
    config = json.loads((builtin / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "auto_map": spec.auto_map}, indent=2))
    return dest


def _problems() -> list:
    wanted = set(HELD_OUT)
    problems = [p for p in sample(3000, seed=0, split="eval") if p.prompt in wanted]
    assert sorted(p.prompt for p in problems) == sorted(wanted)
    return problems


def _official(run: Run, prompts: list[list[int]], official: Path, tmp: Path,
              decoder: dict[str, Any]) -> list[list[int]]:
    model_dir = _scratch_checkpoint(run.family, official, tmp / "checkpoint")
    request = {"family": run.family, "model_dir": str(model_dir), "decoder": decoder, "prompts": prompts,
               "greedy": run.greedy, "out": str(tmp / "official.json")}
    (tmp / "request.json").write_text(json.dumps(request))
    venv_python = official / "venv" / "bin" / "python"
    python = str(venv_python) if venv_python.exists() else sys.executable
    # threads that wait for a core passively: spinning ones made a run many times slower on a shared machine
    env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
    done = subprocess.run([python, str(RUNNER), str(tmp / "request.json")], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, cwd=tmp, env=env)
    assert done.returncode == 0, f"the official code failed under {python}:\n{done.stderr[-4000:]}"
    return json.loads((tmp / "official.json").read_text())["generated"]


def _through_end(ids: list[int], end_ids: tuple[int, ...], gen_length: int) -> list[int]:
    ids = ids[:gen_length]
    end = next((i for i, token in enumerate(ids) if token in end_ids), None)
    return ids if end is None else ids[:end + 1]


def _decode(run: Run, tmp: Path) -> tuple[Engine, list, list[list[int]], list[list[int]], DecodeParams]:
    official_dir = _official_dir(run.family)
    builtin = MODELS / FAMILIES[run.family].builtin
    engine = Engine(EngineConfig(model=str(builtin), max_batch=len(HELD_OUT)))
    cases = list(zip(_problems(), cycle(PROMPT_FORMS)))  # each problem in one form, every form used
    prompts = [prompt_ids(engine, problem, form) for problem, form in cases]
    generation = json.loads((builtin / "generation_config.json").read_text())
    decoder, params = run.settings(engine, generation)
    official = _official(run, prompts, official_dir, tmp, decoder)
    return engine, cases, prompts, official, engine.default_params(params)


def _check_answers(engine: Engine, cases: list, tokens: list[list[int]], run: Run) -> None:
    for (problem, form), ids in zip(cases, tokens, strict=True):
        text = engine.tokenizer.decode(ids, skip_special_tokens=True)
        assert is_correct(problem.prompt, text), (run.family, run.name, form, problem.prompt, text)


@pytest.mark.parametrize("run", RUNS, ids=[f"{r.family}-{r.name}" for r in RUNS])
def test_official_decoder_answers_and_the_engine_gives_its_tokens(run: Run, tmp_path: Path) -> None:
    engine, cases, prompts, official, params = _decode(run, tmp_path)
    end_ids = engine.model.special.end_ids
    expected = [_through_end(ids, end_ids, params.gen_length) for ids in official]
    results = engine.generate(prompts, params)
    for (problem, form), result, want in zip(cases, results, expected, strict=True):
        got = _through_end(result.generated_ids, end_ids, params.gen_length)
        assert got == want, (run.family, run.name, form, problem.prompt, engine.tokenizer.decode(got),
                             engine.tokenizer.decode(want))
    _check_answers(engine, cases, expected, run)


# Dream's one-token-a-step decoders rank confidences that saturate on this model (negative entropies near 0),
# so float noise reorders its commits: two runs of the same official code here ended an answer in different
# digits. Its run is checked for what is stable: the checkpoint loads and its generation_config decodes every
# prompt to an end token, no mask left.
DREAM = Run("dream", "generation-config", _dream_generation_config)


def test_dream_decodes_in_its_official_code(tmp_path: Path) -> None:
    engine, cases, _, official, params = _decode(DREAM, tmp_path)
    special = engine.model.special
    for (problem, form), ids in zip(cases, official, strict=True):
        assert len(ids) == params.gen_length and special.mask_id not in ids, (form, problem.prompt)
        assert any(token in special.end_ids for token in ids), (form, problem.prompt)


