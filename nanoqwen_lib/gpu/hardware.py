"""The one description of the GPU every planner reads, and the one check before any kernel.

Everything in nanoqwen that depends on the machine (how the persistent step cuts a layer
over its CTAs, how the prefill GEMMs split K, how many CTAs a GEMV launches) reads
`hardware()`: the SM count, the shared memory a block may opt into, the registers and
shared memory of one SM, and the read bandwidth the planners budget with. On a CPU it
describes the design target (nanoqwen.yaml `hardware:`, an H200), so the CPU build plans
exactly what the H200 runs.

Two environment variables replace what the device reports, so that one GPU can play another:

* ``NANOQWEN_SMS=<n>``: plan for n SMs (at most the device's). An H200 (132 SMs) then plans
  and launches as a 114-SM H100 PCIe or a 78-SM Hopper would; the persistent step launches
  n CTAs.
* ``NANOQWEN_READ_TBPS=<x>``: the read bandwidth the planners budget with (default: the
  device's DRAM peak, from its memory clock and bus width, times the fraction of it the
  H200 reaches, nanoqwen.yaml `hardware.read_efficiency`).

`gpu_status()` says, in one line and before anything is compiled, whether this machine's GPU
can run the kernels: they are written for Hopper (sm_90: bulk copies on mbarriers, wgmma,
FP8 conversions), and CuPy would otherwise hand another GPU's architecture to NVRTC and
fail deep in ptxas.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

from nanoqwen_lib.config import load
from nanoqwen_lib.errors import LimitError

SUPPORTED_CC = (9, 0)           # sm_90 / sm_90a: H100, H200, GH200
ENV_SMS = "NANOQWEN_SMS"
ENV_READ_TBPS = "NANOQWEN_READ_TBPS"


class UnsupportedGpu(LimitError):
    """This machine's GPU (or its driver) cannot run the kernels; the message is one line."""

    def __init__(self, what: str, status: "GpuStatus"):
        super().__init__("<gpu>", what, status.needs, status.found, None)
        self.status = status

    def __str__(self) -> str:
        return f"{self.field}: {self.status.reason}"


@dataclass(frozen=True)
class GpuStatus:
    """What `gpu_status()` found. kind: "ok", "none" (no CUDA device, or CuPy not installed:
    the CPU paths run), "driver" (a GPU CuPy cannot use: wrong CuPy build for the driver),
    "arch" (a GPU that is not Hopper sm_90)."""
    kind: str
    reason: str = ""                 # one line, "" when usable
    name: str = ""
    cc: tuple | None = None

    @property
    def usable(self) -> bool:
        return self.kind == "ok"

    @property
    def needs(self) -> str:
        return "an NVIDIA Hopper GPU (sm_90: H100, H200) that CuPy can use"

    @property
    def found(self) -> str:
        return self.reason or f"{self.name} (sm_{self.cc[0]}{self.cc[1]})"


def _probe() -> dict:
    """What CuPy reports about device 0, as plain values; {'error': ..., 'status': int} when it
    cannot. The one place that asks the driver (tests replace it to fake other GPUs)."""
    try:
        import cupy
    except ImportError as e:
        return {"error": f"CuPy is not installed ({e.name})", "status": None, "import": True}
    rt = cupy.cuda.runtime
    try:
        if rt.getDeviceCount() == 0:
            return {"error": "no CUDA device", "status": 100}
        driver = rt.driverGetVersion()
    except Exception as e:                       # CUDARuntimeError: no driver, or one this CuPy cannot use
        try:
            built = f"cupy {cupy.__version__}, built for CUDA {rt.runtimeGetVersion() // 1000}"
        except Exception:
            built = f"cupy {cupy.__version__}"
        return {"error": f"{type(e).__name__}: {e}", "status": getattr(e, "status", None),
                "driver_present": _driver_present(), "cupy": built}
    dev, p = cupy.cuda.Device(0), rt.getDeviceProperties(0)
    a = dev.attributes                           # cudaDeviceGetAttribute: present in CUDA 12 and 13
    cc = dev.compute_capability                  # "90"
    return {"name": p["name"].decode(), "cc": (int(cc[:-1]), int(cc[-1])),
            "sms": int(a["MultiProcessorCount"]),
            "smem_optin": int(a["MaxSharedMemoryPerBlockOptin"]),
            "smem_per_sm": int(a["MaxSharedMemoryPerMultiprocessor"]),
            "regs_per_sm": int(a["MaxRegistersPerMultiprocessor"]),
            "clock_khz": int(a.get("ClockRate", p.get("clockRate", 0))),
            "mem_clock_khz": int(a.get("MemoryClockRate", p.get("memoryClockRate", 0))),
            "bus_bits": int(a.get("GlobalMemoryBusWidth", p.get("memoryBusWidth", 0))),
            "driver": driver, "runtime": rt.runtimeGetVersion()}


# cudaError codes that mean "a GPU is there, but this CuPy cannot talk to its driver" (35 is
# also what a machine without any NVIDIA driver answers: only a present driver makes it one)
_DRIVER_ERRORS = {35: "the CUDA driver is older than this CuPy's CUDA runtime",
                  803: "the CUDA driver and this CuPy's CUDA runtime do not match",
                  804: "this CUDA runtime is not supported on this GPU"}


