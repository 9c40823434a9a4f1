"""`cai-dllm eval`: every decoding configuration on the same held-out problems, side by side.

Problems reach the model in one prompt form, chat (the chat template, as `/v1/chat/completions`
sends them) or plain (the bare problem text, as `/v1/completions` sends it), and are graded by
`tinymodels.checker`, which works from the problem text alone.

For each configuration: exact-match accuracy with a 95 % Wilson interval, accuracy by task kind,
responses that do not parse, mean NFE per request, NFE per generated token, NFE excluding blocks
that are all end tokens, steps saved against the fixed budget, tokens per forward (TPF) and
accuracy under parallelism (AUP, d3LLM's score, against the table's first row: `tinymodels.aup`),
and generated tokens per second (wall clock; generated tokens only: the response up to and
including its end token, as TPF counts them).
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from engine.bundled import model_dir
from engine.chat import chat_prompt_ids
from engine.decoding import DecodeParams, GenerationResult
from engine.engine import Engine
from engine.models.registry import FAMILIES
from engine.user_text import encode_prompt_text
from tinymodels.aup import table_aup, tokens_per_forward
from tinymodels.checker import graded_part, is_correct
from tinymodels.prompt_forms import PROMPT_FORMS
from tinymodels.tasks import DEFAULT_MIX, Problem, sample


@dataclass(frozen=True)
class EvalConfig:
    name: str
    params: dict[str, Any]


def dual_cache_refresh(architecture: str) -> int:
    """Steps between full refreshes of the dual cache in the benchmark rows (the papers' settings)."""
    return 16 if architecture == "llada" else 8


def default_configs(architecture: str, gen_length: int = 128, block_length: int = 32) -> list[EvalConfig]:
    """The paper's comparison and ablation rows, on the built-in canvas. A block-diffusion model
    gets its family's decoders and CAI in block mode (pass the block it was trained with)."""
    base = {"gen_length": gen_length, "block_length": block_length, "steps": gen_length}
    if FAMILIES[architecture].mode == "block":  # no dual cache, their own policies (docs/decoding.md)
        # LLaDA2.1's decoder (token editing) is the LLaDA2 family's own
        return block_configs(base) + (edit_configs(base) if architecture == "llada2" else [])
    if FAMILIES[architecture].mode == "uniform":
        return uniform_configs(gen_length)
    refresh = dual_cache_refresh(architecture)
    cai = {**base, "policy": "cai", "cache": "dual", "refresh_interval": refresh}
    rows = [
        EvalConfig("fixed", {**base, "policy": "fixed", "early_exit": False}),
        EvalConfig("fixed+exit", {**base, "policy": "fixed"}),
        EvalConfig("fixed dual", {**base, "policy": "fixed", "cache": "dual", "refresh_interval": refresh}),
        EvalConfig("threshold 0.9", {**base, "policy": "threshold", "threshold": 0.9, "early_exit": False}),
        EvalConfig("threshold 0.9 dual (Fast-dLLM)", {**base, "policy": "threshold", "threshold": 0.9,
                                                       "cache": "dual", "early_exit": False}),
        EvalConfig("threshold 0.9 dual+exit", {**base, "policy": "threshold", "threshold": 0.9, "cache": "dual"}),
        EvalConfig("CAI +APD", {**cai, "block_schedule": False, "position_factors": False, "gating": False}),
        EvalConfig("CAI +APD+Block", {**cai, "position_factors": False, "gating": False}),
        EvalConfig("CAI +APD+Block+Budget", {**cai, "gating": True}),
        EvalConfig("CAI full, gate on", {**cai, "gating": True, "early_exit": False}),
        EvalConfig("CAI full, gate on +exit", {**cai, "gating": True}),
        EvalConfig("CAI full, gate off +exit", {**cai, "gating": False}),
    ]
    return rows


def block_configs(base: dict[str, Any]) -> list[EvalConfig]:
    """SDAR's decoders (one token per step / every candidate above 0.9, as the fixed and Fast-dLLM
    rows) and CAI per block, gated (the default for SDAR) and not."""
    return [
        EvalConfig("block-static", {**base, "policy": "block-static"}),
        EvalConfig("block-dynamic 0.9", {**base, "policy": "block-dynamic", "threshold": 0.9}),
        EvalConfig("CAI full, gate on", {**base, "policy": "cai", "gating": True}),
        EvalConfig("CAI full, gate off", {**base, "policy": "cai", "gating": False}),
    ]


def edit_configs(base: dict[str, Any]) -> list[EvalConfig]:
    """LLaDA2.1's decoder at its defaults: commits above `threshold`, edits above `editing_threshold`."""
    return [EvalConfig("block-edit (LLaDA2.1)", {**base, "policy": "block-edit"})]


def uniform_configs(gen_length: int) -> list[EvalConfig]:
    """A uniform-noise model (DiffusionGemma): the official stopping rule and the convergence-aware
    one, each with the checkpoint's generation_config and the same seed for every request (each
    request draws from its own generator: the report does not depend on the batch)."""
    base = {"gen_length": gen_length, "seed": 0}
    return [EvalConfig("dg-official", {**base, "policy": "dg-official"}),
            EvalConfig("dg-converge", {**base, "policy": "dg-converge"})]


def wilson_interval(correct: int, total: int, z: float = 1.96) -> tuple[float, float]:
    if total == 0:
        return (0.0, 0.0)
    p = correct / total
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    return (centre - half, centre + half)


@dataclass
class ConfigReport:
    name: str
    params: dict[str, Any]
    n: int = 0
    correct: int = 0
    unparsed: int = 0
    by_kind: dict[str, list[int]] = field(default_factory=dict)  # kind -> [correct, total]
    nfe: int = 0
    nfe_content: int = 0  # forwards spent on blocks that hold at least one non-end token
    generated_tokens: int = 0
    steps_saved: int = 0
    fixed_budget: int = 0
    forced: int = 0
    grinding_exits: int = 0
    bands: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        low, high = wilson_interval(self.correct, self.n)
        return {
            "name": self.name, "params": self.params, "n": self.n, "accuracy": self.correct / max(1, self.n),
            "accuracy_95ci": [low, high], "unparsed": self.unparsed,
            "accuracy_by_kind": {k: c / t for k, (c, t) in sorted(self.by_kind.items())},
            "nfe_per_request": self.nfe / max(1, self.n),
            "nfe_per_request_content_blocks": self.nfe_content / max(1, self.n),
            "nfe_per_generated_token": self.nfe / max(1, self.generated_tokens),
            "tokens_per_forward": tokens_per_forward(self.generated_tokens, self.nfe),
            "steps_saved_pct": 100 * self.steps_saved / max(1, self.fixed_budget),
            "generated_tokens_per_s": self.generated_tokens / max(1e-9, self.seconds),
            "forced_commits_per_request": self.forced / max(1, self.n),
            "grinding_exits_per_request": self.grinding_exits / max(1, self.n),
            "first_step_confidence_bands": self.bands, "seconds": self.seconds,
        }


def _content_nfe(result: GenerationResult, end_ids: Sequence[int], block_length: int) -> int:
    """Forwards spent on blocks that are not entirely end tokens (early exit makes the difference)."""
    ids = result.generated_ids
    total = 0
    for b, steps in enumerate(result.stats.steps_per_block):
        block = ids[b * block_length:(b + 1) * block_length]
        if block and not all(t in end_ids for t in block):
            total += steps
    return total


def prompt_ids(engine: Engine, problem: Problem, form: str) -> list[int]:
    """The ids the server would decode for this problem sent in this form."""
    if form == "chat":
        return chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": problem.prompt}],
                               mask_id=engine.model.special.mask_id)
    if form == "plain":
        return encode_prompt_text(engine.tokenizer, problem.prompt, engine.model.special.mask_id)
    raise ValueError(f"prompt form must be one of {', '.join(PROMPT_FORMS)}, got {form!r}")


