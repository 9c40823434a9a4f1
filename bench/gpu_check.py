"""The first thing to run on a lent GPU (docs/performance.md, "GPU check"): in one command, within 8
minutes on one H100 or H200,

1. tests: the CUDA tests (`pytest -m cuda`: the built-in models against the CPU in float32 and
   bfloat16 through every policy and cache mode, CUDA graphs against eager steps, int8/int4/fp8,
   one host read a step, LLaDA2's MoE kernels, the uniform-noise built-in by its answers;
   tests/cuda_check.py gives the criterion);
2. step: bench/gpu_step.py at the real shapes of every family: LLaDA-8B, SDAR-8B, LLaDA2.0-mini and
   DiffusionGemma-26B-A4B at batch 1 and 8, eager and (the masked dual and block cached steps) as
   CUDA graphs, against the roofline floor measured in the same run;
3. offline: the offline engine at LLaDA-8B's shape, batch 1 against 8, CUDA graphs off and on, with
   the joules a request took by the GPU's energy counter (bench/gpu_check_offline.py).

Each phase runs as its own process under a time budget (a phase that overruns is stopped and said
so; the others still run). Everything lands in OUTDIR, in six files (the device tool brings back at
most eight): gpu_check.log (every phase's output), results.json (all that was measured),
summary.txt (the summary printed last), cuda_tests.xml (pytest's report, with what each test
measured), gpu_step.txt and gpu_check_offline.txt (the two benchmarks' own output, as bench/results
keeps such output).

    bash bench/gpu_check.sh OUTDIR                 # on the device: installs the carried wheels, then this
    python bench/gpu_check.py OUTDIR --device cpu  # the CPU dry run: tiny shapes (tests/engine/test_gpu_check.py)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_summary import parse_junit, parse_pytest_lines, parse_table, summary_lines

ROOT = Path(__file__).resolve().parents[1]
# in this order: a phase stopped by its budget keeps what ran first (the quantized models' CPU references
# are the slowest part)
CUDA_TEST_FILES = ("tests/engine/test_cuda_models.py", "tests/engine/test_cuda_uniform.py",
                   "tests/engine/test_static_dual_forward.py", "tests/engine/test_cuda_quantization.py")
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "triton", "torchao", "bitsandbytes",
            "flash_attn")
# Per-phase budgets on a GPU (seconds), inside the whole check's: measured phases are short of them by
# design, the budget only stops a phase that hangs or runs far slower than planned.
GPU_BUDGETS = {"tests": 190.0, "step": 220.0, "offline": 110.0}
PHASES = ("tests", "step", "offline")
TOTAL_BUDGET_S = 470.0  # 7 min 50 s: the check promises 8 minutes
STOP_GRACE_S = 15.0  # a stopped phase's time to write its report
STEP_ARGS = {
    "cuda": ["--models", "llada", "sdar", "llada2", "dg", "--batches", "1", "8", "--caches", "none", "prefix",
             "dual", "--repeats", "3", "--cached-steps", "8"],
    "cpu": ["--shapes", "tiny", "--device", "cpu", "--dtype", "float32", "--prompt-len", "32", "--gen-len", "32",
            "--block", "16", "--batches", "1", "--caches", "dual", "--repeats", "1", "--cached-steps", "2",
            "--models", "llada", "sdar", "llada2", "dg"],
}
OFFLINE_ARGS = {
    "cuda": [],  # its defaults: LLaDA-8B shape, bf16, prompt 512 + 256, batch 1 and 8, graphs off and on
    "cpu": ["--shapes", "tiny", "--device", "cpu", "--dtype", "float32", "--prompt-len", "16", "--gen-len", "16",
            "--block", "8", "--batches", "1", "2", "--warmups", "0"],
}


@dataclass
class PhaseResult:
    name: str
    command: list[str]
    status: str = "not run"  # passed | failed | timed out | error (exit N) | not run
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


def _stop(process: subprocess.Popen) -> int:
    """Interrupt the phase and anything it started (pytest then still writes its report of the tests
    that ran), and kill what has not ended after a grace period."""
    os.killpg(process.pid, signal.SIGINT)
    try:
        return process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


class Check:
    def __init__(self, out: Path, device: str, total_budget_s: float) -> None:
        self.out = out
        self.device = device
        self.start = time.monotonic()
        self.deadline = self.start + total_budget_s
        self.log = (out / "gpu_check.log").open("w", encoding="utf-8")
        self.results: dict[str, Any] = {"command": shlex.join(sys.argv), "device_kind": device, "phases": {}}

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def run(self, name: str, command: list[str], env: dict[str, str], budget_s: float,
            output: Optional[Path] = None) -> tuple[PhaseResult, str]:
        """Run one phase's process, its output streamed to the log, the console and `output`;
        stopped (its whole process group) when its budget or the check's is spent."""
        result = PhaseResult(name, command)
        timeout = min(budget_s, self.deadline - time.monotonic())
        self.say(f"\n===== {name}: {shlex.join(command)}" + (f" (budget {timeout:.0f} s)" if timeout < 1e9 else ""))
        if timeout < 5:
            result.status = "not run (the check's time was spent)"
            return result, ""
        start = time.monotonic()
        sink = output.open("w", encoding="utf-8") if output else None
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # the repo's packages
        process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": path, **env},
                                   stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                                   start_new_session=True)
        captured: list[str] = []

        def pump() -> None:  # a thread: a line that never ends must not hold the budget up
            assert process.stdout is not None
            for line in process.stdout:
                captured.append(line)
                for stream in (self.log, sys.stdout, sink):
                    if stream is not None:
                        stream.write(line)
                        stream.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            code = process.wait(timeout=None if timeout == float("inf") else timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            code = _stop(process)
        reader.join(timeout=10)
        if sink:
            sink.close()
        result.seconds = time.monotonic() - start
        if timed_out:
            result.status = f"timed out after {result.seconds:.0f} s"
        else:  # pytest exits 1 when a test failed, other codes when it could not run them
            failed = name == "tests" and code == 1
            result.status = "passed" if code == 0 else "failed" if failed else f"error (exit {code})"
        self.say(f"===== {name}: {result.status} in {result.seconds:.1f} s")
        return result, "".join(captured)

    def record(self, result: PhaseResult) -> None:
        self.results["phases"][result.name] = {"command": shlex.join(result.command), "status": result.status,
                                               "seconds": round(result.seconds, 1), **result.details}
        self.save()

    def save(self) -> None:
        """results.json as it stands (after each phase: a check stopped from outside keeps what ran)."""
        self.results["seconds"] = round(time.monotonic() - self.start, 1)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1) + "\n", encoding="utf-8")


