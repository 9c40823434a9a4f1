"""Prometheus metrics, prefix `caidllm:`, label `model_name`: one registry per app, with the standard
`process_*` and `python_*` collectors. Energy series exist only where an energy meter is read: with
none, a dashboard shows "no data", never an invented 0 J."""

from __future__ import annotations

from typing import Optional

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
        r, label = self.registry, ["model_name"]
        # the defaults register with prometheus_client's global registry; these are this app's own
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.running = Gauge("caidllm:num_requests_running", "Requests decoding in the batch", label, registry=r)
        self.waiting = Gauge("caidllm:num_requests_waiting", "Requests waiting for a row", label, registry=r)
        self.prompt_tokens = Counter("caidllm:prompt_tokens", "Prompt tokens of finished requests", label,
                                     registry=r)
        self.generation_tokens = Counter("caidllm:generation_tokens", "Generated tokens (responses)", label,
                                         registry=r)
        self.request_success = Counter("caidllm:request_success", "Finished requests by finish reason",
                                       [*label, "finished_reason"], registry=r)
        self.request_errors = Counter("caidllm:request_errors", "Requests answered with an error, by status",
                                      [*label, "status"], registry=r)
        self.ttft = Histogram("caidllm:time_to_first_token_seconds", "Time to the first final token", label,
                              buckets=_LATENCY, registry=r)
        self.e2e = Histogram("caidllm:e2e_request_latency_seconds", "End-to-end request latency", label,
                             buckets=_LATENCY, registry=r)
        self.queue_time = Histogram("caidllm:request_queue_time_seconds", "Time waiting for a row", label,
                                    buckets=_LATENCY, registry=r)
        self.batch_size = Histogram("caidllm:batch_size", "Rows per engine step", label,
                                    buckets=(1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32), registry=r)
        self.nfe = Histogram("caidllm:request_nfe", "Forward passes per request", label, buckets=_COUNTS,
                             registry=r)
        self.tokens_per_step = Histogram("caidllm:tokens_committed_per_step", "Tokens committed per row and step",
                                         label, buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.steps_saved_request = Histogram("caidllm:request_steps_saved", "Steps saved per request against the "
                                             "fixed budget", label, buckets=(0, *_COUNTS), registry=r)
        self.steps_saved = Counter("caidllm:steps_saved", "Steps saved against the fixed budget", label, registry=r)
        self.steps = Counter("caidllm:decode_steps", "Denoising steps taken (row-steps)", label, registry=r)
        self.forced = Counter("caidllm:forced_commits", "Tokens committed below their threshold", label, registry=r)
        self.grinding = Counter("caidllm:grinding_exits", "Grinding-phase detector firings", label, registry=r)
        self.client_disconnects = Counter("caidllm:client_disconnects", "Requests whose client went away before "
                                          "the answer (the row freed)", label, registry=r)
        self.scoring_requests = Gauge("caidllm:num_scoring_requests", "Likelihood-scoring requests (echo + "
                                      "logprobs) running or waiting on the engine thread", label, registry=r)
        self.scoring_tokens = Counter("caidllm:scoring_tokens", "Tokens fed to the model by likelihood scoring",
                                      label, registry=r)
        self.scoring_chunk_seconds = Histogram("caidllm:scoring_chunk_seconds", "Engine-thread time of one "
                                               "scoring chunk (the most a decode step waits on scoring)", label,
                                               buckets=_CHUNK_SECONDS, registry=r)
        info = dict(engine_info or {})
        self.engine_info = Gauge("caidllm:engine_config_info", "Engine settings fixed at start-up (labels); always 1",
                                 [*label, *info], registry=r)
        self.engine_info.labels(model_name=model_name, **info).set(1)
        self.request_joules: Optional[Histogram] = None
        self.joules: Optional[Counter] = None
        if energy:
            self.request_joules = Histogram("caidllm:request_energy_joules", "Energy per request (measured)", label,
                                            buckets=_JOULES, registry=r)
            self.joules = Counter("caidllm:energy_joules", "Energy measured during engine steps", label, registry=r)
        # Series exist from start-up (at 0), so rates and dashboards show 0 rather than "no data".
        for metric in (self.running, self.waiting, self.prompt_tokens, self.generation_tokens, self.ttft, self.e2e,
                       self.queue_time, self.batch_size, self.nfe, self.tokens_per_step, self.steps_saved_request,
                       self.steps_saved, self.steps, self.forced, self.grinding, self.client_disconnects,
                       self.scoring_requests, self.scoring_tokens, self.scoring_chunk_seconds,
                       self.request_joules, self.joules):
            if metric is not None:
                self.labels(metric)

    def labels(self, metric, **extra):  # type: ignore[no-untyped-def]
        return metric.labels(model_name=self.model_name, **extra)

    def render(self) -> bytes:
        return generate_latest(self.registry)
