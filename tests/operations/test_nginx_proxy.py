"""deploy/nginx/cai-dllm.conf in front of a real server: requests and streams pass through, and a
client that never finishes its headers (slowloris) is cut off, which uvicorn alone never does."""

from __future__ import annotations

import re
import socket
import subprocess
import time

import httpx
import pytest
from ops_tools import require_tool
from serverproc import REPO, free_port, running_server

pytestmark = pytest.mark.slow
HEADER_TIMEOUT = 2  # the example's 10 s, shortened so the test is quick


def _config(tmp_path, upstream_port: int, listen_port: int) -> str:
    text = (REPO / "deploy" / "nginx" / "cai-dllm.conf").read_text()
    text = text.replace("127.0.0.1:8000", f"127.0.0.1:{upstream_port}")
    text = text.replace("listen 8080;", f"listen 127.0.0.1:{listen_port};")
    text = re.sub(r"client_(header|body)_timeout 10s;", rf"client_\1_timeout {HEADER_TIMEOUT}s;", text)
    text = text.replace("/tmp/cai-dllm-nginx", str(tmp_path / "nginx"))
    assert f"client_header_timeout {HEADER_TIMEOUT}s;" in text
    return text


def _slow_client_lasts(host: str, port: int, limit: float) -> float:
    """Seconds until the server closes a connection that sends half a request line and waits."""
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        sock.settimeout(limit)
        started = time.monotonic()
        try:
            while sock.recv(4096):  # nginx answers 408 (or nothing) and closes
                pass
        except TimeoutError:
            pass
        return time.monotonic() - started


def test_nginx_passes_requests_and_streams_and_cuts_slow_clients(tmp_path):
    nginx = require_tool("nginx")
    with running_server() as (base, _):
        port = free_port()
        conf = tmp_path / "nginx.conf"
        conf.write_text(_config(tmp_path, int(base.rsplit(":", 1)[1]), port))
        check = subprocess.run([nginx, "-t", "-c", str(conf), "-p", str(tmp_path)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        proxy = subprocess.Popen([nginx, "-c", str(conf), "-p", str(tmp_path), "-g", "daemon off;"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            front = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(f"{front}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and proxy.poll() is None, "nginx did not come up"
                time.sleep(0.1)
            body = {"prompt": "<|user|>00457+00038<|assistant|>", "max_tokens": 64}
            direct = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
            proxied = httpx.post(f"{front}/v1/completions", json=body, timeout=60).json()
            assert proxied["choices"][0]["text"] == direct["choices"][0]["text"]
            with httpx.stream("POST", f"{front}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and len(events) > 2
            assert _slow_client_lasts("127.0.0.1", port, limit=HEADER_TIMEOUT + 10) < HEADER_TIMEOUT + 5
            # the server alone keeps the same connection open past the proxy's cut
            host, direct_port = base.removeprefix("http://").split(":")
            assert _slow_client_lasts(host, int(direct_port), limit=HEADER_TIMEOUT + 5) >= HEADER_TIMEOUT + 5
        finally:
            proxy.terminate()
            proxy.wait(20)