def environment(device: str) -> dict[str, Any]:
    import torch

    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    env: dict[str, Any] = {"python": platform.python_version(), "packages": versions,
                           "cpus": os.cpu_count(), "torch_cuda": torch.version.cuda}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), gpu_count=torch.cuda.device_count())
        try:
            env["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm,"
                 "temperature.gpu,power.draw,power.limit", "--format=csv"], capture_output=True, text=True,
                timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as err:
            env["nvidia_smi"] = f"not run: {err}"
    return env


def _no_rows_is_an_error(result: PhaseResult) -> None:
    if result.status == "passed" and not result.details.get("table"):
        result.status = "error (no rows)"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for the results and logs (made if absent)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the dry run (tiny shapes, the CUDA tests check the CPU against itself)")
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES),
                        help="a subset, e.g. to rerun one phase in the time a lease has left")
    parser.add_argument("--budget-s", type=float, default=None, help=f"the whole check's time (default: "
                        f"{TOTAL_BUDGET_S:.0f} s on CUDA, its per-phase budgets inside it; none on CPU)")
    parser.add_argument("--wheels-log", type=Path, default=None, help="bench/gpu_check.sh: what installing the "
                        "carried wheels said")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    on_cuda = args.device == "cuda"
    total = args.budget_s if args.budget_s is not None else TOTAL_BUDGET_S if on_cuda else float("inf")
    check = Check(args.out, args.device, total)
    python = sys.executable
    check.say(f"# GPU check: {check.results['command']}")
    if args.wheels_log and args.wheels_log.is_file():
        check.results["wheels"] = args.wheels_log.read_text(encoding="utf-8", errors="replace").strip()
        check.say("# wheels: " + (check.results["wheels"] or "(none carried)").replace("\n", "\n# wheels: "))
    try:
        check.results["environment"] = environment(args.device)
    except Exception as err:  # a broken CUDA set-up: say so, the phases will say more
        check.results["environment"] = {"error": f"{type(err).__name__}: {err}"}
    check.say("# environment: " + json.dumps(check.results["environment"]))
    budgets = GPU_BUDGETS if on_cuda else {name: float("inf") for name in GPU_BUDGETS}

    if "tests" in args.phases:
        xml = args.out / "cuda_tests.xml"
        xml.unlink(missing_ok=True)
        env = {"CAI_DLLM_CHECK_DEVICE": args.device, **({} if on_cuda else {"CAI_DLLM_CHECK_QUICK": "1"})}
        command = [python, "-m", "pytest", "-m", "cuda", "-v", "-rs", "-p", "no:cacheprovider", "--junitxml",
                   str(xml), "-o", "junit_family=xunit1", *CUDA_TEST_FILES]
        result, text = check.run("tests", command, env, budgets["tests"])
        tests = parse_junit(xml) if xml.is_file() else parse_pytest_lines(text)
        result.details = {"env": env, "tests": tests, "from": "junit" if xml.is_file() else "console"}
        if result.status == "passed" and not any(test["outcome"] == "passed" for test in tests):
            result.status = "error (no test passed: every one skipped)"
        check.record(result)
    if "step" in args.phases:
        command = [python, "bench/gpu_step.py", *STEP_ARGS[args.device]]
        result, text = check.run("step", command, {}, budgets["step"], args.out / "gpu_step.txt")
        result.details = parse_table(text, first_column="model")
        _no_rows_is_an_error(result)
        check.record(result)
    if "offline" in args.phases:
        with tempfile.TemporaryDirectory() as scratch:  # not in OUTDIR: its files are the six above
            rows = Path(scratch) / "offline.json"
            command = [python, "bench/gpu_check_offline.py", *OFFLINE_ARGS[args.device], "--json", str(rows)]
            result, text = check.run("offline", command, {}, budgets["offline"], args.out / "gpu_check_offline.txt")
            result.details = parse_table(text, first_column="model")
            if rows.is_file():
                result.details["rows"] = json.loads(rows.read_text())["rows"]
        _no_rows_is_an_error(result)
        check.record(result)

    failed = [name for name, phase in check.results["phases"].items() if phase["status"] != "passed"]
    check.results["verdict"] = "every phase passed" if not failed else f"not passed: {', '.join(failed)}"
    check.save()
    text = "\n".join(summary_lines(check.results)) + "\n"
    (args.out / "summary.txt").write_text(text, encoding="utf-8")
    check.say("\n" + text)
    check.log.close()
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