def _driver_present() -> bool:
    """Is an NVIDIA driver installed at all (so that a failing CuPy is a real problem and not
    simply a CPU machine)?"""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def status_of(p: dict) -> GpuStatus:
    """The verdict on one probe (pure: the CPU tests feed it faked devices)."""
    if "error" in p:
        if p.get("driver_present") and p.get("status") != 100:
            why = _DRIVER_ERRORS.get(p.get("status"), "the CUDA runtime failed to start")
            return GpuStatus("driver", f"CuPy cannot use this machine's GPU: {why} ({p['error']}; installed: "
                                       f"{p.get('cupy', 'cupy')}; install the cuda12 extra on a CUDA 12 "
                                       f"driver, cuda13 on a CUDA 13 driver)")
        if p.get("status") == 100 or p.get("import"):
            return GpuStatus("none", p["error"])
        return GpuStatus("none", f"no NVIDIA driver on this machine ({p['error']})")
    name, cc = p["name"], tuple(p["cc"])
    if cc != SUPPORTED_CC:
        return GpuStatus("arch", f"{name} is sm_{cc[0]}{cc[1]}; nanoqwen's kernels need Hopper "
                                 f"(sm_90: H100, H200): bulk copies on mbarriers, wgmma, FP8 conversions",
                         name, cc)
    return GpuStatus("ok", "", name, cc)


@functools.lru_cache(maxsize=None)
def gpu_status() -> GpuStatus:
    """Can this machine run the kernels? Never raises, never builds a kernel."""
    return status_of(_probe())


def no_gpu_note() -> str:
    """What a chapter's GPU cell prints on a machine that cannot run it (one line, true after
    `jupyter execute --inplace` too: the rendered book keeps the H200's output)."""
    s = gpu_status()
    return f"no usable Hopper GPU here ({s.reason or 'none'}): this cell ran nothing; the rendered book shows an H200's output"


def require_hopper(what: str) -> None:
    """Raise UnsupportedGpu (one line: which GPU, what is needed) unless gpu_status() is ok.
    Called before any kernel is built."""
    s = gpu_status()
    if not s.usable:
        raise UnsupportedGpu(what, s)


@dataclass(frozen=True)
class Hardware:
    """What the planners plan for. source: "device", "design target (no GPU)", plus the
    overrides applied."""
    name: str
    sms: int
    smem_optin: int          # bytes a block may opt into (cudaFuncAttributeMaxDynamicSharedMemorySize + static)
    smem_per_sm: int
    regs_per_sm: int
    clock_khz: int           # the SM clock the device reports (its boost clock)
    read_tbps: float         # the read bandwidth the planners budget with (1e12 bytes/s)
    source: str

    @property
    def sm_bytes_per_ns(self) -> float:
        """One SM's share of the read bandwidth, bytes per nanosecond."""
        return self.read_tbps * 1e3 / self.sms


def _env_int(name: str, lo: int, hi: int) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        n = int(v)
    except ValueError:
        raise LimitError(f"${name}", name, f"an integer in [{lo}, {hi}]", repr(v)) from None
    if not lo <= n <= hi:
        raise LimitError(f"${name}", name, f"an integer in [{lo}, {hi}] (the device has {hi} SMs)", n)
    return n


def _env_float(name: str) -> float | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        x = float(v)
    except ValueError:
        raise LimitError(f"${name}", name, "a positive number (TB/s)", repr(v)) from None
    if not 0 < x < 100:
        raise LimitError(f"${name}", name, "a positive number of TB/s below 100", x)
    return x


def design_target() -> Hardware:
    """The machine the defaults are tuned for (nanoqwen.yaml `hardware:`): what a CPU plans."""
    h = load().hardware
    return Hardware(h["name"], h["sms"], h["smem_optin"], h["smem_per_sm"], h["regs_per_sm"],
                    h["clock_khz"], h["read_tbps"], "design target (no GPU)")


def describe(p: dict | None) -> Hardware:
    """The Hardware of a probe (None: the design target), before the overrides."""
    if p is None or "error" in p:
        return design_target()
    peak = p["mem_clock_khz"] * 1e3 * 2 * p["bus_bits"] / 8 / 1e12      # DDR: 2 transfers a clock
    read = peak * load().hardware["read_efficiency"] if peak > 0 else design_target().read_tbps
    return Hardware(p["name"], p["sms"], p["smem_optin"], p["smem_per_sm"], p["regs_per_sm"],
                    p["clock_khz"], round(read, 3), "device")


def with_overrides(hw: Hardware, device_sms: int | None = None) -> Hardware:
    """hw with $NANOQWEN_SMS and $NANOQWEN_READ_TBPS applied (checked: the SM count at most
    the device's)."""
    notes = []
    sms = _env_int(ENV_SMS, 1, device_sms or hw.sms)
    if sms is not None and sms != hw.sms:
        notes.append(f"{ENV_SMS}={sms}")
        hw = replace(hw, sms=sms)
    tbps = _env_float(ENV_READ_TBPS)
    if tbps is not None:
        notes.append(f"{ENV_READ_TBPS}={tbps}")
        hw = replace(hw, read_tbps=tbps)
    return replace(hw, source=hw.source + "".join(f", {n}" for n in notes))


@functools.lru_cache(maxsize=None)
def hardware() -> Hardware:
    """The description every planner reads: the device's (when gpu_status() is ok), else the
    design target; with the environment's overrides. Read once per process."""
    p = _probe() if gpu_status().usable else None
    hw = describe(p)
    return with_overrides(hw, hw.sms if p is not None else None)


def cache_clear() -> None:
    """Forget the probe (tests that fake devices or change the overrides)."""
    gpu_status.cache_clear()
    hardware.cache_clear()
