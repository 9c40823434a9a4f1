"""The committed built-in models: they load, answer held-out problems, and `cai-dllm eval` runs."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import Engine, EngineConfig
from tinymodels.checker import is_correct
from tinymodels.evaluate import EvalConfig, default_configs, evaluate, held_out_problems, prompt_ids
from tinymodels.prompt_forms import PROMPT_FORMS
from tinymodels.tasks import DEFAULT_MIX, sample, split_of

MODELS = Path(__file__).resolve().parents[2] / "models"
BUILTIN = [name for name in ("llada-tiny", "dream-tiny") if (MODELS / name / "model.safetensors").is_file()]
# block-diffusion built-ins: decoded in block mode with their own policies
BLOCK_BUILTIN = [name for name in ("sdar-tiny", "llada2-tiny") if (MODELS / name / "model.safetensors").is_file()]
# uniform-noise built-ins (DiffusionGemma's format): sampled, each request from its own seeded generator
UNIFORM_BUILTIN = [name for name in ("diffusiongemma-tiny",) if (MODELS / name / "model.safetensors").is_file()]


def test_llada_tiny_is_committed():
    assert "llada-tiny" in BUILTIN


@pytest.mark.parametrize("name", BUILTIN + BLOCK_BUILTIN + UNIFORM_BUILTIN)
def test_checksums_match_the_docs(name):
    doc = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    digest = hashlib.sha256((MODELS / name / "model.safetensors").read_bytes()).hexdigest()
    assert digest in doc


# Held-out problems of every kind the models learned (tinymodels.tasks: the eval split), answered in
# both prompt forms with the fixed decoder; the answers come from the independent checker.
HELD_OUT_EXAMPLES = [("add", "00453+31982"), ("sub", "89420-08652"), ("running", "sum a3 b5 c2 d1 e5 f3 g0")]


def test_the_examples_are_held_out_and_cover_every_kind():
    assert {kind for kind, _ in HELD_OUT_EXAMPLES} == set(DEFAULT_MIX)  # the kinds the models learned
    for kind, prompt in HELD_OUT_EXAMPLES:
        problem = next(p for p in sample(3000, seed=0, split="eval") if p.prompt == prompt)
        assert problem.kind == kind and split_of(problem.kind, problem.key) == "eval"


@pytest.mark.parametrize("name", BUILTIN)
@pytest.mark.parametrize("form", PROMPT_FORMS)
def test_held_out_problems_are_answered_through_both_prompt_forms(name, form):
    engine = Engine(EngineConfig(model=str(MODELS / name), max_batch=len(HELD_OUT_EXAMPLES)))
    problems = [next(p for p in sample(3000, seed=0, split="eval") if p.prompt == prompt)
                for _, prompt in HELD_OUT_EXAMPLES]
    params = engine.default_params().with_overrides(policy="fixed", gen_length=128, block_length=32, steps=128)
    results = engine.generate([prompt_ids(engine, p, form) for p in problems], params)
    for problem, result in zip(problems, results, strict=True):
        assert is_correct(problem.prompt, result.text), (problem.prompt, result.text)
        assert result.text == problem.response and result.finish_reason == "stop"


@pytest.mark.parametrize("name", BUILTIN)
def test_evaluation_harness_on_the_model(name):
    engine = Engine(EngineConfig(model=str(MODELS / name)))
    problems = held_out_problems(8, seed=5)
    [report] = evaluate(engine, problems, [EvalConfig("fixed", {"policy": "fixed", "gen_length": 128,
                                                                 "block_length": 32, "steps": 128})])
    assert report.n == 8 and report.nfe > 0 and report.generated_tokens > 0


@pytest.mark.parametrize("name", UNIFORM_BUILTIN)
def test_evaluation_harness_on_the_uniform_noise_model(name):
    """Its default rows (the official stopping rule and the convergence-aware one), each request
    seeded: the same report twice, whatever the batch."""
    engine = Engine(EngineConfig(model=str(MODELS / name)))
    problems = held_out_problems(6, seed=5)
    configs = default_configs(engine.architecture, gen_length=64)
    reports = [evaluate(engine, problems, configs, batch_size=batch) for batch in (6, 2)]
    for by_batch in zip(*reports, strict=True):
        assert {(r.correct, r.nfe, r.generated_tokens) for r in by_batch} == {(by_batch[0].correct, by_batch[0].nfe,
                                                                               by_batch[0].generated_tokens)}
        assert by_batch[0].n == 6 and by_batch[0].nfe > 0 and by_batch[0].generated_tokens > 0


@pytest.mark.slow
def test_eval_cli_small_n(tmp_path):
    out = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "server.cli", "eval", "--model", str(MODELS / "llada-tiny"), "--n", "16",
           "--configs", "fixed+exit;threshold 0.9 dual (Fast-dLLM);CAI full, gate on +exit;"
                        f"profile:{MODELS / 'llada-tiny' / 'calibrated_profile.json'}", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "| CAI full, gate on +exit" in run.stdout and "| profile calibrated " in run.stdout
    assert "| configuration                    | add | running | sub |" in run.stdout  # accuracy by kind
    report = json.loads(out.read_text())
    assert report["n"] == 16 and len(report["configs"]) == 4
    knobs = json.loads((MODELS / "llada-tiny" / "calibrated_profile.json").read_text())["decoding"]
    assert report["configs"][3]["params"] == {"gen_length": 128, **knobs}
    for config in report["configs"]:
        assert {"accuracy", "accuracy_95ci", "nfe_per_request", "nfe_per_generated_token", "steps_saved_pct",
                "generated_tokens_per_s", "accuracy_by_kind", "unparsed", "tokens_per_forward", "aup"} <= set(config)
        assert config["tokens_per_forward"] == pytest.approx(1 / config["nfe_per_generated_token"])
        assert config["aup"] > 0 and config["aup_baseline"] == "fixed+exit"
    assert "| TPF | AUP | tok/s |" in run.stdout
    assert report["hardware"]


@pytest.mark.slow
@pytest.mark.parametrize("name", BLOCK_BUILTIN)
def test_eval_cli_decodes_a_block_model_with_its_trained_block(name, tmp_path):
    out = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "server.cli", "eval", "--model", str(MODELS / name), "--n", "16", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    block = json.loads((MODELS / name / "config.json").read_text())["block_size"]
    report = json.loads(out.read_text())
    edits = ["block-edit (LLaDA2.1)"] if name.startswith("llada2") else []  # the LLaDA2 family's own decoder
    assert [c["name"] for c in report["configs"]] == ["block-static", "block-dynamic 0.9", "CAI full, gate on",
                                                     "CAI full, gate off", *edits]
    for config in report["configs"]:
        assert config["params"]["block_length"] == block and config["nfe_per_request"] > 0
    # one token a step: the static decoder spends a forward per token of every decoded block
    static = report["configs"][0]
    assert static["nfe_per_request"] >= static["nfe_per_generated_token"] > 0.9


def test_eval_cli_rejects_unknown_config():
    cmd = [sys.executable, "-m", "server.cli", "eval", "--model", str(MODELS / "llada-tiny"), "--n", "2",
           "--configs", "nonsense"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "unknown configuration" in run.stderr
    cmd[-1] = "profile:/nonexistent.json"
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "cannot read decoding profile /nonexistent.json" in run.stderr


@pytest.mark.parametrize("name", BUILTIN + BLOCK_BUILTIN)
def test_hugging_face_loads_the_tokenizer_without_asking_to_run_custom_code(name):
    """Load tools (guidellm, aiperf, ...) read the tokenizer with transformers' Auto classes: a config
    with an `auto_map` to modeling files that are not shipped makes that ask "[y/N]" on stdin."""
    assert "auto_map" not in json.loads((MODELS / name / "config.json").read_text())
    code = ("from transformers import AutoTokenizer; "
            f"print(len(AutoTokenizer.from_pretrained({str(MODELS / name)!r})))")
    run = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "custom code" not in run.stdout + run.stderr and "trust_remote_code" not in run.stdout + run.stderr
