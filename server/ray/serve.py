"""Scale-out on Ray Serve: the same FastAPI app, one replica per GPU (or per CPU slot), behind Ray's
HTTP proxy, autoscaled on ongoing requests (`serve run deploy/ray/serve-cpu.yaml`, or `serve deploy
deploy/ray/serve-gpu.yaml` on a cluster). Each replica builds its app from `CAI_DLLM_*` variables set in
the Serve config's `runtime_env`; replicas, `num_gpus` and autoscaling are deployment options there.

A replica loads its model in its constructor, so Serve routes no request to a replica still loading,
and `check_health` reports what `/health` reports. Each replica also serves its own metrics
(`server/ray/metrics.py`), listed at `GET /metrics/targets` for Prometheus's HTTP service discovery.
Ray is an optional dependency: only Ray imports this module.
"""

from __future__ import annotations

from fastapi import FastAPI
from ray import serve

from engine import Engine, start_engine
from server.app import create_app
from server.ray.metrics import ReplicaMetricsExporter
from server.settings import ServerSettings, load_settings

# Rows decode together inside a replica; Ray should route at most this many requests to one
# replica before it queues them in the proxy or scales out (the replica's own queue bounds the rest).
DEFAULT_MAX_ONGOING = 64


@serve.deployment(
    name="cai-dllm",
    max_ongoing_requests=DEFAULT_MAX_ONGOING,
    autoscaling_config={"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8},
    health_check_period_s=10,
    graceful_shutdown_timeout_s=30,
)
@serve.ingress()
class CaiDllmReplica:
    """One engine (one model copy, one GPU when `num_gpus: 1`) serving the OpenAI routes."""

    def __init__(self) -> None:
        settings = load_settings({})
        engine = start_engine(settings.engine)  # here, not in the app's lifespan: Serve waits for it

        def loaded(_: ServerSettings) -> Engine:
            return engine

        self._app = create_app(settings, engine_factory=loaded)  # (Serve owns the name `app`)
        context = serve.get_replica_context()
        self._metrics = ReplicaMetricsExporter(
            self._app.state.cai.metrics.render, context.replica_tag,
            {"app": context.app_name, "deployment": context.deployment})
        exporter = self._metrics

        @self._app.get("/metrics/targets", tags=["metrics"])
        async def metrics_targets() -> list[dict[str, object]]:
            """Every replica's own metrics address, in Prometheus's `http_sd_configs` format."""
            return await exporter.discovered()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app

    def check_health(self) -> None:
        """Serve calls this every `health_check_period_s`; raising marks the replica unhealthy."""
        failure = self._app.state.cai.failure()
        if failure is not None:
            raise RuntimeError(f"{failure[0]}: {failure[1]}")

    def __del__(self) -> None:
        """Serve calls this on a graceful stop: the replica's target leaves discovery at once."""
        metrics = getattr(self, "_metrics", None)
        if metrics is not None:
            metrics.close()


app = CaiDllmReplica.bind()
