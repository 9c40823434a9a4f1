"""The committed built-in models: they load, answer held-out problems, and `cai-dllm eval` runs."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import Engine, EngineConfig
from engine.chat import chat_prompt_ids
from tinymodels.evaluate import EvalConfig, evaluate, held_out_problems

MODELS = Path(__file__).resolve().parents[1] / "models"
BUILTIN = [name for name in ("llada-tiny", "dream-tiny") if (MODELS / name / "model.safetensors").is_file()]


def test_llada_tiny_is_committed():
    assert "llada-tiny" in BUILTIN


@pytest.mark.parametrize("name", BUILTIN)
def test_checksums_match_the_docs(name):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
    digest = hashlib.sha256((MODELS / name / "model.safetensors").read_bytes()).hexdigest()
    assert digest in doc


@pytest.mark.parametrize("name", BUILTIN)
def test_chat_prompt_is_answered_correctly(name):
    # Additions are the kind both models have learned best (docs/benchmarks.md): every column sum of
    # the worked chain must be right, and llada-tiny's final sum too. dream-tiny gets this one's
    # final sum wrong (00058...), so only its chain is checked.
    engine = Engine(EngineConfig(model=str(MODELS / name)))
    ids = chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": "00023+00045"}])
    [result] = engine.generate([ids], engine.default_params().with_overrides(policy="fixed", gen_length=128,
                                                                             block_length=32, steps=128))
    chain = "3+5+0=08;2+4+0=06;0+0+0=00;0+0+0=00;="
    assert result.text.startswith(chain)
    if name == "llada-tiny":
        assert result.text == chain + "00068"
    assert result.finish_reason == "stop"


@pytest.mark.parametrize("name", BUILTIN)
def test_evaluation_harness_on_the_model(name):
    engine = Engine(EngineConfig(model=str(MODELS / name)))
    problems = held_out_problems(8, seed=5)
    [report] = evaluate(engine, problems, [EvalConfig("fixed", {"policy": "fixed", "gen_length": 128,
                                                                 "block_length": 32, "steps": 128})])
    assert report.n == 8 and report.nfe > 0 and report.generated_tokens > 0


@pytest.mark.slow
def test_eval_cli_small_n(tmp_path):
    out = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "server.cli", "eval", "--model", str(MODELS / "llada-tiny"), "--n", "16",
           "--configs", "fixed+exit;threshold 0.9 dual (Fast-dLLM);CAI full, gate on +exit", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "| CAI full, gate on +exit" in run.stdout
    report = json.loads(out.read_text())
    assert report["n"] == 16 and len(report["configs"]) == 3
    for config in report["configs"]:
        assert {"accuracy", "accuracy_95ci", "nfe_per_request", "nfe_per_generated_token", "steps_saved_pct",
                "generated_tokens_per_s", "accuracy_by_kind", "unparsed"} <= set(config)
    assert report["hardware"]


def test_eval_cli_rejects_unknown_config():
    cmd = [sys.executable, "-m", "server.cli", "eval", "--model", str(MODELS / "llada-tiny"), "--n", "2",
           "--configs", "nonsense"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "unknown configuration" in run.stderr
