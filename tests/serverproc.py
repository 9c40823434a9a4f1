"""Starting the real server (`cai-dllm serve`) in a subprocess on a free port, for end-to-end tests."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import httpx

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "llada-tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("server did not become ready")
        time.sleep(0.2)


@contextmanager
def running_server(*flags: str, env: Optional[dict[str, str]] = None,
                   command: Optional[Sequence[str]] = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`command` replaces `python -m server.cli serve` (the port flag is still appended)."""
    port = free_port()
    base_cmd = list(command) if command else [sys.executable, "-m", "server.cli", "serve"]
    cmd = [*base_cmd, "--port", str(port), "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def metric(text: str, name: str) -> float:
    """Sum of every sample of `name` (all label sets) on a /metrics page."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#") and line[len(name)] in " {":
            total += float(line.split()[-1])
    return total


def readme_curls() -> list[tuple[str, dict]]:
    """(path, JSON body) of each curl of the README's first block that talks to the bundled model."""
    block = next(b for b in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
                 if "curl -s http://127.0.0.1:8000" in b)
    return [(path, json.loads(body)) for path, body in
            re.findall(r"curl -s http://127\.0\.0\.1:8000(\S+) .*?-d '(.*?)'", block, re.S)]
