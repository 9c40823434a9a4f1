"""bench/block_vs_official.py: its own logic on hand-made input (arguments, the alternation, the ratio,
the official batch decoder's equal-length calls, the flash-attn CPU stand-in), and, where the official
SDAR code and its scratch venv are given (CAI_DLLM_SDAR_OFFICIAL_DIR, CAI_DLLM_SDAR_OFFICIAL_PYTHON:
bench/sdar_official/README.md), a tiny side by side: the same tokens from both sides."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench import block_vs_official as bench  # noqa: E402

OFFICIAL = REPO / "bench" / "sdar_official"


def _load(name: str, path: Path) -> ModuleType:
    """A file of bench/sdar_official under a private name (never as `flash_attn`, which a CUDA path
    of the engine may look for)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load("sdar_official_worker", OFFICIAL / "worker.py")


@pytest.fixture
def keep_threads():  # the workers set torch's thread count for their process: this one's is restored
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_arguments(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--official-dir", str(tmp_path)])  # no --official-python
    with pytest.raises(SystemExit):  # not a checkout of the official code
        bench.parse_args(["--official-dir", str(tmp_path), "--official-python", sys.executable])
    (tmp_path / "generate.py").write_text("")
    args = bench.parse_args(["--official-dir", str(tmp_path), "--official-python", sys.executable, "--n", "4"])
    assert (args.n, args.rounds, args.threads, args.batches) == (4, 3, 2, "1,8")
    assert bench.parse_args(["--worker", "0", "--job", "job.json"]).worker == 0  # a worker needs neither


def test_plan_alternates_and_runs_a_shared_official_decoder_once_a_round() -> None:
    order = bench.plan(bench.COMPARISONS, 2)
    officials = list(dict.fromkeys(c.official for c in bench.COMPARISONS))
    for round_ in range(2):
        runs = [(side, run) for r, side, run in order if r == round_]
        assert [run for side, run in runs if side == "ours"] == bench.COMPARISONS
        assert sorted(map(str, (run for side, run in runs if side == "official"))) == sorted(map(str, officials))
    first, second = ([side for r, side, _ in order if r == k] for k in range(2))
    assert first[:2] == ["official", "ours"] and second[:2] == ["ours", "official"]
    # the CAI comparison shares the official dynamic batch-8 run, which runs once a round
    assert len(first) == len(bench.COMPARISONS) + len(officials) == 9


def test_median_of_round_ratios_pairs_each_round() -> None:
    # ours twice as fast in two rounds of three, the machine's speed drifting between rounds: the
    # medians of the two sides (4 and 4) hide it, each round's own ratio does not
    assert bench.median_of_round_ratios([10.0, 4.0, 4.0], [5.0, 2.0, 4.0]) == pytest.approx(2.0)
    assert bench.ratio_of_medians([10.0, 4.0, 4.0], [5.0, 2.0, 4.0]) == pytest.approx(1.0)
    assert bench.median_of_round_ratios([6.0, 2.0, 2.0], [2.0, 2.0, 2.0]) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        bench.median_of_round_ratios([1.0, 2.0], [1.0])


def test_ratio_of_medians() -> None:
    assert bench.ratio_of_medians([3.0, 9.0, 4.0], [1.0, 2.0, 100.0]) == pytest.approx(2.0)
    assert bench.ratio_of_medians([1.0], [4.0]) == pytest.approx(0.25)
    assert bench.identical([[1, 2], [3], [4]], [[1, 2], [3, 5], [4]]) == 2


def test_equal_length_batches_and_responses() -> None:
    assert worker.equal_length_batches([5, 7, 5, 5, 7, 9], 2) == [[0, 2], [3], [1, 4], [5]]
    assert worker.response([4, 5, 9, 6, 9], 4, [9]) == [4, 5, 9]
    assert worker.response([4, 5, 6, 7, 8], 3, [9]) == [4, 5, 6]


def test_flash_attn_stand_in_is_plain_attention_and_rms_norm() -> None:
    stand_in = _load("flash_attn_cpu_stand_in", OFFICIAL / "flash_attn" / "__init__.py")
    norm = _load("flash_attn_cpu_layer_norm", OFFICIAL / "flash_attn" / "ops" / "triton" / "layer_norm.py")
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 8, generator=generator)  # [batch, seq, heads, dim]: flash-attn's layout
    k, v = torch.randn(2, 2, 7, 8, 8, generator=generator).unbind(1)
    k, v = k[:, :, :2], v[:, :, :2]  # two KV heads: grouped-query
    scale = 0.3
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) * scale
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.repeat_interleave(2, dim=2))
    torch.testing.assert_close(stand_in.flash_attn_func(q, k, v, causal=False, softmax_scale=scale), expected)
    x, weight = torch.randn(3, 16, generator=generator), torch.randn(16, generator=generator)
    torch.testing.assert_close(norm.rms_norm_fn(x, weight=weight, bias=None, eps=1e-6),
                               F.rms_norm(x, (16,), weight, eps=1e-6))


def test_our_side_decodes_and_counts(keep_threads: None) -> None:
    job, _ = bench.make_job(bench.parse_args(["--worker", "0", "--n", "2"]))
    job["gen_length"] = 16
    out = bench.our_worker(job, 3, threads=1)  # batch 8, dynamic 0.9
    assert len(out["outputs"]) == len(out["forwards"]) == 2
    assert all(0 < len(o) <= 16 for o in out["outputs"]) and out["seconds"] > 0
    assert 1 <= max(out["forwards"]) <= out["model_calls"]


OFFICIAL_DIR = os.environ.get("CAI_DLLM_SDAR_OFFICIAL_DIR")
OFFICIAL_PYTHON = os.environ.get("CAI_DLLM_SDAR_OFFICIAL_PYTHON")


@pytest.mark.skipif(not (OFFICIAL_DIR and OFFICIAL_PYTHON and Path(OFFICIAL_PYTHON).exists()),
                    reason="the official SDAR code and its scratch venv are not given "
                           "(CAI_DLLM_SDAR_OFFICIAL_DIR, CAI_DLLM_SDAR_OFFICIAL_PYTHON; bench/sdar_official/README.md)")
def test_tiny_side_by_side_decodes_the_same_tokens(tmp_path: Path, keep_threads: None) -> None:
    job, _ = bench.make_job(bench.parse_args(["--worker", "0", "--n", "3"]))
    job["gen_length"] = 24
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    comparison = bench.COMPARISONS[3]  # batch 8, dynamic 0.9: the official evaluation decoder
    done = subprocess.run([OFFICIAL_PYTHON, str(OFFICIAL / "worker.py"), "--official-dir", OFFICIAL_DIR,
                           "--job", str(path), "--decoder", comparison.official.decoder, "--batch", "8",
                           "--threshold", str(comparison.official.threshold), "--threads", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    official = json.loads(done.stdout.strip().splitlines()[-1])
    ours = bench.our_worker(job, 3, threads=1)
    assert official["cut_short"] == 0
    assert official["outputs"] == ours["outputs"]
