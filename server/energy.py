"""Energy meters: cumulative joules from hardware counters, or nothing at all.

- `NvmlMeter`: NVIDIA's total-energy counter (millijoules since driver load) of the GPU the model
  runs on, through nvidia-ml-py (the `gpu` extra).
- `RaplMeter`: Intel/AMD RAPL package counters under /sys/class/powercap (microjoules, wrapping at
  `max_energy_range_uj`), where the files are readable.
- no meter: energy metrics are then absent, never invented.
Each meter reads a counter of the whole device or package, so other work on it is included.
The counter source is injectable so the arithmetic is testable without the hardware.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Optional


class EnergyMeter:
    name = "none"

    def read_joules(self) -> Optional[float]:
        """Cumulative joules, or None when no meter is available."""
        return None


class NvmlMeter(EnergyMeter):
    name = "nvml"

    def __init__(self, read_millijoules: Callable[[], int]) -> None:
        self._read = read_millijoules

    @classmethod
    def open(cls, gpu_index: int) -> Optional[NvmlMeter]:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # unsupported GPUs raise here
        except Exception:  # no library, no driver, or a GPU without the counter
            return None
        return cls(lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))

    def read_joules(self) -> Optional[float]:
        return self._read() / 1000.0


class RaplMeter(EnergyMeter):
    name = "rapl"

    def __init__(self, read_counters: Callable[[], list[int]], max_ranges: list[int]) -> None:
        self._read = read_counters
        self._max = max_ranges
        self._last: Optional[list[int]] = None
        self._total_uj = 0

    @classmethod
    def open(cls, root: Path = Path("/sys/class/powercap")) -> Optional[RaplMeter]:
        zones = sorted(p for p in root.glob("intel-rapl:*") if p.name.count(":") == 1)  # packages only
        try:
            ranges = [int((z / "max_energy_range_uj").read_text()) for z in zones]
            files = [z / "energy_uj" for z in zones]
            [int(f.read_text()) for f in files]
        except (OSError, ValueError):
            return None
        if not files:
            return None
        return cls(lambda: [int(f.read_text()) for f in files], ranges)

    def read_joules(self) -> Optional[float]:
        now = self._read()
        if self._last is not None:
            for last, current, top in zip(self._last, now, self._max, strict=True):
                self._total_uj += current - last if current >= last else current + top - last
        self._last = now
        return self._total_uj / 1e6


def open_meter(device: str) -> EnergyMeter:
    """The best meter for the model's device: NVML for CUDA, RAPL for CPU, else none."""
    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else 0
        return NvmlMeter.open(index) or EnergyMeter()
    return RaplMeter.open() or EnergyMeter()


def share_energy(joules: float, work: dict[str, int]) -> dict[str, float]:
    """Split one step's energy among its rows by their share of the work (tokens fed)."""
    total = sum(work.values())
    if total <= 0:
        return {key: 0.0 for key in work}
    return {key: joules * amount / total for key, amount in work.items()}
