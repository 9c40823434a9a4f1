"""The official side of `bench/block_vs_official.py`: decodes a job's prompts with an official SDAR
decoder, imported at run time from `--official-dir`, and prints one JSON line (seconds, tokens,
forwards). Runs in the scratch venv (README.md beside this file), never in the project's.

Decoder A (`generate.py`) takes one prompt a call. Decoder B (`huggingface_bd3.py`, the evaluation
decoder) takes a batch but ignores the attention mask, so a call may only hold prompts of equal
length (`equal_length_batches`); it also stops every row of a call once any row has a stop id in its
finished blocks, so a row can come back cut short (counted as `cut_short`).

Greedy: neither decoder has a temperature-0 path (A divides by the temperature, B asserts it is
positive), so they run at temperature 1, no top-k/top-p, with `torch.multinomial` replaced in this
process by the argmax; the confidence is what the decoders compute, softmax gathered at that token
(as the fixtures' official runs: tests/fixtures/block/sdar/README.md, section 1.1).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODEL_CODE = Path("training/model/SDAR-8B-Chat")
DECODER_A = Path("generate.py")
DECODER_B = Path("evaluation/opencompass/opencompass/models/huggingface_bd3.py")
# decoder B's decoding functions: from this line of the file to the next function (its first lines
# import opencompass and mmengine, which these functions do not use)
B_START, B_END = "## bd3 generation", "def forward_add_noise"


def equal_length_batches(lengths: list[int], batch: int) -> list[list[int]]:
    """Prompt indices in calls of at most `batch` prompts of one length, in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for index, length in enumerate(lengths):
        groups.setdefault(length, []).append(index)
    return [group[i:i + batch] for group in groups.values() for i in range(0, len(group), batch)]


def response(generated: list[int], gen_length: int, stop_ids: list[int]) -> list[int]:
    """The first `gen_length` generated tokens, up to and including the first stop id (the official
    decoders decode whole blocks past it)."""
    generated = generated[:gen_length]
    end = next((i for i, token in enumerate(generated) if token in stop_ids), None)
    return generated if end is None else generated[:end + 1]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_model_code(official: Path) -> types.ModuleType:
    """`modeling_sdar` as a submodule of a package over the official model directory (its imports
    are relative)."""
    package = types.ModuleType("sdar_official_model")
    package.__path__ = [str(official / MODEL_CODE)]
    sys.modules[package.__name__] = package
    return importlib.import_module(f"{package.__name__}.modeling_sdar")


def load_decoder(official: Path, name: str) -> Callable[..., Any]:
    path = official / (DECODER_A if name == "generate" else DECODER_B)
    if name == "generate":
        spec = importlib.util.spec_from_file_location("sdar_generate", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.block_diffusion_generate
    source = path.read_text()
    if B_START not in source or B_END not in source:
        raise SystemExit(f"{path}: no decoding functions between {B_START!r} and {B_END!r}")
    start, end = source.index(B_START), source.index(B_END)
    # blank lines before the slice keep the file's line numbers in tracebacks
    code = compile("\n" * source.count("\n", 0, start) + source[start:end], str(path), "exec")
    namespace: dict[str, Any] = {"__name__": "sdar_huggingface_bd3"}
    exec(code, namespace)
    return namespace["block_diffusion_generate"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--official-dir", type=Path, required=True)
    parser.add_argument("--job", type=Path, required=True, help="JSON: model, prompts, gen_length, block_length")
    parser.add_argument("--decoder", choices=("generate", "bd3"), required=True)
    parser.add_argument("--threshold", type=float, help="dynamic decoding's threshold; none: static")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.decoder == "generate" and args.batch != 1:
        parser.error("generate.py decodes one prompt a call (--batch 1)")

    import torch

    torch.set_num_threads(args.threads)
    torch.multinomial = lambda probs, num_samples=1, **_: probs.argmax(-1, keepdim=True)  # greedy (docstring)
    job = json.loads(args.job.read_text())
    model_dir = Path(job["model"])
    config = json.loads((model_dir / "config.json").read_text())
    eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id", config["eos_token_id"])
    stop_ids = eos if isinstance(eos, list) else [eos]
    mask_id, gen_length, block = config["mask_token_id"], job["gen_length"], job["block_length"]

    model = load_model_code(args.official_dir).SDARForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    decode = load_decoder(args.official_dir, args.decoder)
    forwards = [0]
    forward = model.forward

    def counted_forward(*a: Any, **k: Any) -> Any:
        forwards[0] += 1
        return forward(*a, **k)

    model.forward = counted_forward

    def call(rows: list[list[int]]) -> list[list[int]]:
        ids = torch.tensor(rows)
        if args.decoder == "generate":
            out = decode(model, {"input_ids": ids}, mask_id, gen_length=gen_length, block_length=block,
                         denoising_steps=block, temperature=1.0, top_k=0, top_p=1.0,
                         remasking_strategy="low_confidence_static" if args.threshold is None
                         else "low_confidence_dynamic", confidence_threshold=args.threshold,
                         stopping_criteria_idx=stop_ids)
        else:
            out = decode(model, None, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, mask_id,
                         gen_length=gen_length, block_length=block, denoising_steps=block, temperature=1.0,
                         top_k=0, top_p=1.0, remasking="low_confidence",
                         threshold=1.0 if args.threshold is None else args.threshold,
                         stopping_criteria_idx=stop_ids)
        return out[:, ids.shape[1]:].tolist()

    prompts: list[list[int]] = job["prompts"]
    calls = equal_length_batches([len(p) for p in prompts], args.batch)
    call([prompts[calls[0][0]]])  # first-call allocations are not timed
    forwards[0] = 0
    generated: list[list[int]] = [[] for _ in prompts]
    per_request = [0] * len(prompts)
    start = time.perf_counter()
    for indices in calls:
        before = forwards[0]
        for index, row in zip(indices, call([prompts[i] for i in indices]), strict=True):
            generated[index] = row
            per_request[index] = forwards[0] - before  # every row of a call is fed every forward
    seconds = time.perf_counter() - start
    outputs = [response(row, gen_length, stop_ids) for row in generated]
    cut_short = sum(mask_id in out for out in outputs)
    import transformers

    files = {str(p): sha256(args.official_dir / p) for p in (MODEL_CODE / "modeling_sdar.py", DECODER_A, DECODER_B)}
    print(json.dumps({"seconds": seconds, "outputs": outputs, "forwards": per_request, "model_calls": forwards[0],
                      "decode_calls": len(calls), "cut_short": cut_short, "sha256": files,
                      "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}))


if __name__ == "__main__":
    main()