def evaluate(engine: Engine, problems: Sequence[Problem], configs: Sequence[EvalConfig], batch_size: int = 8,
             progress: Optional[Any] = None, on_progress: Optional[Callable[[int, float], None]] = None,
             prompt_form: str = "chat") -> list[ConfigReport]:
    """Every configuration on every problem; `progress(report)` after each configuration,
    `on_progress(index, done)` after every engine step, `done` the problems of configuration `index`
    decoded so far, a problem being decoded counted by the share of its canvas committed."""
    if engine.tokenizer is None:
        raise ValueError("evaluation needs the checkpoint's tokenizer")
    prompts = [prompt_ids(engine, p, prompt_form) for p in problems]
    end_ids = engine.model.special.end_ids
    reports = []
    for index, config in enumerate(configs):
        # the engine's defaults: a block-diffusion model decodes with the block it was trained with
        params = engine.default_params(DecodeParams.from_dict(config.params))
        report = ConfigReport(config.name, config.params)
        # one warm-up request so first-call allocations are not timed
        runner = Engine.from_model(engine.model, engine.tokenizer, batch_size)
        runner.generate(prompts[:1], params)
        start = time.perf_counter()
        step_progress = (lambda done, index=index: on_progress(index, done)) if on_progress else None
        results = runner.generate(prompts, params, on_progress=step_progress)
        report.seconds = time.perf_counter() - start
        for problem, result in zip(problems, results, strict=True):
            text = result.text or ""
            answer = graded_part(problem.prompt, text)
            ok = is_correct(problem.prompt, text)
            report.n += 1
            report.correct += ok
            report.unparsed += answer is None
            kind = report.by_kind.setdefault(problem.kind, [0, 0])
            kind[0] += ok
            kind[1] += 1
            stats = result.stats
            report.nfe += stats.nfe
            report.nfe_content += _content_nfe(result, end_ids, params.effective_block_length)
            generated = result.response_ids if result.end_index is None else result.generated_ids[:result.end_index + 1]
            report.generated_tokens += len(generated)
            report.steps_saved += stats.steps_saved
            report.fixed_budget += stats.fixed_step_budget
            report.forced += stats.forced_commits
            report.grinding_exits += stats.grinding_exits
            for i, count in enumerate(stats.first_step_confidence_bands):
                report.bands[i] += count
        reports.append(report)
        if progress is not None:
            progress(report)
    return reports


