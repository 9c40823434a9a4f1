"""A real Prometheus scrapes a running server; every query of the Grafana dashboard returns data."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_proc import running_prometheus, wait_for_targets_up, wait_until_every_query_has_data
from serverproc import running_server
from test_deploy_files import dashboard_queries

pytestmark = pytest.mark.slow
SCRAPE_SECONDS = 1


def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path):
    with running_server("--max-batch", "4") as (base, _):
        target = base.removeprefix("http://")
        config = (f"global:\n  scrape_interval: {SCRAPE_SECONDS}s\nscrape_configs:\n  - job_name: cai-dllm\n"
                  f"    static_configs:\n      - targets: ['{target}']\n")
        with running_prometheus(config, tmp_path) as (api, proc):
            wait_for_targets_up(api, proc, 1, timeout_s=60)
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
            wait_until_every_query_has_data(api, queries, SCRAPE_SECONDS)
