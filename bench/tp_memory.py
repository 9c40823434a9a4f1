"""Per-rank memory of the released models at --tensor-parallel-size 1/2/4/8, computed on the meta
device (no weights, no GPU): each rank's weights in bf16, int8 and int4 as the engine stores them
on CUDA (`engine.quantization.quantized_model_bytes` over the rank's share of the model, routed
experts quantized), its KV cache per token of a row, and the smallest listed GPU one rank fits.

A rank fits a GPU when its weights plus the KV cache of the reference load (`--rows` rows of
`--tokens` tokens, prompt + canvas, bf16 keys and values) take at most `--usable` of the card's
memory: the rest is for activations (one forward over the rows), the CUDA context and the allocator.
A size that does not divide the model (heads, experts, MLP widths; KV heads, unless the size is a
multiple of them: each is then replicated) is refused by the engine, and shows here as refused,
with the reason.

Configs (tests/fixtures/real/): LLaDA-8B-Instruct and SDAR-8B-Chat from their released config.json;
LLaDA2.0-mini and LLaDA2.0-flash from inclusionAI/dFactory's model configs (verbatim copies, README
there: the Hub's config.json of both agree with them on every size). DiffusionGemma-26B-A4B: no
released config.json is at hand; `bench/dg_step.py`'s `REAL_CONFIG` (its sizes as public
repositories quote them, sourced there). Its vocabulary is whole on every rank (not split), its
KV cache is its full layers' per token plus each row's sliding rings (`sliding_window - 1`
positions, whatever the row's length).

    python bench/tp_memory.py > bench/results/tp_memory.txt
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
from dg_step import REAL_CONFIG as DG_REAL_CONFIG

from engine.errors import TensorParallelError
from engine.models.gemma4_config import SLIDING
from engine.models.parallel.group import TensorParallel
from engine.models.parallel.sharding import check_divisible
from engine.models.registry import model_class_for
from engine.quantization import quantized_model_bytes

FIXTURES = Path(os.environ.get("CAI_DLLM_FIXTURES", Path(__file__).resolve().parents[1] / "tests" / "fixtures"))
REAL = FIXTURES / "real"
MODELS: dict[str, Union[Path, dict[str, Any]]] = {
    "LLaDA-8B": REAL / "llada-8b-instruct" / "config.json",
    "SDAR-8B": REAL / "sdar-8b-chat" / "config.json",
    "LLaDA2.0-mini": REAL / "llada2.0-mini" / "dfactory_llada2_mini_config.json",
    "LLaDA2.0-flash": REAL / "llada2.0-mini" / "dfactory_llada2_flash_config.json",
    "DiffusionGemma-26B-A4B": DG_REAL_CONFIG,
}
# nominal memory (GB = 1e9 bytes) of the cards a rank may run on, smallest first
GPUS = (("L4/RTX 4090", 24), ("A100-40GB", 40), ("H100/A100-80GB", 80), ("H200", 141), ("B200", 192))
SIZES = (1, 2, 4, 8)
MODES = ("none", "int8", "int4")
GB = 1e9


def rank_model(hf: dict[str, Any], size: int) -> Any:
    """Rank 0's share of the model on the meta device (every rank holds as much)."""
    cls = model_class_for(hf)
    config = cls.parse_config(hf)
    check_divisible(config, size)
    with torch.device("meta"):
        return cls(config, None, hf, TensorParallel(0, size))


def kv_bytes(model: Any, rows: int, tokens: int) -> tuple[int, int]:
    """(bf16 KV bytes a rank holds per token of a row, for `rows` rows of `tokens` tokens)."""
    config, item = model.config, torch.bfloat16.itemsize
    gemma = config.gemma
    if gemma is None:
        per_token = 2 * config.num_layers * model.kv_heads * config.head_dim * item
        return per_token, per_token * rows * tokens
    # DiffusionGemma: a full layer holds every position, a sliding layer a ring of `retained` per row
    per_token = ring = 0
    for layer, kind in zip(model.layers, gemma.layer_types, strict=True):
        width = 2 * layer.attn.num_kv_heads * layer.attn.head_dim * item
        if kind == SLIDING:
            ring += width * gemma.retained
        else:
            per_token += width
    return per_token, rows * (per_token * tokens + ring)


def smallest_fit(need: float, usable: float) -> Optional[str]:
    return next((name for name, memory in GPUS if need <= usable * memory * GB), None)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8, help="rows of the reference load (the default --max-batch)")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt + canvas tokens of each row")
    parser.add_argument("--usable", type=float, default=0.9, help="share of a card's memory weights + KV may take")
    args = parser.parse_args(argv)
    print("# per-rank memory at --tensor-parallel-size N, computed on the meta device (python bench/tp_memory.py)")
    print(f"# weights: bf16 (none), int8 (torchao) and int4 (bitsandbytes NF4) as stored on CUDA; embedding, "
          f"norms and head in bf16; KV: bf16, per token of a row and for {args.rows} rows x {args.tokens} tokens "
          f"(DiffusionGemma: per token its full layers, plus each row's sliding rings); "
          f"fits: smallest of {', '.join(f'{n} {m} GB' for n, m in GPUS)} holding weights + KV in "
          f"{args.usable:.0%} of its memory; GB = 1e9 bytes")
    print("| model | params | TP | KV per token | KV " + f"{args.rows}x{args.tokens}"
          + " | bf16 weights | fits | int8 weights | fits | int4 weights | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, source in MODELS.items():
        hf = source if isinstance(source, dict) else json.loads(source.read_text())
        whole = rank_model(hf, 1)
        params = sum(p.numel() for p in {id(p): p for p in whole.parameters()}.values())
        for size in SIZES:
            try:
                model = rank_model(hf, size)
            except TensorParallelError as err:
                print(f"| {name} | {params / 1e9:.1f} B | {size} | refused: {err} |")
                continue
            per_token, kv = kv_bytes(model, args.rows, args.tokens)
            cells = [name, f"{params / 1e9:.1f} B", str(size), f"{per_token / 1024:.0f} KiB", f"{kv / GB:.2f} GB"]
            for mode in MODES:
                weights = quantized_model_bytes(model, mode, torch.bfloat16, device_type="cuda")
                cells += [f"{weights / GB:.2f} GB", smallest_fit(weights + kv, args.usable) or "none listed"]
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
