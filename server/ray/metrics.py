"""Metrics from every Ray Serve replica: each serves its own registry on its own port and registers
the address in one named actor; Prometheus discovers them through `GET /metrics/targets` (HTTP
service discovery, answered by whichever replica the proxy picks) and the dashboard sums them.

    scrape_configs:
      - job_name: cai-dllm
        http_sd_configs: [{url: "http://RAY_HEAD:8000/metrics/targets", refresh_interval: 10s}]

Ray is an optional dependency: only `server/ray/serve.py` imports this module."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import ray

from server.ray.targets import REFRESH_S, ScrapeTarget, TargetBook

log = logging.getLogger("cai_dllm.ray")

REGISTRY_ACTOR = "cai-dllm-metrics-targets"
REGISTRY_NAMESPACE = "cai-dllm"
# Where a replica's metrics server listens: the node's address (what Prometheus must reach) and a
# port the OS picks unless one is given (several replicas share a node).
HOST_ENV = "CAI_DLLM_REPLICA_METRICS_HOST"
PORT_ENV = "CAI_DLLM_REPLICA_METRICS_PORT"
CALL_TIMEOUT_S = 30.0


@ray.remote(num_cpus=0)
class TargetRegistry:
    """One per cluster (named, detached): outlives any replica, so a replacement finds it."""

    def __init__(self) -> None:
        self._book = TargetBook()

    def register(self, replica: str, address: str, labels: dict[str, str]) -> None:
        self._book.register(replica, ScrapeTarget(address, labels))

    def remove(self, replica: str) -> None:
        self._book.remove(replica)

    def http_sd(self) -> list[dict[str, object]]:
        return self._book.http_sd()


def target_registry() -> ray.actor.ActorHandle:
    return TargetRegistry.options(name=REGISTRY_ACTOR, namespace=REGISTRY_NAMESPACE, lifetime="detached",
                                  get_if_exists=True).remote()


def _metrics_handler(render: Callable[[], bytes]) -> type[BaseHTTPRequestHandler]:
    """The replica's exposition exactly as the server's own `/metrics` writes it. (prometheus_client's
    server would answer Prometheus's OpenMetrics request with `caidllm_` names, so the dashboard's
    `caidllm:` queries would find nothing.)"""

    class MetricsHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = render()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # one line per scrape would drown the replica's log
            pass

    return MetricsHandler


class ReplicaMetricsExporter:
    """Serves the replica's metrics on its own port and keeps its scrape target registered."""

    def __init__(self, render: Callable[[], bytes], replica: str, labels: dict[str, str]) -> None:
        host = os.environ.get(HOST_ENV) or ray.util.get_node_ip_address()
        port = int(os.environ.get(PORT_ENV) or 0)
        if not 0 <= port <= 65535:
            raise ValueError(f"{PORT_ENV} must be a port number (0-65535), got {port}")
        self._server = ThreadingHTTPServer((host, port), _metrics_handler(render))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="replica-metrics", daemon=True).start()
        bound = self._server.server_address[1]
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        self._replica, self._labels = replica, labels
        self._registry = target_registry()
        ray.get(self._registry.register.remote(replica, self.address, labels), timeout=CALL_TIMEOUT_S)
        log.info("replica %s: metrics on http://%s/metrics", replica, self.address)
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_until_stopped, name="metrics-target", daemon=True)
        self._refresher.start()

    def _refresh_until_stopped(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                ray.get(self._registry.register.remote(self._replica, self.address, self._labels),
                        timeout=CALL_TIMEOUT_S)
            except Exception as error:  # the registry's node went away: find (or recreate) it next time
                log.warning("replica %s: could not refresh its metrics target (%s)", self._replica, error)
                try:
                    self._registry = target_registry()
                except Exception:  # Ray itself is going away; the next round tries again
                    pass

    async def discovered(self) -> list[dict[str, object]]:
        """Every live replica's target (this one's and the others'), for Prometheus's discovery."""
        return await self._registry.http_sd.remote()

    def close(self) -> None:
        self._stop.set()
        try:
            ray.get(self._registry.remove.remote(self._replica), timeout=CALL_TIMEOUT_S)
        except Exception:  # best effort: the entry expires by itself
            pass
        self._server.shutdown()
        self._server.server_close()
