"""The `cai-dllm` command line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional


def _inspect(args: argparse.Namespace) -> int:
    from engine.errors import CheckpointError
    from engine.inspect import describe_checkpoint, format_report

    try:
        report = describe_checkpoint(args.model_dir)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _add_decode_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per DecodeParams field (the same names as the API's `decoding` object)."""
    from engine.decoding.params import DecodeParams, field_types

    defaults = DecodeParams()
    group = parser.add_argument_group("decoding (see docs/cai.md)")
    for name, (kind, _optional) in field_types().items():
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        if kind is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=f"default: {default if default is not None else 'from the model'}")
        else:
            group.add_argument(flag, dest=name, type=kind, default=None, help=f"default: {default}")


def _decode_overrides(args: argparse.Namespace) -> dict[str, Any]:
    from engine.decoding.params import field_types

    return {name: getattr(args, name) for name in field_types() if getattr(args, name) is not None}


def _generate(args: argparse.Namespace) -> int:
    from engine import CheckpointError, DeviceError, load_model, load_tokenizer
    from engine.chat import chat_prompt_ids
    from engine.decoding import DecodeParamError, DecodeParams, RequestError, generate

    try:
        params = DecodeParams.from_dict(_decode_overrides(args))
        model = load_model(args.model, device=args.device, dtype=args.dtype)
        tokenizer = None
        try:
            tokenizer = load_tokenizer(args.model)
        except CheckpointError:
            if args.prompt:
                raise
        prompts: list[list[int]] = []
        for text in args.prompt or []:
            if args.chat:
                prompts.append(chat_prompt_ids(tokenizer, [{"role": "user", "content": text}]))
            else:
                prompts.append(list(tokenizer.encode(text, add_special_tokens=False)))
        for ids in args.prompt_ids or []:
            prompts.append([int(t) for t in ids.split(",") if t.strip()])
        results = generate(model, prompts, params, max_batch=args.max_batch, tokenizer=tokenizer)
    except (CheckpointError, DeviceError, DecodeParamError, RequestError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cai-dllm", description="Convergence-aware inference server "
                                     "for masked diffusion language models (LLaDA, Dream).")
    sub = parser.add_subparsers(dest="command", required=True)

    inspect = sub.add_parser("inspect", help="describe a local checkpoint directory without loading it")
    inspect.add_argument("model_dir", help="local Hugging Face checkpoint directory")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(func=_inspect)

    gen = sub.add_parser("generate", help="decode prompts offline (a batch when several are given)")
    gen.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    gen.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    gen.add_argument("--prompt-ids", action="append", help="comma-separated prompt token ids (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each --prompt as a user turn of the chat template")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--max-batch", type=int, default=8)
    gen.add_argument("--json", action="store_true", help="print one JSON object per request")
    _add_decode_flags(gen)
    gen.set_defaults(func=_generate)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate" and not (args.prompt or args.prompt_ids):
        parser.error("generate needs --prompt or --prompt-ids")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
