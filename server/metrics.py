"""Prometheus metrics, prefix `caidllm:`, label `model_name`: one registry per app, with the standard
`process_*` and `python_*` collectors. Energy series exist only where an energy meter is read: with
none, a dashboard shows "no data", never an invented 0 J."""

from __future__ import annotations

from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_CHUNK_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_JOULES = (0.01, 0.1, 0.5, 1, 5, 10, 50, 100, 500, 1000, 5000)


class Metrics:
    def __init__(self, model_name: str, energy: bool = True, engine_info: Optional[dict[str, str]] = None) -> None:
        """`engine_info`: the engine-wide settings the info series carries as labels (dtype, device,
        quantization, ...), vLLM's `*_config_info` convention: a gauge at 1."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        # the defaults register with prometheus_client's global registry; these are this app's own
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

        def make(kind: Any, name: str, doc: str, *labels: str, **options: Any) -> Any:
            metric = kind(f"caidllm:{name}", doc, ["model_name", *labels], registry=self.registry, **options)
            if not labels:  # the series exists from start-up (at 0): dashboards show 0 rather than "no data"
                self.labels(metric)
            return metric

        self.running = make(Gauge, "num_requests_running", "Requests decoding in the batch")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests waiting for a row")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = make(Counter, "generation_tokens", "Generated tokens (responses)")
        self.request_success = make(Counter, "request_success", "Finished requests by finish reason",
                                    "finished_reason")
        self.request_errors = make(Counter, "request_errors", "Requests answered with an error, by status", "status")
        self.ttft = make(Histogram, "time_to_first_token_seconds", "Time to the first final token", buckets=_LATENCY)
        self.e2e = make(Histogram, "e2e_request_latency_seconds", "End-to-end request latency", buckets=_LATENCY)
        self.queue_time = make(Histogram, "request_queue_time_seconds", "Time waiting for a row", buckets=_LATENCY)
        self.batch_size = make(Histogram, "batch_size", "Rows per engine step",
                               buckets=(1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32))
        self.nfe = make(Histogram, "request_nfe", "Forward passes per request", buckets=_COUNTS)
        self.tokens_per_step = make(Histogram, "tokens_committed_per_step", "Tokens committed per row and step",
                                    buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128))
        self.steps_saved_request = make(Histogram, "request_steps_saved", "Steps saved per request against the "
                                        "fixed budget", buckets=(0, *_COUNTS))
        self.steps_saved = make(Counter, "steps_saved", "Steps saved against the fixed budget")
        self.steps = make(Counter, "decode_steps", "Denoising steps taken (row-steps)")
        self.forced = make(Counter, "forced_commits", "Tokens committed below their threshold")
        self.grinding = make(Counter, "grinding_exits", "Grinding-phase detector firings")
        self.client_disconnects = make(Counter, "client_disconnects", "Requests whose client went away before the "
                                       "answer (the row freed)")
        # vLLM's prefix-cache counters, in prompt tokens: looked up, and of them served from the cache
        self.prefix_cache_queries = make(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                         "cache")
        self.prefix_cache_hits = make(Counter, "prefix_cache_hits", "Prompt tokens served from the prefix cache")
        self.prefix_cache_bytes = make(Gauge, "prefix_cache_bytes", "Device memory the prefix cache's blocks hold")
        self.scoring_requests = make(Gauge, "num_scoring_requests", "Likelihood-scoring requests (echo + logprobs) "
                                     "running or waiting on the engine thread")
        self.scoring_tokens = make(Counter, "scoring_tokens", "Tokens fed to the model by likelihood scoring")
        self.scoring_chunk_seconds = make(Histogram, "scoring_chunk_seconds", "Engine-thread time of one scoring "
                                          "chunk (the most a decode step waits on scoring)", buckets=_CHUNK_SECONDS)
        info = dict(engine_info or {})
        self.engine_info = make(Gauge, "engine_config_info", "Engine settings fixed at start-up (labels); always 1",
                                *info)
        self.engine_info.labels(model_name=model_name, **info).set(1)
        self.request_joules: Optional[Histogram] = None
        self.joules: Optional[Counter] = None
        if energy:
            self.request_joules = make(Histogram, "request_energy_joules", "Energy per request (measured)",
                                       buckets=_JOULES)
            self.joules = make(Counter, "energy_joules", "Energy measured during engine steps")

    def labels(self, metric, **extra):  # type: ignore[no-untyped-def]
        return metric.labels(model_name=self.model_name, **extra)

    def render(self) -> bytes:
        return generate_latest(self.registry)
