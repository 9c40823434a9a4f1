"""Dockerfile, compose file, Prometheus config and Grafana dashboard: valid, consistent with the
metrics the server exports, and the image's exact command works."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from ops_tools import require_tool
from serverproc import MODEL, REPO, free_port, wait_ready

COMPOSE = REPO / "deploy" / "compose"
DASHBOARD = COMPOSE / "grafana" / "dashboards" / "cai-dllm.json"
METRIC_NAME = re.compile(r"\bcaidllm:[a-z0-9_:]+")


def exported_sample_names() -> set[str]:
    """Every sample name /metrics can carry: counters end in _total, histograms in _bucket/_sum/_count."""
    from server.metrics import Metrics

    names = set()
    for family in Metrics("m").registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in board["panels"] for t in p["targets"]]
    queries += [v["query"]["query"] for v in board["templating"]["list"]]
    return queries


def test_dashboard_is_the_generators_output():
    sys.path.insert(0, str(COMPOSE / "grafana"))
    try:
        import make_dashboard
    finally:
        sys.path.pop(0)
    assert DASHBOARD.read_text() == make_dashboard.render(), "run deploy/compose/grafana/make_dashboard.py"


def test_every_panel_names_only_exported_metrics():
    exported = exported_sample_names()
    board = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in board["panels"]}
    assert len(board["panels"]) >= 12 and len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for query in dashboard_queries():
        names = METRIC_NAME.findall(query)
        assert names, query
        assert set(names) <= exported, f"{query}: {set(names) - exported} not exported"
    for wanted in ("Generation tokens/s", "Requests running / waiting", "Time to first token", "End-to-end latency",
                   "Batch size", "NFE per generated token", "Steps saved /s", "Steps saved per request",
                   "Forced commits and grinding exits /s", "Energy per request", "Energy per generated token",
                   "Errors by status /s"):
        assert wanted in titles


def test_live_metrics_page_carries_every_dashboard_metric():
    """From the running server (no traffic yet): each series a panel reads exists from start-up."""
    from fastapi.testclient import TestClient

    from engine import EngineConfig
    from server.app import create_app
    from server.settings import ServerSettings

    app = create_app(ServerSettings(engine=EngineConfig(model=str(MODEL))))
    with TestClient(app) as client:
        page = client.get("/metrics").text
    present = {line.split("{")[0].split(" ")[0] for line in page.splitlines() if line and not line.startswith("#")}
    needed = {n for q in dashboard_queries() for n in METRIC_NAME.findall(q)}
    if app.state.cai.meter.name == "none":  # no meter on this host: no energy series, by design
        needed = {n for n in needed if "energy" not in n}
        assert not {n for n in present if "energy" in n}
    with_extra_labels = {"caidllm:request_errors_total", "caidllm:request_success_total"}  # appear with traffic
    assert needed - with_extra_labels <= present


def test_provisioning_files_point_at_each_other():
    datasource = yaml.safe_load((COMPOSE / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    board = json.loads(DASHBOARD.read_text())
    assert all(p["datasource"]["uid"] == uid for p in board["panels"])
    provider = yaml.safe_load((COMPOSE / "grafana" / "provisioning" / "dashboards" / "cai-dllm.yml").read_text())
    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(m.endswith(":" + provider["providers"][0]["options"]["path"] + ":ro") for m in mounts)
    scrape = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == ["server:8000"]


def test_compose_files_validate():
    """The CPU stack runs as it is (the bundled model, no variable to set); the GPU override adds the
    GPU, the checkpoint at MODEL_DIR and refuses to start without it."""
    compose = require_tool("docker-compose")
    env = {k: v for k, v in os.environ.items() if k != "MODEL_DIR"}

    def config(*files: str, **extra: str) -> subprocess.CompletedProcess:
        args = [a for f in files for a in ("-f", str(COMPOSE / f))]
        return subprocess.run([compose, *args, "config"], capture_output=True, text=True, env={**env, **extra},
                              timeout=60)

    cpu = config("docker-compose.yml")
    assert cpu.returncode == 0, cpu.stderr
    server = yaml.safe_load(cpu.stdout)["services"]["server"]
    assert set(yaml.safe_load(cpu.stdout)["services"]) == {"server", "prometheus", "grafana"}
    assert server["build"]["args"]["DEVICE"] == "cpu" and "deploy" not in server and "command" not in server
    gpu = config("docker-compose.yml", "docker-compose.gpu.yml", MODEL_DIR=str(MODEL))
    assert gpu.returncode == 0, gpu.stderr
    server = yaml.safe_load(gpu.stdout)["services"]["server"]
    assert server["build"]["args"]["DEVICE"] == "cuda" and "cuda" in server["command"]
    assert server["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert any(str(MODEL) in str(volume) for volume in server["volumes"])
    unset = config("docker-compose.yml", "docker-compose.gpu.yml")
    assert unset.returncode != 0 and "MODEL_DIR" in unset.stderr


def test_dockerfile_lints_clean():
    hadolint = require_tool("hadolint")
    run = subprocess.run([hadolint, "--failure-threshold", "warning", str(REPO / "Dockerfile")], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def _dockerfile() -> tuple[dict[str, str], list[str], list[str]]:
    """The final stage's ENV, ENTRYPOINT and HEALTHCHECK command of the Dockerfile."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    final = text.split("\nFROM runtime-${DEVICE}")[1]
    env: dict[str, str] = {}
    for line in final.splitlines():
        if line.startswith("ENV "):
            for item in shlex.split(line[4:]):
                key, _, value = item.partition("=")
                env[key] = value
        if line.startswith("ENTRYPOINT "):
            entrypoint = json.loads(line[len("ENTRYPOINT "):])
        if line.startswith("HEALTHCHECK "):
            healthcheck = json.loads(line.split(" CMD ", 1)[1])
    return env, entrypoint, healthcheck


@pytest.mark.slow
def test_the_images_command_serves_and_passes_its_healthcheck():
    """The image's ENTRYPOINT with the image's environment (model path and device mapped to this checkout)."""
    env, entrypoint, healthcheck = _dockerfile()
    assert entrypoint == ["cai-dllm", "serve"]
    assert env["CAI_DLLM_HOST"] == "0.0.0.0" and env["CAI_DLLM_MODEL"].endswith("/llada-tiny")
    port = free_port()
    image_env = {k: v for k, v in env.items() if k.startswith("CAI_DLLM_") or k in ("HF_HUB_OFFLINE",)}
    image_env.update(CAI_DLLM_MODEL=str(MODEL), CAI_DLLM_DEVICE="cpu", CAI_DLLM_PORT=str(port))
    cli = Path(sys.executable).parent / entrypoint[0]
    proc = subprocess.Popen([str(cli), *entrypoint[1:]], cwd="/", env={**os.environ, **image_env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        check = subprocess.run([sys.executable if healthcheck[0] == "python3" else healthcheck[0], *healthcheck[1:]],
                               env={**os.environ, **image_env}, capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stderr
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["id"] == "llada-tiny"
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("config", [COMPOSE / "prometheus.yml", REPO / "deploy" / "ray" / "prometheus.yml"])
def test_prometheus_configs_pass_promtool(config):
    promtool = require_tool("promtool")
    run = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
