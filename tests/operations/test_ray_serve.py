"""Scale-out on Ray Serve with the committed CPU config: two replicas of the tiny model behind one
endpoint answer concurrent requests, no replica takes a request before its model has loaded, a real
Prometheus on the committed Ray config scrapes every replica and the dashboard's queries add them up,
and killing one replica's process loses no request that the client retries."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from ops_tools import require_module
from prometheus_proc import instant, running_prometheus, wait_for_targets_up, wait_until_every_query_has_data
from serverproc import REPO, free_port
from test_deploy_files import dashboard_queries

pytestmark = pytest.mark.slow
PROMPT = "<|user|>00012+00034<|assistant|>"
SCRAPE_SECONDS = 1


async def _post_with_retries(client: httpx.AsyncClient, body: dict, attempts: int = 8) -> tuple[httpx.Response, int]:
    retries = 0
    while True:
        try:
            reply = await client.post("/v1/completions", json=body)
            if reply.status_code < 500 or retries + 1 >= attempts:
                return reply, retries
        except httpx.HTTPError:
            if retries + 1 >= attempts:
                raise
        retries += 1
        await asyncio.sleep(0.5 * retries)


def _replica_pids() -> list[int]:
    from ray.util.state import list_actors

    actors = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
    return [a.pid for a in actors if "ServeReplica" in (a.class_name or "")]


def test_two_cpu_replicas_behind_one_endpoint_survive_a_killed_replica(tmp_path):
    ray = require_module("ray")
    config = yaml.safe_load((REPO / "deploy" / "ray" / "serve-cpu.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    serve_cli = Path(sys.executable).parent / "serve"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0",
           "CAI_DLLM_MODEL": str(REPO / "models" / "llada-tiny")}
    dashboard = free_port()  # `serve deploy` talks to the cluster through the dashboard's REST API
    subprocess.run([str(Path(sys.executable).parent / "ray"), "start", "--head", "--num-cpus", "3",
                    "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard), "--disable-usage-stats"],
                   cwd=tmp_path, env=env, check=True, capture_output=True, timeout=180)
    try:
        deploy = subprocess.run([str(serve_cli), "deploy", "--address", f"http://127.0.0.1:{dashboard}",
                                 str(tmp_path / "serve.yaml")], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=180)
        assert deploy.returncode == 0, deploy.stderr
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        ready, loading_answers = 0, []
        while ready < 10:  # the application serves: several /ready in a row through the proxy
            try:
                reply = httpx.get(f"{base}/ready", timeout=5)
                ready = ready + 1 if reply.status_code == 200 else 0
                if reply.status_code == 503 and "not_ready" in reply.text:
                    loading_answers.append(reply.text)  # a replica still loading took the request
            except httpx.HTTPError:
                ready = 0
            assert time.monotonic() < deadline, "the Serve application never became ready"
            time.sleep(0.05)
        # a replica loads in its constructor, so Serve routes nothing to it before it serves
        assert not loading_answers, loading_answers[:3]
        ray.init(address="auto", logging_level="ERROR")
        replicas_before = _check_metrics_of_every_replica(base, tmp_path)
        pids = _replica_pids()  # both constructors done (each registered its target)
        assert len(pids) == 2, pids

        async def scenario() -> list[tuple[httpx.Response, int]]:
            body = {"prompt": PROMPT, "max_tokens": 64, "decoding": {"policy": "fixed", "early_exit": False}}
            async with httpx.AsyncClient(base_url=base, timeout=120) as client:
                tasks = [asyncio.create_task(_post_with_retries(client, body)) for _ in range(16)]
                await asyncio.sleep(1.0)
                os.kill(pids[0], signal.SIGKILL)  # one replica dies with requests on it
                return await asyncio.gather(*tasks)

        results = asyncio.run(scenario())
        assert [r.status_code for r, _ in results] == [200] * 16
        texts = {r.json()["choices"][0]["text"] for r, _ in results}
        assert len(texts) == 1  # the same greedy answer from either replica
        print(f"\n[ops-proof] ray: 16 requests, 2 replicas, one killed; retries used: {sum(n for _, n in results)}")
        deadline = time.monotonic() + 120
        while len(_replica_pids()) < 2:  # Serve replaces the dead replica
            assert time.monotonic() < deadline, "the killed replica was not replaced"
            time.sleep(1)
        # discovery follows: the dead replica's target expires, the replacement's appears
        deadline = time.monotonic() + 120
        while True:
            replicas = _discovered_replicas(base)
            if len(replicas) == 2 and len(replicas & replicas_before) == 1:
                break
            assert time.monotonic() < deadline, (replicas, replicas_before)
            time.sleep(1)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True,
                       timeout=120)


def _discovered_replicas(base: str) -> set[str]:
    groups = httpx.get(f"{base}/metrics/targets", timeout=10).json()
    return {group["labels"]["replica"] for group in groups}


def _check_metrics_of_every_replica(base: str, workdir: Path) -> set[str]:
    """Prometheus on deploy/ray/prometheus.yml finds both replicas through /metrics/targets; after N
    requests the dashboard's sums count N, whichever replica answered each."""
    # /ready through the proxy only reaches replicas whose constructor is done, and a replica's actor is
    # alive while its constructor still loads the model: the second replica registers its target when
    # its constructor ends, so discovery is waited for, not assumed
    deadline = time.monotonic() + 300
    while True:
        groups = httpx.get(f"{base}/metrics/targets", timeout=10).json()
        if len({g["targets"][0] for g in groups}) >= 2:
            break
        assert time.monotonic() < deadline, f"the second replica never registered its metrics target: {groups}"
        time.sleep(1)
    assert len(groups) == 2, groups
    config = yaml.safe_load((REPO / "deploy" / "ray" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = f"{SCRAPE_SECONDS}s"
    discovery = config["scrape_configs"][0]["http_sd_configs"][0]
    discovery["url"] = f"{base}/metrics/targets"
    discovery["refresh_interval"] = "1s"
    workdir = workdir / "prometheus"
    workdir.mkdir()
    with running_prometheus(yaml.safe_dump(config), workdir) as (api, proc):
        wait_for_targets_up(api, proc, 2)
        sent = 12
        with httpx.Client(base_url=base, timeout=120) as client:
            for i in range(sent):
                reply = client.post("/v1/completions", json={"prompt": f"<|user|>00{i:02d}+0001<|assistant|>",
                                                             "max_tokens": 32, "decoding": {"policy": "cai"}})
                assert reply.status_code == 200, reply.text
                bad = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1})  # the errors panel
                assert bad.status_code == 400, bad.text
        total = 'sum(caidllm:request_success_total{model_name=~".*"})'
        per_replica = 'sum by (replica) (caidllm:request_success_total{model_name=~".*"})'
        deadline = time.monotonic() + 60
        while not (result := instant(api, total)) or float(result[0]["value"][1]) < sent:
            assert time.monotonic() < deadline, f"the replicas' counts never added up to {sent}: {result}"
            time.sleep(SCRAPE_SECONDS)
        assert float(result[0]["value"][1]) == sent
        assert len(instant(api, per_replica)) == 2  # both replicas scraped, whoever served the requests
        meter = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["energy_meter"]
        wait_until_every_query_has_data(api, [q for q in dashboard_queries() if meter != "none" or "energy" not in q],
                                        SCRAPE_SECONDS)
    return {group["labels"]["replica"] for group in groups}
