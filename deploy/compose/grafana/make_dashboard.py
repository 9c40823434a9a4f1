"""Writes dashboards/cai-dllm.json, the provisioned Grafana board: `python make_dashboard.py`.

Every query names only metrics the server exports (tests/operations/test_deploy_files.py checks it against a
live /metrics page, and tests/operations/test_prometheus.py runs each query against a real Prometheus)."""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "cai-dllm.json"
SEL = '{model_name=~"$model"}'
WINDOW = "$__rate_interval"


def rate(metric: str) -> str:
    return f"sum(rate({metric}{SEL}[{WINDOW}]))"


def quantiles(histogram: str) -> list[tuple[str, str]]:
    return [(f"p{int(q * 100)}",
             f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{SEL}[{WINDOW}])))")
            for q in (0.5, 0.9, 0.99)]


def mean(histogram: str) -> str:
    return f"{rate(histogram + '_sum')} / {rate(histogram + '_count')}"


# (title, unit, description, [(legend, PromQL)])
PANELS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    ("Generation tokens/s", "short", "Generated tokens (responses only) per second.",
     [("tokens/s", rate("caidllm:generation_tokens_total"))]),
    ("Requests running / waiting", "short", "Rows in the batch and requests waiting for a row.",
     [("running", f"sum(caidllm:num_requests_running{SEL})"), ("waiting", f"sum(caidllm:num_requests_waiting{SEL})")]),
    ("Time to first token", "s", "Time until the first final token can be streamed.",
     quantiles("caidllm:time_to_first_token_seconds")),
    ("End-to-end latency", "s", "From arrival to the last token.", quantiles("caidllm:e2e_request_latency_seconds")),
    ("Queue time", "s", "Time waiting for a row.", quantiles("caidllm:request_queue_time_seconds")),
    ("Batch size", "short", "Rows per engine step (mean).", [("mean rows", mean("caidllm:batch_size"))]),
    ("NFE per generated token", "short", "Forward passes per generated token: 1 is the one-token-per-step decoder; "
     "lower is faster.",
     [("NFE/token", f"{rate('caidllm:request_nfe_sum')} / {rate('caidllm:generation_tokens_total')}")]),
    ("Steps saved /s", "short", "Denoising steps saved against the fixed budget, per second.",
     [("steps saved/s", rate("caidllm:steps_saved_total")), ("steps taken/s", rate("caidllm:decode_steps_total"))]),
    ("Steps saved per request", "short", "Distribution of steps saved per request.",
     quantiles("caidllm:request_steps_saved")),
    ("Forced commits and grinding exits /s", "short", "Tokens committed below their threshold (budget "
     "exhausted) and grinding-phase exits.",
     [("forced commits/s", rate("caidllm:forced_commits_total")),
      ("grinding exits/s", rate("caidllm:grinding_exits_total"))]),
    ("Energy per request", "J", "Measured joules per finished request (NVML on GPUs, RAPL on CPUs; empty "
     "when the host exposes no meter).", [("J/request", mean("caidllm:request_energy_joules"))]),
    ("Energy per generated token", "J", "Measured joules per generated token.",
     [("J/token", f"{rate('caidllm:energy_joules_total')} / {rate('caidllm:generation_tokens_total')}")]),
    ("Errors by status /s", "reqps", "Requests answered with an error, by HTTP status.",
     [("{{status}}", f"sum by (status) (rate(caidllm:request_errors_total{SEL}[{WINDOW}]))")]),
    ("Finished requests by reason /s", "reqps", "Successful requests by finish reason.",
     [("{{finished_reason}}", f"sum by (finished_reason) (rate(caidllm:request_success_total{SEL}[{WINDOW}]))")]),
]


def panel(index: int, title: str, unit: str, description: str, targets: list[tuple[str, str]]) -> dict:
    return {
        "id": index + 1, "type": "timeseries", "title": title, "description": description,
        "datasource": {"type": "prometheus", "uid": "prometheus"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "prometheus"}}
                    for i, (legend, expr) in enumerate(targets)],
    }


def dashboard() -> dict:
    return {
        "uid": "cai-dllm", "title": "cai-dllm", "schemaVersion": 39, "version": 1, "editable": True,
        "refresh": "10s", "time": {"from": "now-30m", "to": "now"}, "tags": ["cai-dllm", "diffusion-llm"],
        "templating": {"list": [{
            "name": "model", "label": "model", "type": "query", "includeAll": True, "multi": True,
            "current": {"text": "All", "value": "$__all"}, "allValue": ".*",
            "datasource": {"type": "prometheus", "uid": "prometheus"},
            "query": {"query": "label_values(caidllm:num_requests_running, model_name)", "refId": "model"},
            "definition": "label_values(caidllm:num_requests_running, model_name)", "refresh": 2,
        }]},
        "panels": [panel(i, *spec) for i, spec in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
