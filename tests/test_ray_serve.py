"""Scale-out on Ray Serve with the committed CPU config: two replicas of the tiny model behind one
endpoint answer concurrent requests, no replica takes a request before its model has loaded, and
killing one replica's process loses no request that the client retries."""

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
from serverproc import REPO, free_port

pytestmark = pytest.mark.slow
PROMPT = "<|user|>0012+0034<|assistant|>"


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
        while ready < 10:  # both replicas loaded: several /ready in a row through the proxy
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
        pids = _replica_pids()
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
    finally:
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True,
                       timeout=120)
