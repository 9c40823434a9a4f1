"""Held-out exact match of a DiffusionGemma-format built-in model under the official decoding rule,
through the reference loop (tinymodels/dg_reference.py), until the engine's uniform-noise mode
serves the family (`cai-dllm eval` then takes over).

    python -m tinymodels.dg_evaluate --model models/diffusiongemma-tiny --n 1000 --seed 0 --prompt-form chat

Problems are the held-out split (`tinymodels.tasks`, bucket 0) of the mix the model was trained on,
prompted as the server would send them (chat template or the bare text), decoded in batches of
left-padded prompts with the checkpoint's `generation_config.json` (flags override single fields) and
one torch generator seeded with `--seed` for every draw, as the official loop draws from the global
generator (so a row's draws depend on its batch). Graded by `tinymodels.checker` on the response up
to its first end token. Reported: accuracy with a 95 % Wilson interval, by kind, responses that do not
parse, the official per-row decoder-pass counter (`passes`: steps at whose start the row had neither
stopped nor ended) per request and per generated token, tokens per forward (TPF: generated tokens
over those passes, `tinymodels.aup`), and the batched decoder calls. AUP needs a curve of
configurations: `cai-dllm eval` gives it for its table; this loop decodes one configuration.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch

from engine import load_model, load_tokenizer
from engine.bundled import model_dir
from engine.chat import chat_prompt_ids
from engine.decoding.draws import GeneratorDraws
from engine.models.diffusion_gemma import DiffusionGemmaModel
from engine.user_text import encode_prompt_text
from tinymodels.aup import tokens_per_forward
from tinymodels.checker import graded_part, is_correct
from tinymodels.dg_reference import OfficialSettings, generate
from tinymodels.evaluate import held_out_problems, model_mix, wilson_interval
from tinymodels.prompt_forms import PROMPT_FORMS
from tinymodels.tasks import Problem


@dataclass
class OfficialReport:
    settings: dict[str, Any]
    prompt_form: str
    n: int = 0
    correct: int = 0
    unparsed: int = 0
    by_kind: dict[str, list[int]] = field(default_factory=dict)  # kind -> [correct, total]
    passes: int = 0  # the official per-row counter, summed
    generated_tokens: int = 0  # response tokens up to and including the first end token
    decoder_calls: int = 0  # batched decoder forwards
    canvases: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        low, high = wilson_interval(self.correct, self.n)
        return {**asdict(self), "accuracy": self.correct / max(1, self.n), "accuracy_95ci": [low, high],
                "accuracy_by_kind": {k: c / t for k, (c, t) in sorted(self.by_kind.items())},
                "passes_per_request": self.passes / max(1, self.n),
                "passes_per_generated_token": self.passes / max(1, self.generated_tokens),
                "tokens_per_forward": tokens_per_forward(self.generated_tokens, self.passes),
                "hardware": f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"}


def prompt_ids(model: DiffusionGemmaModel, tokenizer: Any, problem: Problem, form: str) -> list[int]:
    """The ids the server's chat and completions paths make of this problem."""
    mask_id = model.special.mask_id if model.special is not None else None
    if form == "chat":
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": problem.prompt}], mask_id=mask_id)
    if form == "plain":
        if mask_id is None:
            return list(tokenizer.encode(problem.prompt, add_special_tokens=False))
        return encode_prompt_text(tokenizer, problem.prompt, mask_id)
    raise ValueError(f"prompt form must be one of {', '.join(PROMPT_FORMS)}, got {form!r}")


def _left_padded(rows: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask


def evaluate_official(model: DiffusionGemmaModel, tokenizer: Any, problems: Sequence[Problem],
                      settings: OfficialSettings, prompt_form: str = "chat", batch_size: int = 100,
                      seed: int = 0) -> OfficialReport:
    assert model.special is not None
    end_ids = set(settings.eos_ids)
    generator = torch.Generator(device=model.device).manual_seed(seed)
    draws = GeneratorDraws(generator, model.config.vocab_size)
    report = OfficialReport(settings=asdict(settings), prompt_form=prompt_form)
    started = time.perf_counter()
    for start in range(0, len(problems), batch_size):
        batch = problems[start:start + batch_size]
        ids, mask = _left_padded([prompt_ids(model, tokenizer, p, prompt_form) for p in batch], model.special.pad_id)
        with torch.inference_mode():
            out = generate(model, ids.to(model.device), settings, draws, attention_mask=mask.to(model.device))
        report.decoder_calls += sum(out.steps_per_canvas)
        report.canvases += len(out.steps_per_canvas)
        for problem, tokens, passes in zip(batch, out.tokens.tolist(), out.passes.tolist(), strict=True):
            end = next((i for i, t in enumerate(tokens) if t in end_ids), None)
            text = tokenizer.decode(tokens if end is None else tokens[:end])
            ok = is_correct(problem.prompt, text)
            report.n += 1
            report.correct += ok
            report.unparsed += graded_part(problem.prompt, text) is None
            kind = report.by_kind.setdefault(problem.kind, [0, 0])
            kind[0] += ok
            kind[1] += 1
            report.passes += passes
            report.generated_tokens += len(tokens) if end is None else end + 1
    report.seconds = time.perf_counter() - started
    return report


def format_report(report: OfficialReport) -> str:
    d = report.as_dict()
    low, high = (max(0.0, bound) for bound in d["accuracy_95ci"])
    kinds = ", ".join(f"{k} {100 * a:.1f}%" for k, a in d["accuracy_by_kind"].items())
    return (f"{report.prompt_form}: {100 * d['accuracy']:.1f}% ({100 * low:.1f}-{100 * high:.1f}) of {report.n}; "
            f"{kinds}; unparsed {report.unparsed}; decoder passes/request {d['passes_per_request']:.1f}, "
            f"/generated token {d['passes_per_generated_token']:.3f}; TPF {_tpf(d['tokens_per_forward'])}; "
            f"batched decoder calls "
            f"{report.decoder_calls} over {report.canvases} canvases; {report.seconds:.0f} s")


def _tpf(value: Optional[float]) -> str:
    return "–" if value is None else f"{value:.2f}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0, help="held-out problems and the generator's draws")
    parser.add_argument("--prompt-form", choices=PROMPT_FORMS, default="chat")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--threads", type=int)
    overrides = {"max_denoising_steps": int, "entropy_bound": float, "t_min": float, "t_max": float,
                 "stability_threshold": int, "confidence_threshold": float}
    for name, kind in overrides.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, help="override generation_config.json")
    parser.add_argument("--out", help="write the report here as .txt and .json (a path without suffix)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model)
    if not isinstance(model, DiffusionGemmaModel):
        parser.error(f"{args.model} is not a DiffusionGemma checkpoint")
    gen = json.loads((model_dir(args.model) / "generation_config.json").read_text())
    settings = OfficialSettings.from_generation_config(gen)
    settings = replace(settings, **{k: getattr(args, k) for k in overrides if getattr(args, k) is not None})
    problems = held_out_problems(args.n, args.seed, model_mix(args.model))
    report = evaluate_official(model, load_tokenizer(args.model), problems, settings, args.prompt_form,
                               args.batch_size, args.seed)
    line = format_report(report)
    print(line)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".txt").write_text(line + "\n")
        Path(args.out + ".json").write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
