"""The server under 1 and 8 concurrent clients against the offline engine, on the same requests.

The same held-out chat prompts and decoding knobs go (a) through `engine.generate` with
max_batch 8 in this process, (b) through a `cai-dllm serve` subprocess from 1 client at a time and
(c) from 8 concurrent clients. Reported: generated tokens/s (completion tokens only, wall clock),
the server/offline ratio at concurrency 8, and the speed-up of 8 clients over 1. Every request is
checked to give the same text through the server as offline (temperature 0).

    python bench/server_vs_offline.py --model models/llada-tiny --n 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from engine import Engine, EngineConfig
from engine.builtin.evaluate import hardware, held_out_problems
from engine.chat import chat_prompt_ids
from engine.decoding import DecodeParams

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_clients(base: str, bodies: list[dict], concurrency: int) -> tuple[float, list[dict]]:
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(body: dict) -> dict:
            async with semaphore:
                response = await client.post(f"{base}/v1/chat/completions", json=body)
                response.raise_for_status()
                return response.json()

        start = time.perf_counter()
        results = await asyncio.gather(*(one(b) for b in bodies))
        return time.perf_counter() - start, list(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "llada-tiny"))
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    decoding = {"policy": "cai", "cache": "dual", "refresh_interval": 16, "block_length": 32}

    engine = Engine(EngineConfig(model=args.model, max_batch=8, device=args.device))
    problems = held_out_problems(args.n, args.seed)
    messages = [[{"role": "user", "content": p.prompt}] for p in problems]
    prompts = [chat_prompt_ids(engine.tokenizer, m) for m in messages]
    params = engine.default_params(DecodeParams(gen_length=args.max_tokens, steps=args.max_tokens, **decoding))
    engine.generate(prompts[:8], params)  # warm-up
    start = time.perf_counter()
    offline = engine.generate(prompts, params)
    offline_seconds = time.perf_counter() - start
    offline_tokens = sum(len(r.response_ids) for r in offline)

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", args.model, "--port", str(port),
                               "--max-batch", "8", "--device", args.device,
                               "--log-level", "warning"], cwd=REPO, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise RuntimeError("server exited")
            time.sleep(0.2)
        bodies = [{"model": Path(args.model).name, "messages": m, "max_tokens": args.max_tokens,
                   "decoding": decoding} for m in messages]
        asyncio.run(run_clients(base, bodies[:8], 8))  # warm-up
        rows = {}
        for concurrency in (1, 8):
            seconds, results = asyncio.run(run_clients(base, bodies, concurrency))
            tokens = sum(r["usage"]["completion_tokens"] for r in results)
            same = sum(r["choices"][0]["message"]["content"] == o.text for r, o in zip(results, offline, strict=True))
            rows[concurrency] = (seconds, tokens, same)
    finally:
        server.terminate()
        server.wait(60)

    print(f"# {args.n} held-out chat requests, max_tokens {args.max_tokens}, decoding {decoding}")
    print(f"# {hardware()}, torch {torch.__version__}, model {args.model}")
    print(f"{'setting':24s} {'seconds':>8s} {'gen tokens':>10s} {'tokens/s':>9s} {'same text':>9s}")
    print(f"{'offline (max_batch 8)':24s} {offline_seconds:8.2f} {offline_tokens:10d} "
          f"{offline_tokens / offline_seconds:9.1f} {'-':>9s}")
    for concurrency, (seconds, tokens, same) in rows.items():
        print(f"{f'server, {concurrency} client(s)':24s} {seconds:8.2f} {tokens:10d} {tokens / seconds:9.1f} "
              f"{same:>4d}/{args.n}")
    server8 = rows[8][1] / rows[8][0]
    print(f"server(8) / offline throughput: {server8 / (offline_tokens / offline_seconds):.3f}")
    print(f"server 8 clients / 1 client throughput: {server8 / (rows[1][1] / rows[1][0]):.2f}x")


if __name__ == "__main__":
    main()
