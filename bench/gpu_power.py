"""The GPU's board power, SM clock and clock-limit reasons, sampled through NVML on a
background thread while a benchmark section runs, so a throughput figure says whether the
GPU ran at its power cap (serving fp8 Llama-3-8B on an H200 does: round 15 of
``README.md``, read there with ``nvidia-smi dmon``), and the energy the board drew over the
section (NVML's total-energy counter read at both ends), so a run can be judged in joules
per output token: under the cap, that is what bounds the throughput.

    with PowerSampler(device) as power:
        run_the_section()
    figures["gpu_power"] = power.summary()

Off CUDA, or without NVML (``pynvml``, from the ``nvidia-ml-py`` package), ``summary()`` is
``{"available": False, "reason": ...}`` and nothing is sampled.
"""

from __future__ import annotations

import statistics
import threading
import time

import torch

# nvmlClocksEventReason* bits (the same values under their older "ThrottleReason" names)
REASONS = {"sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20, "hw_thermal": 0x40,
           "hw_power_brake": 0x80}
CAP_SHARE = 0.95  # a sample at or above this share of the enforced limit counts as at the cap


def _spread(values: list[float]) -> dict:
    return {"mean": round(statistics.fmean(values), 1), "p50": statistics.median(values),
            "min": min(values), "max": max(values)}


class PowerSampler:
    """Samples every ``period_s`` between ``__enter__`` and ``__exit__``. The thread waits on
    an event with the period as its timeout, so ``__exit__`` returns within one period."""

    def __init__(self, device: torch.device, period_s: float = 0.2):
        self.period_s = period_s
        self.samples: list[tuple[float, int, int]] = []  # (watts, SM MHz, reason bits)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = self._handle = None
        self.reason = None
        self.limit_w = self.max_clock_mhz = None
        self.energy_mj: list[int] = []  # the counter at __enter__ and __exit__
        self.seconds = 0.0
        if device.type != "cuda":
            self.reason = f"device {device.type}"
            return
        try:
            import pynvml
        except ImportError:
            self.reason = "pynvml (nvidia-ml-py) is not installed"
            return
        try:
            pynvml.nvmlInit()
            self._handle = self._device_handle(pynvml, device)
            self.limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1000.0
            self.max_clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(self._handle,
                                                                  pynvml.NVML_CLOCK_SM)
            self._nvml = pynvml
        except Exception as exc:  # noqa: BLE001 - any NVML failure only disables sampling
            self.reason = f"NVML: {exc!r}"

    @staticmethod
    def _device_handle(nv, device: torch.device):
        """NVML's handle of ``device``: by its PCI address (NVML numbers GPUs without
        ``CUDA_VISIBLE_DEVICES``), else by its index."""
        props = torch.cuda.get_device_properties(device)
        try:
            bus = (f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:"
                   f"{props.pci_device_id:02X}.0")
            return nv.nvmlDeviceGetHandleByPciBusId(bus)
        except Exception:  # noqa: BLE001 - an older torch or NVML: fall back to the index
            return nv.nvmlDeviceGetHandleByIndex(device.index or 0)

    def _reasons(self) -> int:
        nv = self._nvml
        get = (getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
               or nv.nvmlDeviceGetCurrentClocksThrottleReasons)
        return int(get(self._handle))

    def _run(self) -> None:
        nv = self._nvml
        try:
            while not self._stop.wait(self.period_s):
                self.samples.append((nv.nvmlDeviceGetPowerUsage(self._handle) / 1000.0,
                                     nv.nvmlDeviceGetClockInfo(self._handle, nv.NVML_CLOCK_SM),
                                     self._reasons()))
        except Exception as exc:  # noqa: BLE001 - a failed read ends sampling, and says so
            self.reason = f"sampling stopped: {exc!r}"

    def _energy(self) -> None:
        try:
            self.energy_mj.append(int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)))
        except Exception as exc:  # noqa: BLE001 - no counter on this board: no energy figure
            self.reason = f"energy counter: {exc!r}"

    def __enter__(self) -> PowerSampler:
        if self._nvml is not None:
            self._energy()
            self.seconds = -time.perf_counter()
            self._thread = threading.Thread(target=self._run, name="gpu-power", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._nvml is not None:
            self.seconds += time.perf_counter()
            self._energy()
        if self._thread is not None:
            self._thread.join(timeout=10 * self.period_s + 5)

    def summary(self) -> dict:
        if self._nvml is None:
            return {"available": False, "reason": self.reason}
        if not self.samples:
            return {"available": True, "samples": 0, "reason": self.reason}
        limit_w = self.limit_w
        watts = [s[0] for s in self.samples]
        clocks = [s[1] for s in self.samples]
        n = len(self.samples)
        return {
            "available": True, "samples": n, "period_s": self.period_s,
            "power_limit_w": limit_w, "power_w": _spread(watts),
            "at_cap_fraction": round(sum(w >= CAP_SHARE * limit_w for w in watts) / n, 3),
            "sm_clock_mhz": _spread(clocks),
            "max_sm_clock_mhz": self.max_clock_mhz,
            "clock_reason_fraction": {name: round(sum(bool(s[2] & bit) for s in self.samples)
                                                  / n, 3) for name, bit in REASONS.items()},
            "energy_j": self.energy_j(), "seconds": round(self.seconds, 3),
            "error": self.reason,
        }

    def energy_j(self) -> float | None:
        """Joules the board drew between ``__enter__`` and ``__exit__`` (None without both
        counter readings)."""
        if len(self.energy_mj) != 2:
            return None
        return round((self.energy_mj[1] - self.energy_mj[0]) / 1000.0, 3)


def describe(summary: dict) -> str:
    """One log line of a ``PowerSampler.summary()`` that has samples."""
    s = summary
    return (f"{s['power_w']['mean']} W mean of a {s['power_limit_w']} W limit "
            f"({100 * s['at_cap_fraction']:.0f} % of samples at the cap), SM clock p50 "
            f"{s['sm_clock_mhz']['p50']} of {s['max_sm_clock_mhz']} MHz, power-capped "
            f"{100 * s['clock_reason_fraction']['sw_power_cap']:.0f} % of samples"
            + (f", {s['energy_j']} J in {s['seconds']} s" if s.get("energy_j") is not None else ""))
