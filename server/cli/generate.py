"""`cai-dllm generate`: decode prompts offline, a batch when several are given."""

from __future__ import annotations

import argparse
import json
from typing import Any

from server.cli.args import add_decode_flags, add_engine_flags, decode_overrides, fail


def add_parser(sub: Any) -> None:
    gen = sub.add_parser("generate", help="decode prompts offline (a batch when several are given)")
    gen.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    gen.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    gen.add_argument("--prompt-ids", action="append", help="comma-separated prompt token ids (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each --prompt as a user turn of the chat template")
    add_engine_flags(gen, ("device", "dtype", "max_batch", "quantization", "quantize_head", "threads",
                            "tensor_parallel_size"))
    gen.add_argument("--json", action="store_true", help="print one JSON object per request")
    add_decode_flags(gen)
    gen.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine import CheckpointError, DeviceError, EngineConfig, RequestError, load_tokenizer, start_engine
    from engine.chat import chat_prompt_ids
    from engine.decoding import DecodeParamError, DecodeParams
    from engine.user_text import encode_prompt_text

    try:
        params = DecodeParams.from_dict(decode_overrides(args))
        engine = start_engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                           max_batch=args.max_batch, quantization=args.quantization,
                                           quantize_head=args.quantize_head, threads=args.threads,
                                           tensor_parallel_size=args.tensor_parallel_size))
        tokenizer = engine.tokenizer
        if tokenizer is None and args.prompt:
            load_tokenizer(args.model)  # raises, saying why there is none
        prompts: list[list[int]] = []
        for text in args.prompt or []:
            if args.chat:
                prompts.append(chat_prompt_ids(tokenizer, [{"role": "user", "content": text}],
                                               mask_id=engine.model.special.mask_id))
            else:
                prompts.append(encode_prompt_text(tokenizer, text, engine.model.special.mask_id))
        for ids in args.prompt_ids or []:
            prompts.append([int(t) for t in ids.split(",") if t.strip()])
        results = engine.generate(prompts, params)
    except (CheckpointError, DeviceError, DecodeParamError, RequestError, ValueError) as err:
        return fail(err)
    for result in results:
        record = {"request_id": result.request_id, "prompt_ids": list(result.prompt_ids),
                  "generated_ids": result.generated_ids, "text": result.text,
                  "finish_reason": result.finish_reason, "nfe": result.stats.nfe,
                  "steps_per_block": result.stats.steps_per_block, **result.stats.as_dict()}
        if args.json:
            print(json.dumps(record))
        else:
            shown = result.text if result.text is not None else result.generated_ids
            print(f"{shown}\n  [{result.finish_reason}; NFE {result.stats.nfe}; steps saved "
                  f"{result.stats.steps_saved} of {result.stats.fixed_step_budget}]")
    return 0
