"""Scale-out on Ray Serve: the same FastAPI app, one replica per GPU (or per CPU slot), behind Ray's
HTTP proxy, autoscaled on ongoing requests.

    serve run deploy/ray/serve-cpu.yaml        # one machine, CPU replicas
    serve deploy deploy/ray/serve-gpu.yaml     # a Ray cluster (or KubeRay's RayService)

Each replica builds its app (and loads its model) from `CAI_DLLM_*` variables, set per application
in the Serve config's `runtime_env`; the replica count, `num_gpus` and autoscaling are deployment
options there too, so nothing in this module changes between a laptop and a cluster. Ray is an
optional dependency: only Ray imports this module.
"""

from __future__ import annotations

from fastapi import FastAPI
from ray import serve

from server.app import create_app
from server.settings import load_settings

# Rows decode together inside a replica; Ray should route at most this many requests to one
# replica before it queues them in the proxy or scales out (the replica's own queue bounds the rest).
DEFAULT_MAX_ONGOING = 64


def build_app() -> FastAPI:
    """Runs on each replica: settings from the replica's environment, model loaded in the app's lifespan."""
    return create_app(load_settings({}))


@serve.deployment(
    name="cai-dllm",
    max_ongoing_requests=DEFAULT_MAX_ONGOING,
    autoscaling_config={"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8},
    health_check_period_s=10,
    graceful_shutdown_timeout_s=30,
)
@serve.ingress(build_app)
class CaiDllmReplica:
    """One engine (one model copy, one GPU when `num_gpus: 1`) serving the OpenAI routes."""


app = CaiDllmReplica.bind()