def hardware() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def held_out_problems(n: int, seed: int, mix: Optional[dict[str, float]] = None) -> list[Problem]:
    return sample(n, seed, split="eval", mix=mix)


def model_mix(model: str) -> dict[str, float]:
    """The task mix a built-in model was trained on, as its training log records it (a model is
    asked about the kinds it learned); DEFAULT_MIX for a checkpoint without one."""
    try:
        log = json.loads((model_dir(model) / "training_log.json").read_text())
        mix = log["config"]["mix"]
    except (OSError, ValueError, KeyError, TypeError):
        return dict(DEFAULT_MIX)
    if not isinstance(mix, dict) or not mix:
        return dict(DEFAULT_MIX)
    return {str(kind): float(weight) for kind, weight in mix.items()}


def format_kind_table(reports: Sequence[ConfigReport]) -> str:
    """Accuracy by task kind, one row per configuration."""
    kinds = sorted({kind for r in reports for kind in r.by_kind})
    lines = [f"| {'configuration':32s} | " + " | ".join(kinds) + " |", "|" + "---|" * (len(kinds) + 1)]
    for r in reports:
        cells = [f"{100 * r.by_kind[k][0] / r.by_kind[k][1]:.1f}% of {r.by_kind[k][1]}" if k in r.by_kind else "–"
                 for k in kinds]
        lines.append(f"| {r.name:32s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_dicts(reports: Sequence[ConfigReport]) -> list[dict[str, Any]]:
    """Each configuration's report with its AUP against the table's first row (`tinymodels.aup`):
    `aup`, and `aup_counted`, false where the row is more than 5 points below the first and only the
    first row's point made its AUP."""
    rows = [r.as_dict() for r in reports]
    scores = table_aup([(d["tokens_per_forward"], 100 * d["accuracy"]) for d in rows])
    return [{**d, "aup": score.aup, "aup_counted": score.counted, "aup_baseline": rows[0]["name"]}
            for d, score in zip(rows, scores, strict=True)]


def format_table(reports: Sequence[ConfigReport]) -> str:
    header = (f"| {'configuration':32s} | accuracy (95% CI) | NFE/req | NFE/req content | NFE/token | "
              f"steps saved | TPF | AUP | tok/s | unparsed |")
    lines = [header, "|" + "---|" * 10]
    rows = table_dicts(reports)
    for d in rows:
        low, high = d["accuracy_95ci"]
        tpf = "–" if d["tokens_per_forward"] is None else f"{d['tokens_per_forward']:.2f}"
        aup = "–" if d["aup"] is None else f"{d['aup']:.1f}{'' if d['aup_counted'] else '†'}"
        lines.append(f"| {d['name']:32s} | {100 * d['accuracy']:5.1f}% ({100 * low:.1f}–{100 * high:.1f}) | "
                     f"{d['nfe_per_request']:7.1f} | {d['nfe_per_request_content_blocks']:15.1f} | "
                     f"{d['nfe_per_generated_token']:9.3f} | {d['steps_saved_pct']:10.1f}% | {tpf:>5} | {aup:>7} | "
                     f"{d['generated_tokens_per_s']:5.0f} | {d['unparsed']:8d} |")
    if rows:
        dropped = any(d["aup"] is not None and not d["aup_counted"] for d in rows)
        lines.append("")  # a line right below a markdown table would be read as one more row
        lines.append(f"TPF: generated tokens per forward. AUP: d3LLM's accuracy under parallelism (arXiv:2601.07568), "
                     f"each row over two points, the first row ({rows[0]['name']}) and its own"
                     + ("; †: more than 5 points below the first row, so only the first row's point counts"
                        if dropped else "") + ".")
    return "\n".join(lines)
