"""`cai-dllm bench serve`: a load generator for any running cai-dllm server, in the spirit of
`vllm bench serve`.

Requests are streamed (so time to first token is measured as the client sees it) with
`stream_options.include_usage`, either at a fixed concurrency (closed loop) or at a Poisson request
rate (open loop). The report has request and output-token throughput, TTFT and end-to-end latency
(mean, p50, p90, p99), errors by status, steps saved and joules per token, and, on the built-in
dataset, exact-match accuracy next to the speed. A diffusion-decoding block (vLLM's `bench serve`
prints one) gives tokens per forward (TPF), generated tokens per step and steps per block (a
uniform-noise model: per canvas) from each response's own `decoding` summary and usage, and AUP
(d3LLM's accuracy under parallelism, `tinymodels.aup`) over this run's point and, given one, a
baseline run's.

The client is aiohttp, as in vLLM's serving benchmark: on a 2-core CPU that also runs the server,
httpx's async client added ~2.5 ms to each request's round trip (docs/server.md), time and CPU
the load generator would have put into the figures it reports.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import aiohttp
from tqdm import tqdm

from tinymodels.aup import accuracy_under_parallelism, counted_points, tokens_per_forward


@dataclass(frozen=True)
class LoadRequest:
    """One request of the workload: chat messages or a plain prompt, and the answer if it is known."""

    messages: Optional[list[dict[str, str]]] = None
    prompt: Optional[str] = None
    max_tokens: Optional[int] = None
    answer: Optional[str] = None
    kind: Optional[str] = None


@dataclass
class RequestOutcome:
    ok: bool
    status: int
    ttft: Optional[float] = None
    latency: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    nfe: int = 0
    steps: int = 0
    blocks: int = 0
    steps_saved: int = 0
    fixed_step_budget: int = 0
    joules: Optional[float] = None
    error: Optional[str] = None


@dataclass
class LoadReport:
    base_url: str
    model: str
    num_requests: int
    concurrency: Optional[int]
    request_rate: Optional[float]
    duration_s: float
    completed: int
    errors_by_status: dict[str, int]
    request_throughput: float
    output_token_throughput: float
    ttft_s: dict[str, float]
    e2e_latency_s: dict[str, float]
    nfe_per_token: Optional[float]
    tokens_per_forward: Optional[float]
    tokens_per_step: Optional[float]
    steps_per_block: Optional[float]
    aup: Optional[float]
    aup_baseline: Optional[dict[str, float]]  # the baseline run's tokens_per_forward and accuracy, when given
    steps_saved_share: Optional[float]
    joules_per_token: Optional[float]
    accuracy: Optional[float]
    answered: int
    outcomes: list[dict[str, Any]] = field(default_factory=list)


def builtin_workload(n: int, seed: int) -> list[LoadRequest]:
    """Held-out problems of the built-in task family, as chat requests with their answers."""
    from tinymodels.tasks import sample

    return [LoadRequest(messages=[{"role": "user", "content": p.prompt}], answer=p.answer, kind=p.kind)
            for p in sample(n, seed)]


def file_workload(path: Path) -> list[LoadRequest]:
    """JSON lines, each {"messages": [...]} or {"prompt": "..."}, optionally "max_tokens" and "answer"."""
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or ("messages" in row) == ("prompt" in row):
            raise ValueError(f"{path}:{number}: each line needs exactly one of 'messages' or 'prompt'")
        requests.append(LoadRequest(messages=row.get("messages"), prompt=row.get("prompt"),
                                    max_tokens=row.get("max_tokens"), answer=row.get("answer"), kind=row.get("kind")))
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests


def percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:  # linear interpolation between closest ranks
        pos = q * (len(ordered) - 1)
        low = int(pos)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)

    return {"mean": sum(ordered) / len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def is_correct(request: LoadRequest, text: str) -> Optional[bool]:
    if request.answer is None:
        return None
    if request.kind is not None:
        from tinymodels.tasks import answer_of

        return answer_of(request.kind, text) == request.answer
    return text.strip() == request.answer.strip()


async def send(session: aiohttp.ClientSession, base_url: str, model: str, request: LoadRequest,
               decoding: Optional[dict[str, Any]], max_tokens: Optional[int]) -> RequestOutcome:
    chat = request.messages is not None
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    body.update({"messages": request.messages} if chat else {"prompt": request.prompt})
    tokens = request.max_tokens or max_tokens
    if tokens is not None:
        body["max_tokens"] = tokens
    if decoding:
        body["decoding"] = decoding
    start = time.perf_counter()
    outcome = RequestOutcome(ok=False, status=0)
    pieces: list[str] = []
    try:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        async with session.post(base_url + path, json=body) as reply:
            outcome.status = reply.status
            if reply.status != 200:
                outcome.error = (await reply.text())[:300]
                outcome.latency = time.perf_counter() - start
                return outcome
            async for raw in reply.content:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:  # an error after the stream started: the status was already 200
                    outcome.error = event["error"].get("message") or "error event"
                    continue
                if event.get("usage"):
                    outcome.completion_tokens = event["usage"]["completion_tokens"]
                    outcome.prompt_tokens = event["usage"]["prompt_tokens"]
                for choice in event.get("choices", []):
                    text = choice.get("delta", {}).get("content") if chat else choice.get("text")
                    if text:
                        if outcome.ttft is None:
                            outcome.ttft = time.perf_counter() - start
                        pieces.append(text)
                    summary = choice.get("decoding")
                    if summary:
                        outcome.nfe += summary["nfe"]
                        outcome.steps += summary["steps"]
                        outcome.blocks += summary["blocks"]
                        outcome.steps_saved += summary["steps_saved"]
                        outcome.fixed_step_budget += summary["fixed_step_budget"]
                        if summary.get("energy_joules") is not None:
                            outcome.joules = (outcome.joules or 0.0) + summary["energy_joules"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        outcome.error = f"{type(err).__name__}: {err}"
    outcome.latency = time.perf_counter() - start
    outcome.text = "".join(pieces)
    outcome.ok = outcome.status == 200 and outcome.error is None
    return outcome


async def discover_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(base_url + "/v1/models") as reply:
        reply.raise_for_status()
        return (await reply.json())["data"][0]["id"]


async def run_load(base_url: str, workload: list[LoadRequest], num_requests: int, *,
                   concurrency: Optional[int] = None, request_rate: Optional[float] = None,
                   decoding: Optional[dict[str, Any]] = None, model: Optional[str] = None,
                   max_tokens: Optional[int] = None, api_key: Optional[str] = None, seed: int = 0,
                   timeout: float = 600.0, progress: bool = True,
                   aup_baseline: Optional[dict[str, float]] = None) -> LoadReport:
    if (concurrency is None) == (request_rate is None):
        raise ValueError("give exactly one of concurrency or request_rate")
    if (concurrency is not None and concurrency < 1) or (request_rate is not None and request_rate <= 0):
        raise ValueError("concurrency must be >= 1 and request_rate > 0")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = base_url.rstrip("/")
    chosen = [workload[i % len(workload)] for i in range(num_requests)]
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        model = model or await discover_model(session, base)
        with tqdm(total=num_requests, disable=not progress, desc="bench serve", dynamic_ncols=True) as bar:

            async def one(request: LoadRequest) -> RequestOutcome:
                outcome = await send(session, base, model, request, decoding, max_tokens)
                bar.update(1)
                return outcome

            started = time.perf_counter()
            if concurrency is not None:
                gate = asyncio.Semaphore(concurrency)

                async def gated(request: LoadRequest) -> RequestOutcome:
                    async with gate:
                        return await one(request)

                outcomes = await asyncio.gather(*(gated(r) for r in chosen))
            else:
                rng = random.Random(seed)
                tasks = []
                for request in chosen:  # Poisson arrivals: exponential gaps between sends
                    tasks.append(asyncio.create_task(one(request)))
                    await asyncio.sleep(rng.expovariate(request_rate))
                outcomes = await asyncio.gather(*tasks)
            duration = time.perf_counter() - started
    return summarise(base_url, model, chosen, list(outcomes), duration, concurrency, request_rate, aup_baseline)


def summarise(base_url: str, model: str, requests: list[LoadRequest], outcomes: list[RequestOutcome],
              duration: float, concurrency: Optional[int], request_rate: Optional[float],
              aup_baseline: Optional[dict[str, float]] = None) -> LoadReport:
    """The report; `aup_baseline` ({"tokens_per_forward", "accuracy"} of an earlier report, e.g. the
    one-token-per-step decoder's) is the first point of AUP's curve, this run the second."""
    done = [o for o in outcomes if o.ok]
    tokens = sum(o.completion_tokens for o in done)
    nfe = sum(o.nfe for o in done)
    steps = sum(o.steps for o in done)
    blocks = sum(o.blocks for o in done)
    budget = sum(o.fixed_step_budget for o in done)
    metered = [o for o in done if o.joules is not None]
    metered_tokens = sum(o.completion_tokens for o in metered)
    graded = [is_correct(r, o.text) for r, o in zip(requests, outcomes, strict=True) if o.ok]
    graded = [g for g in graded if g is not None]
    errors = Counter(_error_label(o) for o in outcomes if not o.ok)
    accuracy = sum(graded) / len(graded) if graded else None
    tpf = tokens_per_forward(tokens, nfe)
    return LoadReport(
        base_url=base_url, model=model, num_requests=len(outcomes), concurrency=concurrency,
        request_rate=request_rate, duration_s=duration, completed=len(done), errors_by_status=dict(errors),
        request_throughput=len(done) / duration if duration else 0.0,
        output_token_throughput=tokens / duration if duration else 0.0,
        ttft_s=percentiles([o.ttft for o in done if o.ttft is not None]),
        e2e_latency_s=percentiles([o.latency for o in done]),
        nfe_per_token=nfe / tokens if tokens else None,
        tokens_per_forward=tpf, tokens_per_step=tokens / steps if steps else None,
        steps_per_block=steps / blocks if blocks else None,
        aup=run_aup(tpf, accuracy, aup_baseline), aup_baseline=aup_baseline,
        steps_saved_share=sum(o.steps_saved for o in done) / budget if budget else None,
        joules_per_token=sum(o.joules or 0.0 for o in metered) / metered_tokens if metered_tokens else None,
        accuracy=accuracy, answered=len(graded),
        outcomes=[asdict(o) for o in outcomes])


def run_aup(tpf: Optional[float], accuracy: Optional[float],
            baseline: Optional[dict[str, float]]) -> Optional[float]:
    """AUP over the baseline's point (when given) and this run's, accuracies as fractions; y_max the
    better of the two. None without graded answers or forwards."""
    if tpf is None or accuracy is None:
        return None
    points = [(tpf, 100 * accuracy)]
    if baseline is not None:
        points.insert(0, (baseline["tokens_per_forward"], 100 * baseline["accuracy"]))
    return accuracy_under_parallelism(points, max(y for _, y in points))


def _error_label(outcome: RequestOutcome) -> str:
    if outcome.status == 0:
        return "connection"
    return "stream error" if outcome.status == 200 else str(outcome.status)


def format_report(report: LoadReport) -> str:
    def fmt(value: Optional[float], spec: str = ".3f", scale: float = 1.0) -> str:
        return "n/a" if value is None else format(value * scale, spec)

    mode = f"concurrency {report.concurrency}" if report.concurrency else f"request rate {report.request_rate}/s"
    lines = [
        f"model {report.model} at {report.base_url}; {report.num_requests} requests, {mode}",
        f"duration                 {report.duration_s:.2f} s",
        f"completed / errors       {report.completed} / {sum(report.errors_by_status.values())}"
        + (f"  {report.errors_by_status}" if report.errors_by_status else ""),
        f"request throughput       {report.request_throughput:.3f} req/s",
        f"output token throughput  {report.output_token_throughput:.1f} tok/s (generated tokens only)",
    ]
    for name, stats in (("TTFT", report.ttft_s), ("end-to-end latency", report.e2e_latency_s)):
        if stats:
            lines.append(f"{name:<24} mean {stats['mean']:.3f}  p50 {stats['p50']:.3f}  p90 {stats['p90']:.3f}"
                         f"  p99 {stats['p99']:.3f} s")
    base = report.aup_baseline
    curve = "over this run alone: TPF x accuracy"
    if base is not None:
        curve = (f"from the baseline (TPF {base['tokens_per_forward']:.2f}, {100 * base['accuracy']:.1f} %) "
                 "to this run")
        if report.aup is not None and report.accuracy is not None and report.tokens_per_forward is not None:
            this = (report.tokens_per_forward, 100 * report.accuracy)
            if this not in counted_points([(base["tokens_per_forward"], 100 * base["accuracy"]), this]):
                curve += ", which is more than 5 points below it: only the baseline's point counts"
    lines += [
        f"steps saved              {fmt(report.steps_saved_share, '.1f', 100)} %",
        f"joules per token         {fmt(report.joules_per_token, '.4f')}",
        f"exact match              {fmt(report.accuracy, '.1f', 100)} %"
        f" of {report.answered}",
        "-- diffusion decoding (from each response's decoding summary and usage) --",
        f"tokens per forward (TPF) {fmt(report.tokens_per_forward, '.2f')}  (generated tokens / forward passes)",
        f"NFE per generated token  {fmt(report.nfe_per_token)}",
        f"tokens per step          {fmt(report.tokens_per_step, '.2f')}",
        f"steps per block/canvas   {fmt(report.steps_per_block, '.2f')}",
        f"AUP                      {fmt(report.aup, '.1f')}  (d3LLM, arXiv:2601.07568; {curve})",
    ]
    return "\n".join(lines)
