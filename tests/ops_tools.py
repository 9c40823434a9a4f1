"""External programs the operations tests drive (prometheus, docker-compose, hadolint).

On a developer's machine a missing program skips its test; CI installs them all and sets
CAI_DLLM_REQUIRE_TOOLS=1, which turns a missing program into a failure instead."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest


def require_tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found:
        return found
    if os.environ.get("CAI_DLLM_REQUIRE_TOOLS") == "1":
        pytest.fail(f"{name} is required (CAI_DLLM_REQUIRE_TOOLS=1) but not on PATH")
    pytest.skip(f"{name} not installed")


def require_module(name: str) -> ModuleType:
    if importlib.util.find_spec(name) is not None:
        return importlib.import_module(name)
    if os.environ.get("CAI_DLLM_REQUIRE_TOOLS") == "1":
        pytest.fail(f"python package {name} is required (CAI_DLLM_REQUIRE_TOOLS=1) but not installed")
    pytest.skip(f"python package {name} not installed")
