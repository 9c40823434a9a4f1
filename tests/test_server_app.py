"""The app in-process (Starlette's TestClient) with an injected engine whose forward can be held,
to check readiness and liveness without timing races against a real subprocess."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

from engine import Engine, EngineConfig
from server.app import create_app
from server.energy import EnergyMeter
from server.settings import ServerSettings


def _app(fixtures, gate: threading.Event, loaded: threading.Event, **settings):
    def factory(_: ServerSettings) -> Engine:
        loaded.wait(30)
        engine = Engine(EngineConfig(model=str(fixtures / "llada_tiny")))
        forward = engine.model.forward

        def held(*args, **kwargs):
            gate.wait(30)
            return forward(*args, **kwargs)

        engine.model.forward = held
        return engine

    config = ServerSettings(engine=EngineConfig(model=str(fixtures / "llada_tiny")), **settings)
    return create_app(config, engine_factory=factory, meter=EnergyMeter())


def test_ready_only_after_loading_and_health_fails_on_a_stall(fixtures):
    gate, loaded = threading.Event(), threading.Event()
    gate.set()
    app = _app(fixtures, gate, loaded, stall_timeout=0.3)
    with TestClient(app) as client:
        assert client.get("/ready").status_code == 503
        assert client.post("/v1/completions", json={"prompt": [1, 2]}).status_code == 503
        assert client.get("/health").status_code == 200  # alive while loading
        loaded.set()
        deadline = time.monotonic() + 30
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        gate.clear()  # the next forward blocks: work is pending and no step finishes
        worker = threading.Thread(target=lambda: client.post("/v1/completions",
                                                             json={"prompt": [1, 2], "max_tokens": 8}))
        worker.start()
        time.sleep(0.8)
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_stalled"
        gate.set()
        worker.join(30)
        assert client.get("/health").status_code == 200


def test_load_failure_is_reported(fixtures, tmp_path):
    config = ServerSettings(engine=EngineConfig(model=str(tmp_path / "missing")))
    app = create_app(config, meter=EnergyMeter())
    with TestClient(app) as client:
        deadline = time.monotonic() + 30
        while "load" not in client.get("/health").text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        health = client.get("/health").json()
        assert health["error"]["code"] == "load_failed" and "does not exist" in health["error"]["message"]
        assert client.get("/ready").status_code == 503
        assert client.post("/v1/completions", json={"prompt": "x"}).json()["error"]["code"] == "not_ready"
