"""lm-evaluation-harness as a real client: `lm_eval --model local-completions` against the server on
the built-in task (bench/lm_eval/cai_builtin.yaml) scores what `cai-dllm eval` scores on the same
problems with the same decoding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ops_tools import require_tool
from serverproc import MODEL, REPO, running_server

pytestmark = pytest.mark.slow
DECODING = {"policy": "cai", "cache": "dual", "refresh_interval": 16, "gating": True, "block_length": 32,
            "steps": 128}


def test_lm_eval_local_completions_matches_cai_dllm_eval(tmp_path):
    lm_eval = require_tool("lm_eval")
    data = REPO / "bench" / "lm_eval" / "heldout_n100_seed0.jsonl"
    problems = [json.loads(line) for line in data.read_text().splitlines()]
    from tinymodels.evaluate import held_out_problems

    assert [(p["prompt"], p["answer"]) for p in problems] == [(p.prompt, p.answer) for p in held_out_problems(100, 0)]

    ours = subprocess.run([sys.executable, "-m", "server.cli", "eval", "--model", str(MODEL), "--n", "100",
                           "--seed", "0", "--configs", json.dumps({"gen_length": 128, **DECODING}),
                           "--json", str(tmp_path / "ours.json")], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert ours.returncode == 0, ours.stderr
    [row] = json.loads((tmp_path / "ours.json").read_text())["configs"]
    expected = row["accuracy"]

    with running_server("--default-decoding", json.dumps(DECODING)) as (base, _):
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        run = subprocess.run([lm_eval, "--model", "local-completions", "--tasks", "cai_builtin",
                              "--include_path", "bench/lm_eval", "--output_path", str(tmp_path / "lm_eval"),
                              "--log_samples",
                              "--model_args", f"model=llada-tiny,base_url={base}/v1/completions,num_concurrent=8,"
                              "tokenizer_backend=None,tokenized_requests=False,max_retries=3"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [results] = list(Path(tmp_path / "lm_eval").rglob("results_*.json"))
    score = json.loads(results.read_text())["results"]["cai_builtin"]["exact_match,answer"]
    print(f"\n[ops-proof] lm-eval exact match {score:.3f}; cai-dllm eval {expected:.3f} (100 problems)")
    assert score == pytest.approx(expected, abs=1e-9)

    # and response for response: what lm-eval received is what the engine decodes offline
    from engine import Engine, EngineConfig
    from engine.chat import chat_prompt_ids

    [samples_file] = list(Path(tmp_path / "lm_eval").rglob("samples_cai_builtin_*.jsonl"))
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
    engine = Engine(EngineConfig(model=str(MODEL), max_batch=8))
    prompts = [chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": p["prompt"]}]) for p in problems]
    offline = engine.generate(prompts, engine.default_params().with_overrides(gen_length=128, **DECODING))
    assert [s["resps"][0][0] for s in samples] == [r.text for r in offline]


def test_lm_eval_multiple_choice_scores_likelihoods_as_the_offline_api(tmp_path):
    """lm-eval's log-likelihood requests (`echo`, `logprobs`, `max_tokens: 1`) unchanged, through its
    remote tokenizer (/tokenizer_info, /tokenize): the right worked addition against three corrupted
    ones, each choice's log-likelihood equal to `Engine.score` on the same ids with lm-eval's seed."""
    lm_eval = require_tool("lm_eval")
    samples_per_split = 4
    with running_server("--default-decoding", json.dumps({"score_samples": samples_per_split})) as (base, _):
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        run = subprocess.run([lm_eval, "--model", "local-completions", "--tasks", "cai_builtin_add_mc",
                              "--include_path", "bench/lm_eval", "--output_path", str(tmp_path / "lm_eval"),
                              "--log_samples", "--model_args",
                              f"model=llada-tiny,base_url={base}/v1/completions,num_concurrent=4,max_retries=1"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "Using remote tokenizer" in run.stderr + run.stdout
    [results] = list(Path(tmp_path / "lm_eval").rglob("results_*.json"))
    accuracy = json.loads(results.read_text())["results"]["cai_builtin_add_mc"]["acc,none"]
    [samples_file] = list(Path(tmp_path / "lm_eval").rglob("samples_cai_builtin_add_mc_*.jsonl"))
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])

    from engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=str(MODEL)))
    encode = lambda text: engine.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    offline_correct = 0
    for sample in samples:
        doc = sample["doc"]
        context = encode(f"<|user|>{doc['prompt']}<|assistant|>")
        offline = [sum(engine.score(context + encode(choice), samples_per_split, seed=1234)[len(context):])
                   for choice in doc["choices"]]
        served = [float(resp[0][0]) for resp in sample["resps"]]
        assert served == pytest.approx(offline, abs=1e-6)
        offline_correct += max(range(len(offline)), key=offline.__getitem__) == doc["label"]
    print(f"\n[ops-proof] lm-eval multiple choice: accuracy {accuracy:.2f} over {len(samples)} items (chance 0.25)")
    assert accuracy == offline_correct / len(samples)
    assert accuracy >= 0.9
