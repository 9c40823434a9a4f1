"""bench/gpu_check.py's reading of its phases' output (pytest's junit report or console, the two
benchmarks' tables) and the one-screen summary it prints last."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

# the CUDA tests' functions, as the summary names them
TEST_LABELS = {
    "test_a_forward_on_the_device_tracks_the_cpu_forward": "forward",
    "test_float32_on_the_device_answers_as_on_the_cpu": "texts float32",
    "test_bfloat16_on_the_device_changes_no_more_texts_than_bfloat16_rounding": "texts bfloat16",
    "test_cuda_graphs_give_the_tokens_eager_steps_give": "graphs",
    "test_one_host_read_per_step_on_the_device": "host reads",
    "test_moe_kernels_on_the_device": "moe",
    "test_a_quantized_model_answers_on_the_device_as_on_the_cpu": "quantized",
    "test_fp8_loads_and_answers_on_a_gpu_that_has_it": "fp8",
    "test_the_uniform_noise_model_answers_on_the_device_as_on_the_cpu": "uniform answers",
    "test_a_seeded_request_gives_the_same_tokens_alone_and_batched_on_the_device": "uniform seeded",
    "test_one_host_read_per_step_on_the_device_uniform": "uniform reads",
}
# recorded, but too long or too plain for the screen (results.json keeps them)
OFF_SCREEN = ("sync_sources", "steps")
STEP_COLUMNS = ("model", "batch", "cache", "step", "attn", "step_ms", "tok_per_s", "floor_ms", "step/floor")
OFFLINE_COLUMNS = ("model", "batch", "graphs", "tok_per_s", "step_ms_med", "captured", "tok_vs_eager", "J_per_req")
WIDTH = 140


def parse_junit(path: Path) -> list[dict[str, Any]]:
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "").strip()
                break
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        tests.append({"id": f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "properties": properties, "message": message})
    return tests


_CONSOLE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)")


def parse_pytest_lines(text: str) -> list[dict[str, Any]]:
    """The outcomes pytest -v printed, when it was stopped before writing its report."""
    return [{"id": m.group(1).rsplit("/", 1)[-1], "outcome": m.group(2).lower(), "seconds": None, "properties": {},
             "message": ""} for m in map(_CONSOLE.match, text.splitlines()) if m]


def _number(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_table(text: str, first_column: str) -> dict[str, Any]:
    """A benchmark's output: its '#' lines, and the rows under the header line that starts with
    `first_column` (cells separated by spaces, none inside a cell)."""
    notes, rows, header = [], [], None
    for line in text.splitlines():
        if line.startswith("#"):
            notes.append(line)
        elif header is None and line.split()[:1] == [first_column]:
            header = line.split()
        elif header is not None and len(line.split()) == len(header):
            rows.append(dict(zip(header, map(_number, line.split()), strict=True)))
    return {"notes": notes, "table": rows}


def _test_name(test_id: str) -> tuple[str, str]:
    """(function, parameters) of a test id."""
    name = test_id.split("::")[-1]
    function, _, params = name.partition("[")
    return function, params.rstrip("]")


def _environment_line(results: dict[str, Any]) -> str:
    env = results.get("environment", {})
    if "error" in env:
        return f"GPU check: environment unreadable: {env['error']}"
    packages = env.get("packages", {})
    libraries = ", ".join(f"{name} {packages.get(name) or 'absent'}" for name in
                          ("transformers", "torchao", "bitsandbytes", "flash_attn"))
    where = (f"{env.get('gpu')} (compute {env.get('capability')}, {env.get('gpu_memory_gib')} GiB)"
             if env.get("gpu") else f"CPU dry run ({env.get('cpus')} CPUs)")
    return (f"GPU check on {where}: torch {packages.get('torch')} (CUDA {env.get('torch_cuda')}), {libraries}; "
            f"python {env.get('python')}; {results.get('seconds', 0):.0f} s in all")


def _tests_lines(phase: dict[str, Any]) -> list[str]:
    tests = phase.get("tests", [])
    counts: dict[str, int] = defaultdict(int)
    for test in tests:
        counts[test["outcome"]] += 1
    lines = [f"tests    {phase['status']} ({phase['seconds']:.0f} s): "
             + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))]
    for test in tests:
        if test["outcome"] in ("failed", "error"):
            first = next((line for line in test["message"].splitlines() if line.strip()), "")
            lines.append(f"  {test['outcome'].upper()} {test['id'].split('::')[-1]}: {first}"[:WIDTH])
    reasons: dict[str, list[str]] = defaultdict(list)
    for test in tests:
        if test["outcome"] == "skipped":
            reasons[test["message"]].append(_test_name(test["id"])[0])
    for reason, names in reasons.items():
        functions = sorted({TEST_LABELS.get(n, n) for n in names})
        lines.append(f"  skipped {len(names)} ({', '.join(functions)}): {reason.removeprefix('Skipped: ')}"[:WIDTH])
    measured: dict[tuple[str, str], list[str]] = defaultdict(list)
    for test in tests:
        function, params = _test_name(test["id"])
        for key, value in test["properties"].items():
            if key not in OFF_SCREEN:
                label = TEST_LABELS.get(function, function)
                measured[(label, key)].append(f"{params.replace('-tiny', '') or '-'} {value}")
    if measured:
        lines.append("  measured:")
        for (label, key), values in measured.items():
            lines += _wrapped(f"    {label:<14} {key:<16} ", values)
    return lines


def _wrapped(head: str, values: list[str]) -> list[str]:
    """`head` then the values joined by ' | ', continued under the first value past WIDTH."""
    lines, line = [], head
    for i, value in enumerate(values):
        piece = value if i == 0 else f" | {value}"
        if i and len(line) + len(piece) > WIDTH:
            lines.append(line)
            line = " " * len(head) + value
        else:
            line += piece
    return [*lines, line]


def _table_lines(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> list[str]:
    if not rows:
        return ["  (no rows)"]
    present = [c for c in columns if c in rows[0]]
    cells = [[c for c in present]] + [[_cell(row[c]) for c in present] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(present))]
    return ["  " + " ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)) for line in cells]


def _cell(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _offline_ratios(rows: list[dict[str, Any]]) -> Optional[str]:
    speed = {(r["batch"], r["graphs"]): r["tokens_per_s"] for r in rows}
    parts = [f"graphs on/off at batch {b}: x{speed[(b, True)] / speed[(b, False)]:.2f}"
             for b in sorted({b for b, _ in speed}) if (b, True) in speed and (b, False) in speed]
    batches = sorted({b for b, g in speed if not g})
    if len(batches) > 1:
        parts.append(f"batch {batches[-1]}/{batches[0]} (eager): "
                     f"x{speed[(batches[-1], False)] / speed[(batches[0], False)]:.2f}")
    return "  " + "; ".join(parts) if parts else None


def summary_lines(results: dict[str, Any]) -> list[str]:
    lines = [_environment_line(results)]
    phases = results.get("phases", {})
    if "tests" in phases:
        lines += _tests_lines(phases["tests"])
    if "step" in phases:
        phase = phases["step"]
        measured = next((n.removeprefix("# measured: ") for n in phase.get("notes", []) if n.startswith("# measured")),
                        "")
        lines.append(f"step     {phase['status']} ({phase['seconds']:.0f} s): bench/gpu_step.py; {measured}")
        lines += [f"  {n.lstrip('# ')}"[:WIDTH] for n in phase.get("notes", []) if n.startswith("# warning")]
        lines += _table_lines(phase.get("table", []), STEP_COLUMNS)
    if "offline" in phases:
        phase = phases["offline"]
        lines.append(f"offline  {phase['status']} ({phase['seconds']:.0f} s): bench/gpu_check_offline.py")
        lines += _table_lines(phase.get("table", []), OFFLINE_COLUMNS)
        ratios = _offline_ratios(phase.get("rows", []))
        if ratios:
            lines.append(ratios)
    lines.append(f"verdict: {results.get('verdict', 'unfinished')}")
    return lines
