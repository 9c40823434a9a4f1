"""A real Prometheus for the operations tests: started on a config, queried through its HTTP API."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from ops_tools import require_tool
from serverproc import free_port


@contextmanager
def running_prometheus(config: str, workdir: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """Yields (API base url, process) for a Prometheus on `config` (YAML text)."""
    prometheus = require_tool("prometheus")
    (workdir / "prometheus.yml").write_text(config)
    port = free_port()
    proc = subprocess.Popen([prometheus, f"--config.file={workdir / 'prometheus.yml'}",
                             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield f"http://127.0.0.1:{port}/api/v1", proc
    finally:
        proc.terminate()
        proc.wait(20)


def wait_for_targets_up(api: str, proc: subprocess.Popen, count: int, timeout_s: float = 90) -> list[dict]:
    """Bounded polling until `count` targets are scraped healthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            targets = httpx.get(f"{api}/targets", timeout=2).json()["data"]["activeTargets"]
            if len(targets) == count and all(t["health"] == "up" for t in targets):
                return targets
        except (httpx.HTTPError, ValueError, KeyError):  # not listening yet, or "Service Unavailable"
            pass
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline, f"prometheus never scraped {count} healthy target(s)"
        time.sleep(0.5)


def instant(api: str, query: str) -> list[dict]:
    reply = httpx.get(f"{api}/query", params={"query": query}, timeout=10).json()
    assert reply["status"] == "success", (query, reply)
    return reply["data"]["result"]


def as_instant(query: str) -> str:
    """Grafana's variables, resolved the way Grafana would for a short test."""
    return query.replace('model_name=~"$model"', 'model_name=~".*"').replace("$__rate_interval", "30s")


def queries_without_data(api: str, queries: list[str]) -> list[str]:
    empty = []
    for query in queries:
        if query.startswith("label_values("):  # a Grafana template function: ask for the series
            query = query.removeprefix("label_values(").split(",")[0]
        if not instant(api, as_instant(query)):
            empty.append(query)
    return empty


def wait_until_every_query_has_data(api: str, queries: list[str], scrape_s: float, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s  # bounded polling: until the scrapes have carried every series
    while empty := queries_without_data(api, queries):
        assert time.monotonic() < deadline, f"queries with no data: {empty}"
        time.sleep(scrape_s)
