"""The installed package's version (`cai-dllm --version`, `/version`, the OpenAPI document)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("cai-dllm")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"
