"""A real Prometheus scrapes a running server; every query of the Grafana dashboard returns data."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest
from ops_tools import require_tool
from serverproc import free_port, running_server
from test_deploy_files import dashboard_queries

pytestmark = pytest.mark.slow
SCRAPE_SECONDS = 1


def _as_instant(query: str) -> str:
    """Grafana's variables, resolved the way Grafana would for this short test."""
    return query.replace('model_name=~"$model"', 'model_name=~".*"').replace("$__rate_interval", "30s")


def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path):
    prometheus = require_tool("prometheus")
    with running_server("--max-batch", "4") as (base, _):
        target = base.removeprefix("http://")
        (tmp_path / "prometheus.yml").write_text(
            f"global:\n  scrape_interval: {SCRAPE_SECONDS}s\nscrape_configs:\n  - job_name: cai-dllm\n"
            f"    static_configs:\n      - targets: ['{target}']\n")
        port = free_port()
        proc = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        api = f"http://127.0.0.1:{port}/api/v1"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    targets = httpx.get(f"{api}/targets", timeout=2).json()["data"]["activeTargets"]
                    if targets and targets[0]["health"] == "up":
                        break
                except (httpx.HTTPError, ValueError, KeyError):  # not listening yet, or "Service Unavailable"
                    pass
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, "prometheus never scraped the server"
                time.sleep(0.5)
            with httpx.Client(base_url=base, timeout=60) as client:
                for i in range(12):  # traffic for several scrapes: successes, streams and errors
                    client.post("/v1/completions", json={"prompt": f"<|user|>00{i:02d}+0001<|assistant|>",
                                                         "max_tokens": 64, "decoding": {"policy": "cai"}})
                    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1})  # a 400
                    time.sleep(0.3)
            # without an energy meter the energy series do not exist (no invented 0 J): those panels
            # are empty by design
            meter = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["energy_meter"]
            queries = [q for q in dashboard_queries() if meter != "none" or "energy" not in q]
            deadline = time.monotonic() + 60  # bounded polling: until the scrapes have carried every series
            while empty := _queries_without_data(api, queries):
                assert time.monotonic() < deadline, f"queries with no data: {empty}"
                time.sleep(SCRAPE_SECONDS)
        finally:
            proc.terminate()
            proc.wait(20)


def _queries_without_data(api: str, queries: list[str]) -> list[str]:
    empty = []
    for query in queries:
        if query.startswith("label_values("):  # a Grafana template function: ask for the series
            query = query.removeprefix("label_values(").split(",")[0]
        reply = httpx.get(f"{api}/query", params={"query": _as_instant(query)}, timeout=10).json()
        assert reply["status"] == "success", (query, reply)
        if not reply["data"]["result"]:
            empty.append(query)
    return empty
