"""The prefix cache across requests (`--enable-prefix-caching`) on a block-diffusion model, on and off
in one run: time to first token, generated tokens/s and accuracy (exact match, `cai-dllm eval`'s
grader) of the same requests.

1. Shared context: `--requests` held-out problems behind one system prompt of about
   `--prefix-tokens` tokens (worked examples), all queued at once, `--batch` rows at a time.
2. Multi-turn chat: `--chats` conversations of `--turns` turns, each turn's prompt the previous
   turns, their answers and a new question; each turn's requests queued together.

Time to first token counts from queueing to the first final token (as the server's histogram
does); tokens are the responses' (before the end token). Each setting runs `--repeats` times in
a fresh engine, alternating on and off; the median run is shown. The bundled sdar-tiny was trained
on single questions, so a long context costs it its accuracy with the cache on and off alike: the
check that the cache changes nothing is that every answer is the same text on and off.

    python bench/prefix_cache.py > bench/results/prefix_cache_cpu.txt
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from engine import DecodeParams, Engine, EngineConfig
from engine.chat import chat_prompt_ids
from tinymodels.evaluate import held_out_problems
from tinymodels.tasks import answer_of, sample

REPO = Path(__file__).resolve().parents[1]


def run(engine: Engine, prompts: list[list[int]], params: DecodeParams) -> dict[str, Any]:
    """Queue every prompt at once and step until all finish: per request its time to first token,
    its result."""
    start = time.perf_counter()
    ids = [engine.add_request(p, params, queued_at=start) for p in prompts]
    first: dict[str, float] = {}
    results: dict[str, Any] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in first and (out.new_token_ids or out.result is not None):
                first[out.request_id] = time.perf_counter() - start
            if out.result is not None:
                results[out.request_id] = out.result
    seconds = time.perf_counter() - start
    ordered = [results[i] for i in ids]
    for result in ordered:
        result.text = engine.tokenizer.decode(result.response_ids, skip_special_tokens=True)
    return {"seconds": seconds, "ttft": [first[i] for i in ids], "results": ordered}


def context(engine: Engine, tokens: int) -> str:
    """A system prompt of worked examples, about `tokens` tokens long."""
    lines = ["Worked examples:"]
    for problem in sample(4 * tokens, seed=1, split="train"):
        lines.append(f"{problem.prompt} {problem.response}")
        if len(engine.tokenizer.encode("\n".join(lines), add_special_tokens=False)) >= tokens:
            break
    return "\n".join(lines)


def shared_context(engine: Engine, args: argparse.Namespace, params: DecodeParams) -> dict[str, Any]:
    system = context(engine, args.prefix_tokens)
    problems = held_out_problems(args.requests, 0)
    prompts = [chat_prompt_ids(engine.tokenizer, [{"role": "system", "content": system},
                                                  {"role": "user", "content": p.prompt}]) for p in problems]
    out = run(engine, prompts, params)
    out["correct"] = sum(answer_of(p.kind, r.text) == p.answer for p, r in zip(problems, out["results"], strict=True))
    out["prompt_tokens"] = sum(map(len, prompts))
    return out


def multi_turn(engine: Engine, args: argparse.Namespace, params: DecodeParams) -> dict[str, Any]:
    problems = held_out_problems(args.chats * args.turns, 2)
    chats: list[list[dict[str, str]]] = [[] for _ in range(args.chats)]
    total = {"seconds": 0.0, "ttft": [], "results": [], "correct": 0, "prompt_tokens": 0}
    for turn in range(args.turns):
        asked = problems[turn * args.chats:(turn + 1) * args.chats]
        for chat, problem in zip(chats, asked, strict=True):
            chat.append({"role": "user", "content": problem.prompt})
        prompts = [chat_prompt_ids(engine.tokenizer, chat) for chat in chats]
        out = run(engine, prompts, params)
        for chat, result in zip(chats, out["results"], strict=True):
            chat.append({"role": "assistant", "content": result.text})
        total["seconds"] += out["seconds"]
        total["ttft"] += out["ttft"]
        total["results"] += out["results"]
        total["prompt_tokens"] += sum(map(len, prompts))
        total["correct"] += sum(answer_of(p.kind, r.text) == p.answer
                                for p, r in zip(asked, out["results"], strict=True))
    return total


def row(label: str, out: dict[str, Any]) -> str:
    results = out["results"]
    tokens = sum(len(r.response_ids) for r in results)
    cached = sum(r.stats.cached_tokens for r in results)
    ttft = sorted(out["ttft"])
    p90 = ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))]
    return (f"| {label} | {statistics.median(ttft):.3f} | {p90:.3f} | {tokens / out['seconds']:.1f} | "
            f"{out['seconds']:.2f} | {out['correct']}/{len(results)} | {cached}/{out['prompt_tokens']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "sdar-tiny"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--gen-length", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    params = DecodeParams(policy="block-dynamic", threshold=0.9, gen_length=args.gen_length)
    header = ("| cache | TTFT median (s) | TTFT p90 (s) | generated tokens/s | wall (s) | correct | "
              "cached / prompt tokens |\n|---|---|---|---|---|---|---|")
    print(f"# bench/prefix_cache.py on {Path(args.model).name}: {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {args.threads} threads, batch {args.batch}, {params.policy} "
          f"{params.threshold}, gen_length {args.gen_length}, median of {args.repeats} runs")
    for title, workload in ((f"{args.requests} requests behind one ~{args.prefix_tokens}-token system prompt",
                             shared_context),
                            (f"{args.chats} chats x {args.turns} turns", multi_turn)):
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        for _ in range(args.repeats):
            for label in runs:
                engine = Engine(EngineConfig(model=args.model, max_batch=args.batch, threads=args.threads,
                                             enable_prefix_caching=label == "on"))
                engine.generate([[0]], engine.default_params(params))  # first-call costs, outside the timing
                if engine.prefix_cache is not None:
                    engine.prefix_cache.clear()
                runs[label].append(workload(engine, args, engine.default_params(params)))
        texts = {label: [[r.text for r in out["results"]] for out in outs] for label, outs in runs.items()}
        print(f"\n## {title}\n\n{header}")
        for label, outs in runs.items():
            print(row(label, sorted(outs, key=lambda o: o["seconds"])[len(outs) // 2]))
        print(f"\nsame answers with the cache on and off: {texts['on'] == texts['off']}")


if __name__ == "__main__":
    main()
