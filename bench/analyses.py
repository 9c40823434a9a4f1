"""The paper's analyses, reproduced on a built-in model, as PNG plots plus a JSON of the numbers.

1. First-step confidence band vs stabilization step (paper Fig. 1c): the fixed one-token-per-step
   decoder runs on held-out problems while every position's top prediction is recorded at every
   step; a token is stable from the first step after which its top prediction stays unchanged for
   three steps. Tokens are grouped by their confidence at their block's first step (> 0.5,
   0.25-0.5, < 0.25). Only answer tokens count (positions up to the first end token).
2. Steps saved per block (paper Fig. 1b): full CAI against the fixed budget, block by block.
3. Generation-length sweep, 64 / 96 / 128 by default (the paper's throughput table): accuracy, NFE and
   generated tokens/s for fixed, Fast-dLLM (threshold 0.9, dual cache) and CAI, on held-out problems
   whose reference response fits the canvas.

    python bench/analyses.py --model models/llada-tiny --n 200 --out docs/figures
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from engine import Engine, EngineConfig
from engine.chat import chat_prompt_ids
from engine.decoding.policies import CONF_HIGH, CONF_LOW
from tinymodels.evaluate import EvalConfig, dual_cache_refresh, evaluate, hardware, held_out_problems, model_mix
from tinymodels.tasks import parse_mix

BANDS = ("> 0.5", "0.25 – 0.5", "< 0.25")
STABLE_FOR = 3


@torch.no_grad()
def trace_fixed_decoding(engine: Engine, prompts: list[list[int]], gen_length: int, block_length: int):
    """Decode one token per step (LLaDA's fixed schedule, no cache) and record, per row, every
    step's top prediction for the whole canvas and each position's first-step confidence."""
    model = engine.model
    mask_id, pad_id = model.special.mask_id, model.special.pad_id
    shift = 1 if model.logits_shifted else 0
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width + gen_length), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):width] = torch.tensor(prompt, device=device)
        attention[i, width - len(prompt):] = 1
    ids[:, width:] = mask_id
    predictions, first_conf = [], torch.zeros(len(prompts), gen_length)
    for block in range(gen_length // block_length):
        start = width + block * block_length
        for step in range(block_length):
            logits = model(ids, attention_mask=attention).float()
            if shift:
                logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
            probs = logits[:, width:].softmax(-1)
            conf, x0 = probs.max(-1)
            predictions.append(x0)
            if step == 0:
                first_conf[:, block * block_length:(block + 1) * block_length] = \
                    conf[:, block * block_length:(block + 1) * block_length].cpu()
            block_conf = conf[:, start - width:start - width + block_length].clone()
            block_conf[ids[:, start:start + block_length] != mask_id] = -1.0
            pick = block_conf.argmax(-1)
            rows = torch.arange(len(prompts), device=device)
            ids[rows, start + pick] = x0[rows, start - width + pick]
    return torch.stack(predictions, dim=1).cpu(), first_conf, ids[:, width:].cpu()


def stabilization_steps(predictions: torch.Tensor) -> torch.Tensor:
    """[B, S, L] predictions -> [B, L] first step from which the top prediction stays the same for
    STABLE_FOR consecutive steps."""
    steps = predictions.shape[1]
    same = torch.ones_like(predictions[:, : steps - STABLE_FOR + 1], dtype=torch.bool)
    for k in range(1, STABLE_FOR):
        same &= predictions[:, k: steps - STABLE_FOR + 1 + k] == predictions[:, : steps - STABLE_FOR + 1]
    first = same.int().argmax(dim=1)
    return torch.where(same.any(dim=1), first, torch.full_like(first, steps))


def confidence_vs_stabilization(engine: Engine, problems, gen_length: int, block_length: int, out: Path) -> dict:
    prompts = [chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": p.prompt}]) for p in problems]
    end_ids = set(engine.model.special.end_ids)
    per_band: list[list[int]] = [[], [], []]
    by_kind: dict[str, list[int]] = {}  # kind -> answer tokens per band
    chunk = engine.config.max_batch
    for i in range(0, len(prompts), chunk):
        predictions, first_conf, final = trace_fixed_decoding(engine, prompts[i:i + chunk], gen_length,
                                                              block_length)
        # one step per token: block b is decoded during steps [b * block_length, (b + 1) * block_length)
        stable = torch.cat([stabilization_steps(predictions[:, b * block_length:(b + 1) * block_length,
                                                            b * block_length:(b + 1) * block_length])
                            for b in range(gen_length // block_length)], dim=1)
        for row in range(final.shape[0]):
            tokens = final[row].tolist()
            answer_len = next((j + 1 for j, t in enumerate(tokens) if t in end_ids), len(tokens))
            kind_bands = by_kind.setdefault(problems[i + row].kind, [0, 0, 0])
            for pos in range(answer_len):
                s = first_conf[row, pos].item()
                band = 0 if s > CONF_HIGH else 1 if s >= CONF_LOW else 2
                per_band[band].append(int(stable[row, pos]))
                kind_bands[band] += 1
    counts = [len(b) for b in per_band]
    total = sum(counts)
    means = [sum(b) / len(b) if b else float("nan") for b in per_band]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(BANDS, [100 * c / total for c in counts], color=["#4c9a2a", "#e0a030", "#c03030"])
    left.set_ylabel("% of answer tokens")
    left.set_xlabel("first-step confidence")
    left.set_title("answer tokens by first-step confidence")
    for band, values, colour in zip(BANDS, per_band, ["#4c9a2a", "#e0a030", "#c03030"], strict=True):
        if values:
            label = f"{band} (mean {sum(values) / len(values):.1f})"
            right.hist(values, bins=range(0, block_length + 2), alpha=0.55, label=label, color=colour, density=True)
    right.set_xlabel("stabilization step within the block (fixed decoder)")
    right.set_ylabel("density")
    right.set_title("when tokens stop changing")
    right.legend()
    fig.tight_layout()
    fig.savefig(out / "confidence_vs_stabilization.png", dpi=110)
    plt.close(fig)
    return {"tokens": total, "share": [c / total for c in counts], "mean_stabilization_step": means,
            "share_by_kind": {kind: {"tokens": sum(b), "share": [c / max(1, sum(b)) for c in b]}
                              for kind, b in sorted(by_kind.items())}}


def steps_saved_per_block(engine: Engine, problems, gen_length: int, block_length: int, out: Path,
                          architecture: str) -> dict:
    refresh = dual_cache_refresh(architecture)
    config = EvalConfig("CAI full", {"policy": "cai", "gen_length": gen_length, "block_length": block_length,
                                     "steps": gen_length, "cache": "dual", "refresh_interval": refresh,
                                     "early_exit": False})
    from engine.decoding import DecodeParams

    params = engine.default_params(DecodeParams.from_dict(config.params))
    prompts = [chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": p.prompt}]) for p in problems]
    results = engine.generate(prompts, params)
    blocks = gen_length // block_length
    per_block = [0.0] * blocks
    for result in results:
        for b, steps in enumerate(result.stats.steps_per_block):
            per_block[b] += (params.steps_per_block - steps) / params.steps_per_block
    per_block = [100 * v / len(results) for v in per_block]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([f"block {b + 1}" for b in range(blocks)], per_block, color="#3070b0")
    ax.set_ylabel("steps saved vs fixed (%)")
    ax.set_title("CAI: steps saved per block (no early exit)")
    fig.tight_layout()
    fig.savefig(out / "steps_saved_per_block.png", dpi=110)
    plt.close(fig)
    return {"steps_saved_pct_per_block": per_block}


def generation_length_sweep(engine: Engine, problems, out: Path, architecture: str,
                            lengths: tuple[int, ...]) -> dict:
    refresh = dual_cache_refresh(architecture)
    rows: dict[str, dict] = {}
    for gen_length in lengths:
        block = min(32, gen_length)
        fitting = [p for p in problems if len(p.response) < gen_length]
        base = {"gen_length": gen_length, "block_length": block, "steps": gen_length}
        configs = [EvalConfig("fixed", {**base, "policy": "fixed"}),
                   EvalConfig("Fast-dLLM (thr 0.9, dual)", {**base, "policy": "threshold", "threshold": 0.9,
                                                            "cache": "dual"}),
                   EvalConfig("CAI", {**base, "policy": "cai", "cache": "dual", "refresh_interval": refresh})]
        for report in evaluate(engine, fitting, configs, batch_size=engine.config.max_batch):
            d = report.as_dict()
            rows.setdefault(report.name, {})[gen_length] = {
                "n": d["n"], "accuracy": d["accuracy"], "nfe_per_request": d["nfe_per_request"],
                "tokens_per_s": d["generated_tokens_per_s"]}
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, by_length in rows.items():
        lengths = sorted(by_length)
        ax.plot(lengths, [by_length[g]["tokens_per_s"] for g in lengths], marker="o", label=name)
    ax.set_xlabel("generation length")
    ax.set_ylabel("generated tokens / s")
    ax.set_xticks(list(lengths))
    ax.set_title(f"throughput by generation length ({hardware()})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "generation_length_sweep.png", dpi=110)
    plt.close(fig)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("docs/figures"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=8, help="rows decoded together")
    parser.add_argument("--mix", type=parse_mix, help="task kinds and weights, KIND=WEIGHT,... (default: "
                                                      "the model's training mix, tinymodels.evaluate.model_mix)")
    # the bundled models' answers are 41-97 characters: at 32 no held-out problem would fit
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 96, 128],
                        help="generation lengths of the sweep (each a multiple of 32 or at most 32)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    engine = Engine(EngineConfig(model=args.model, device=args.device, max_batch=args.batch_size))
    name = Path(args.model).name
    mix = args.mix or model_mix(args.model)
    problems = held_out_problems(args.n, args.seed, mix)
    started = time.perf_counter()
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    report = {"model": args.model, "n": args.n, "seed": args.seed, "mix": mix, "hardware": hardware(),
              "confidence_vs_stabilization": confidence_vs_stabilization(engine, problems, 128, 32, out),
              "steps_saved_per_block": steps_saved_per_block(engine, problems, 128, 32, out, engine.architecture),
              "generation_length_sweep": generation_length_sweep(engine, problems, out, engine.architecture,
                                                                 tuple(args.lengths))}
    report["seconds"] = time.perf_counter() - started
    (out / "analyses.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
