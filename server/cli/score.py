"""`cai-dllm score`: log-likelihood of continuations after a context (the server's echo + logprobs estimator)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from server.cli.args import add_engine_flags, fail


def add_parser(sub: Any) -> None:
    sc = sub.add_parser("score", help="log-likelihood of continuations after a context (LLaDA's Monte-Carlo "
                                      "estimator, as the server's echo + logprobs)")
    sc.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    sc.add_argument("--context", required=True, help="the text the continuations follow")
    sc.add_argument("--continuation", action="append", required=True, help="a continuation to score (repeatable)")
    sc.add_argument("--chat", action="store_true", help="wrap --context as a user turn of the chat template")
    sc.add_argument("--samples", type=int, default=None, help="samples per split (default: the decoding default)")
    sc.add_argument("--seed", type=int, default=0, help="seeds the masks: the same seed, the same numbers")
    add_engine_flags(sc, ("device", "dtype", "quantization", "quantize_head", "threads",
                           "tensor_parallel_size"))
    sc.add_argument("--json", action="store_true", help="print one JSON object per continuation")
    sc.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine import CheckpointError, DeviceError, EngineConfig, RequestError, start_engine
    from engine.chat import chat_prompt_ids
    from engine.user_text import encode_prompt_text
    from server.cli.progress import Progress

    try:
        engine = start_engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                           quantization=args.quantization, quantize_head=args.quantize_head,
                                           threads=args.threads, tensor_parallel_size=args.tensor_parallel_size))
        if engine.tokenizer is None:
            raise CheckpointError("scoring text needs a checkpoint with a tokenizer")
        mask = engine.model.special.mask_id
        context = (chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": args.context}], mask_id=mask)
                   if args.chat else encode_prompt_text(engine.tokenizer, args.context, mask))
        # every job first (their masks drawn), so the bar knows the whole work: the tokens fed to the model
        jobs = [engine.scoring_job([*context, *encode_prompt_text(engine.tokenizer, text, mask)], args.samples,
                                   args.seed) for text in args.continuation]
    except (CheckpointError, DeviceError, RequestError, ValueError) as err:
        return fail(err)
    progress = Progress(sum(job.total_tokens for job in jobs), "tokens", "scoring ", decimals=0)
    rows = []
    for text, job in zip(args.continuation, jobs, strict=True):
        while not job.done:
            progress.at(progress.bar.n + job.advance())
        values = job.logprobs()[len(context):]
        rows.append({"continuation": text, "logprob": sum(v for v in values if v is not None),
                     "tokens": len(values), "token_logprobs": values})
    progress.close()
    best = max(range(len(rows)), key=lambda i: rows[i]["logprob"])
    for i, row in enumerate(rows):
        if args.json:
            print(json.dumps(row))
        else:
            mark = "  <- most likely" if len(rows) > 1 and i == best else ""
            print(f"{row['logprob']:10.3f}  ({row['tokens']} tokens)  {row['continuation']!r}{mark}")
    return 0
