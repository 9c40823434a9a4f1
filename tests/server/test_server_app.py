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
        loading = client.get("/health")  # healthy means serving: not while loading
        assert loading.status_code == 503 and loading.json()["error"]["code"] == "not_ready"
        loaded.set()
        deadline = time.monotonic() + 30
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        gate.clear()  # the next forward blocks: work is pending and no step finishes
        worker = threading.Thread(target=lambda: client.post("/v1/completions",
                                                             json={"prompt": [1, 2], "max_tokens": 8}))
        worker.start()
        deadline = time.monotonic() + 30  # bounded polling: the stall is reported once 0.3 s pass with no step
        while (health := client.get("/health")).status_code == 200:
            assert time.monotonic() < deadline, "no stall reported"
            time.sleep(0.05)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_stalled"
        gate.set()
        worker.join(30)
        assert client.get("/health").status_code == 200


def test_load_failure_is_reported(fixtures, tmp_path):
    config = ServerSettings(engine=EngineConfig(model=str(tmp_path / "missing")))
    app = create_app(config, meter=EnergyMeter())
    with TestClient(app) as client:
        deadline = time.monotonic() + 30
        while "load_failed" not in client.get("/health").text:  # ("loading the model" until then)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        health = client.get("/health").json()
        assert health["error"]["code"] == "load_failed" and "does not exist" in health["error"]["message"]
        assert client.get("/ready").status_code == 503
        assert client.post("/v1/completions", json={"prompt": "x"}).json()["error"]["code"] == "not_ready"


def test_bad_values_get_errors_that_name_their_field(fixtures):
    gate, loaded = threading.Event(), threading.Event()
    gate.set()
    loaded.set()
    app = _app(fixtures, gate, loaded)
    with TestClient(app) as client:
        deadline = time.monotonic() + 30
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)

        def error(body: dict) -> dict:
            response = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, **body})
            assert response.status_code == 400, response.text
            return response.json()["error"]

        assert error({"decoding": {"steps": 10 ** 9}})["param"] == "decoding.steps"
        assert error({"decoding": {"gen_length": 64}})["param"] == "decoding.gen_length"
        assert error({"decoding": {"block_length": 10 ** 9}})["param"] == "decoding.block_length"
        # an OpenAI field wins over the decoding object's value, which must still be valid (schemathesis)
        assert error({"logprobs": 1, "decoding": {"logprobs": [{"p": 1}]}})["param"].startswith("decoding")
        assert error({"temperature": 0.5, "decoding": {"temperature": -1}})["param"] == "decoding.temperature"
        assert error({"prompt": [5] * 5000})["param"] == "prompt"  # the prompt alone fills the context
        assert error({"max_tokens": 10 ** 6})["param"] == "max_tokens"
        # block-diffusion knobs on a full-attention model, and a mask that cannot be cached
        assert error({"decoding": {"policy": "block-edit"}})["param"] == "decoding.policy"
        assert error({"decoding": {"eos_early_stop": True}})["param"] == "decoding.eos_early_stop"
        assert error({"decoding": {"block_attention": "additive_01", "cache": "exact"}})["param"] == \
            "decoding.block_attention"
        for raw, words in ((b'{"prompt": [5], "temperature": NaN}', "NaN"),
                           (b'{"prompt": [5], "top_p": Infinity}', "Infinity")):
            response = client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
            assert response.status_code == 400 and words in response.json()["error"]["message"]
        lone = client.post("/v1/completions", content=b'{"prompt": "ab\\ud800c"}',
                           headers={"Content-Type": "application/json"})
        assert lone.status_code == 400 and lone.json()["error"]["code"] == "invalid_unicode"


def test_metrics_carry_process_collectors_and_no_energy_without_a_meter(fixtures):
    gate, loaded = threading.Event(), threading.Event()
    gate.set()
    loaded.set()
    with TestClient(_app(fixtures, gate, loaded)) as client:
        text = client.get("/metrics").text
    assert "process_cpu_seconds_total" in text and "python_gc_objects_collected_total" in text
    assert "energy" not in text  # no meter: no series, rather than an invented 0 J


def test_retry_after_follows_the_queue_and_the_completion_rate():
    from unittest import mock

    from server.engine_loop import RETRY_AFTER_MAX, EngineLoop
    from server.metrics import Metrics

    loop = EngineLoop(mock.MagicMock(num_waiting=9), max_queue=10, metrics=Metrics("m"), meter=EnergyMeter())
    assert loop.retry_after() == 1  # nothing measured yet
    now = time.perf_counter()
    loop._finish_times.extend([now - 10.0 + 0.5 * i for i in range(21)])  # 2 finished a second, lately
    assert loop.retry_after() == 5  # 9 waiting + this one, at 2 a second
    loop._finish_times.clear()
    loop._finish_times.extend([now - 50.0, now - 1.0])  # one finished in 49 s
    assert loop.retry_after() == min(RETRY_AFTER_MAX, 490)
