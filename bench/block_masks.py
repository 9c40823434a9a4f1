"""LLaDA2.1's official additive 0/1 mask against the exact block-causal cache, on the tiny LLaDA2
fixture checkpoint (random weights, float32): what the mask changes in the logits, and in the
decoded tokens and forwards. Accuracy only: nothing here is timed.

    PYTHONPATH=$PWD python bench/block_masks.py --fixtures tests/fixtures \
        > bench/results/block_masks_llada2_tiny_cpu.txt

1. Logits: every forward of the official LLaDA2.1 golden runs (`v21p`, their recorded window inputs)
   through both masks of the engine's model: max |diff| of the current block's logits, and the
   share of block positions whose argmax differs.
2. Golden pairs: each official run against its `.log()` variant (the same settings through the
   block-causal mask, `variant_llada21logmask_*`): generated tokens in agreement, and NFE.
3. The engine: every LLaDA2.1 golden setting decoded with `block-edit` in both modes (the additive
   mask without a cache, the exact block-causal cache): tokens in agreement and NFE.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from engine import DecodeParams, Engine, load_model
from engine.models.block_transformer import BlockDiffusionTransformer


def _checkpoint(source: Path, mask_id: int, eos_id: int, scratch: Path) -> BlockDiffusionTransformer:
    """The fixture checkpoint with the golden runs' mask and eos ids as its special ids (the tiny
    config has none: the official generate() takes them as arguments)."""
    dest = scratch / f"eos{eos_id}"
    dest.mkdir(exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config["mask_token_id"] = mask_id
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_id]}))
    for weights in source.glob("*.safetensors"):
        if not (dest / weights.name).exists():
            (dest / weights.name).symlink_to(weights)
    return load_model(dest)


@torch.no_grad()
def logits_difference(model: BlockDiffusionTransformer, run: dict) -> tuple[float, int, int]:
    """(max |diff| of the block's logits, block positions whose argmax differs, block positions) over
    the run's forwards (its trace ends with the final state, which no forward saw)."""
    block = run["settings"]["block_length"]
    worst, differ, seen = 0.0, 0, 0
    for window in run["trace_model_inputs_then_final"][:run["nfe"]]:
        ids = torch.tensor(window).reshape(1, -1)  # batch 1
        additive = model(ids, block_size=block, mask="additive_01")[:, -block:]
        causal = model(ids, block_size=block, mask="block_causal")[:, -block:]
        worst = max(worst, (additive - causal).abs().max().item())
        differ += (additive.argmax(-1) != causal.argmax(-1)).sum().item()
        seen += additive.shape[1]
    return worst, differ, seen


def _agreement(a: list[int], b: list[int]) -> str:
    same = sum(x == y for x, y in zip(a, b, strict=False))
    return f"{same}/{max(len(a), len(b))}"


def _params(settings: dict, official: bool) -> DecodeParams:
    return DecodeParams(policy="block-edit", gen_length=settings["gen_length"], block_length=settings["block_length"],
                        threshold=settings["threshold"], editing_threshold=settings["editing_threshold"],
                        max_post_steps=settings["max_post_steps"], num_to_transfer=settings.get("num_to_transfer", 1),
                        early_exit=bool(settings.get("eos_early_stop", False)), temperature=0.0,
                        block_attention="additive_01" if official else "block_causal")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixtures", type=Path, default=Path(__file__).resolve().parents[1] / "tests" / "fixtures")
    args = parser.parse_args()
    family = args.fixtures.resolve() / "block" / "llada2"
    runs = {p.stem: json.loads(p.read_text()) for p in sorted((family / "golden").glob("*.json"))}
    official = {name: run for name, run in runs.items() if run["code_version"] == "v21p"}
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        models: dict[int, BlockDiffusionTransformer] = {}

        def model_for(run: dict) -> BlockDiffusionTransformer:
            s = run["settings"]
            if s["eos_id"] not in models:
                models[s["eos_id"]] = _checkpoint(family / "llada2_tiny", s["mask_id"], s["eos_id"], Path(scratch))
            return models[s["eos_id"]]

        print("1. current-block logits, additive_01 vs block_causal, on the official runs' forwards")
        print(f"{'run':44} {'forwards':>8} {'max |diff|':>10} {'argmax differs':>15}")
        for name, run in official.items():
            worst, differ, seen = logits_difference(model_for(run), run)
            print(f"{name:44} {run['nfe']:8d} {worst:10.2f} {differ:7d}/{seen:<7d}")

        print("\n2. golden pairs: official (additive 0/1) vs the .log() variant (block-causal)")
        for name, run in runs.items():
            if run["code_version"] != "v21log":
                continue
            twin = runs[name.replace("variant_llada21logmask_", "llada21_")]
            print(f"{twin['name']:44} tokens {_agreement(twin['returned_ids'][0], run['returned_ids'][0]):>6}  "
                  f"NFE {twin['nfe']} vs {run['nfe']}")

        print("\n3. the engine, block-edit: additive_01 (no cache) vs the exact block-causal cache")
        print(f"{'settings of':44} {'tokens':>7} {'NFE additive':>12} {'NFE exact':>9} {'= golden':>8}")
        for name, run in official.items():
            engine = Engine.from_model(model_for(run), max_batch=1)
            prompt = run["prompt_ids"][0]
            additive = engine.generate([prompt], _params(run["settings"], official=True))[0]
            exact = engine.generate([prompt], _params(run["settings"], official=False))[0]
            a, b = additive.generated_ids, exact.generated_ids
            golden = run["returned_ids"][0]
            matches = a[:len(golden)] == golden and additive.stats.nfe == run["nfe"]
            print(f"{name:44} {_agreement(a, b):>7} {additive.stats.nfe:12d} {exact.stats.nfe:9d} {matches!s:>8}")
        print(f"\ntorch {torch.__version__}, CPU, float32, 1 thread")


if __name__ == "__main__":
    main()
