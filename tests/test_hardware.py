"""gpu.hardware on a CPU: the one-line answer on every GPU that is not Hopper (faked devices),
on an unusable driver, before any kernel is built; the SM override every planner reads."""
from __future__ import annotations

import pytest

from nanoqwen_lib.config import load
from nanoqwen_lib.errors import LimitError
from nanoqwen_lib.gpu import cuda_build, hardware

H200 = {"name": "NVIDIA H200", "cc": (9, 0), "sms": 132, "smem_optin": 232448, "smem_per_sm": 233472,
        "regs_per_sm": 65536, "clock_khz": 1980000, "mem_clock_khz": 3201000, "bus_bits": 6016,
        "driver": 13000, "runtime": 13000}
OTHERS = {
    "A100": dict(H200, name="NVIDIA A100-SXM4-80GB", cc=(8, 0), sms=108),
    "L40S": dict(H200, name="NVIDIA L40S", cc=(8, 9), sms=142),
    "B200": dict(H200, name="NVIDIA B200", cc=(10, 0), sms=148),
}
DRIVER_TOO_OLD = {"error": "CUDARuntimeError: cudaErrorInsufficientDriver: CUDA driver version is insufficient "
                           "for CUDA runtime version", "status": 35, "driver_present": True,
                  "cupy": "cupy 14.2.0, built for CUDA 13"}


@pytest.fixture
def fake(monkeypatch):
    """fake(probe): this process sees that device (or that failure) until the test ends."""
    def use(probe):
        monkeypatch.setattr(hardware, "_probe", lambda: dict(probe))
        hardware.cache_clear()
    yield use
    hardware.cache_clear()


@pytest.mark.parametrize("gpu", sorted(OTHERS))
def test_other_gpus_are_refused_in_one_line(fake, gpu):
    fake(OTHERS[gpu])
    s = hardware.gpu_status()
    cc = OTHERS[gpu]["cc"]
    assert s.kind == "arch" and not s.usable and not cuda_build.have_gpu()
    assert "\n" not in s.reason and OTHERS[gpu]["name"] in s.reason and f"sm_{cc[0]}{cc[1]}" in s.reason
    assert "sm_90" in s.reason
    with pytest.raises(hardware.UnsupportedGpu) as e:
        hardware.require_hopper("GpuBackend")
    assert str(e.value) == f"GpuBackend: {s.reason}"


def test_hopper_is_usable_and_described(fake):
    fake(H200)
    assert hardware.gpu_status().usable and cuda_build.have_gpu()
    hw = hardware.hardware()
    assert (hw.sms, hw.smem_optin, hw.source) == (132, 232448, "device")
    # the budget: the DRAM peak (3.201 GHz x 2 x 6016 bits, as the H200 reports them) times the H200's measured fraction
    assert hw.read_tbps == pytest.approx(3.201e9 * 2 * 6016 / 8 / 1e12 * load().hardware["read_efficiency"], abs=1e-3)
    assert hw.read_tbps == pytest.approx(load().hardware["read_tbps"], rel=0.01)


def test_an_unusable_driver_says_so(fake):
    """A CUDA 12 driver under the cuda13 extra: a GPU is there, so this is not 'no GPU'."""
    fake(DRIVER_TOO_OLD)
    s = hardware.gpu_status()
    assert s.kind == "driver" and not cuda_build.have_gpu()
    assert "\n" not in s.reason and "cuda12 extra" in s.reason and "driver" in s.reason
    with pytest.raises(hardware.UnsupportedGpu, match="CuPy cannot use"):
        hardware.require_hopper("GpuBackend")


def test_no_driver_is_a_cpu_machine(fake):
    fake(dict(DRIVER_TOO_OLD, driver_present=False))
    assert hardware.gpu_status().kind == "none"
    fake({"error": "no CUDA device", "status": 100, "driver_present": True})
    assert hardware.gpu_status().kind == "none"
    assert hardware.hardware().source == "design target (no GPU)"


class _Stop(Exception):
    pass


@pytest.mark.parametrize("probe", [OTHERS["A100"], OTHERS["L40S"], OTHERS["B200"], DRIVER_TOO_OLD],
                         ids=["sm_80", "sm_89", "sm_100", "driver"])
def test_refusal_comes_before_any_kernel_is_built(fake, monkeypatch, probe):
    """The engine and every module load refuse before NVRTC sees a kernel (CuPy would append
    the device's -arch and fail in ptxas)."""
    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.synthetic.packed import packed_synthetic
    from nanoqwen_lib.format.weightfile import NanoqwenFile
    fake(probe)
    built = []
    monkeypatch.setattr(cuda_build, "_load_module_cached", lambda *a: built.append(a) or (_ for _ in ()).throw(_Stop()))
    f = NanoqwenFile.open(packed_synthetic("tiny", seed=0))
    with pytest.raises(hardware.UnsupportedGpu) as e:
        GpuBackend(f, max_tokens=64)
    assert "\n" not in str(e.value) and built == []


@pytest.mark.parametrize("probe", [OTHERS["B200"], DRIVER_TOO_OLD], ids=["sm_100", "driver"])
def test_load_module_refuses_first(fake, probe):
    fake(probe)
    cuda_build._load_module_cached.cache_clear()
    with pytest.raises(hardware.UnsupportedGpu, match="kernels/gemv_int4.cu"):
        cuda_build.load_module("gemv_int4")


# ---- the SM override ------------------------------------------------------------------------
def test_sm_override_on_a_device(fake, monkeypatch):
    fake(H200)
    monkeypatch.setenv(hardware.ENV_SMS, "114")
    hardware.cache_clear()
    hw = hardware.hardware()
    assert hw.sms == 114 and "NANOQWEN_SMS=114" in hw.source
    assert hw.sm_bytes_per_ns == pytest.approx(hw.read_tbps * 1e3 / 114)


@pytest.mark.parametrize("value", ["0", "133", "-4", "many", "7.5"])
def test_sm_override_is_checked(fake, monkeypatch, value):
    fake(H200)
    monkeypatch.setenv(hardware.ENV_SMS, value)
    hardware.cache_clear()
    with pytest.raises(LimitError, match=r"NANOQWEN_SMS: expected an integer in \[1, 132\]"):
        hardware.hardware()


def test_read_override(fake, monkeypatch):
    fake(H200)
    monkeypatch.setenv(hardware.ENV_READ_TBPS, "3.35")
    hardware.cache_clear()
    assert hardware.hardware().read_tbps == 3.35
    monkeypatch.setenv(hardware.ENV_READ_TBPS, "fast")
    hardware.cache_clear()
    with pytest.raises(LimitError, match="NANOQWEN_READ_TBPS"):
        hardware.hardware()


def test_cpu_plans_the_design_target(fake, monkeypatch):
    fake({"error": "no CUDA device", "status": 100})
    monkeypatch.delenv(hardware.ENV_SMS, raising=False)
    hardware.cache_clear()
    assert hardware.hardware().sms == load().hardware["sms"]
    monkeypatch.setenv(hardware.ENV_SMS, "78")
    hardware.cache_clear()
    assert hardware.hardware().sms == 78                       # a CPU build can plan a 78-SM Hopper too


# ---- every planner reads it ----------------------------------------------------------------------
@pytest.fixture
def sms(fake, monkeypatch):
    def at(n):
        fake(H200)
        monkeypatch.setenv(hardware.ENV_SMS, str(n))
        hardware.cache_clear()
    return at


def test_persistent_planner_reads_the_override(sms):
    from nanoqwen_lib.gpu.persistent import persistent_plan, check_plan
    d = load().model("7b")
    plans = {}
    for n in (132, 114, 78):
        sms(n)
        plans[n] = persistent_plan(d)
        assert plans[n] == persistent_plan(d, n)           # the default grid is the override
        check_plan(d, plans[n], n)
        assert cuda_build.planned_defines("decode_persistent", d) == plans[n]
        for m in ("QKV", "O", "GU", "DOWN"):
            assert plans[n][f"NQ_PD_{m}_TG"] * plans[n][f"NQ_PD_{m}_KS"] <= n
    assert plans[132] != plans[78]


def test_decode_planners_read_the_override(sms):
    """The kernel-per-op step's grids: lm_head and argmax launch per SM this machine plans for
    (the GEMVs' split-K plan fills no SM target: SPLIT_TARGET_CTAS_PER_SM is 0)."""
    from nanoqwen_lib.gpu import ops_decode, ops_gemv
    grids = {}
    for n in (132, 78):
        sms(n)
        assert ops_gemv.num_sms() == n
        grids[n] = (ops_decode.lm_head_grid(152064, ops_decode.LMHEAD_TUNING), ops_decode.argmax_grid(1 << 24))
    assert grids[132] == (ops_decode.LMHEAD_CTAS_PER_SM * 132, ops_decode.ARGMAX_CTAS_PER_SM * 132), grids
    assert grids[78] == (ops_decode.LMHEAD_CTAS_PER_SM * 78, ops_decode.ARGMAX_CTAS_PER_SM * 78), grids


def test_prefill_planner_reads_the_override(sms):
    from nanoqwen_lib.gpu import ops_prefill_wgmma
    picks = {}
    for n in (132, 114, 78):
        sms(n)
        assert ops_prefill_wgmma.num_sms() == n
        picks[n] = [ops_prefill_wgmma.plan_wgmma(512, nn, k) for nn, k in ((4608, 3584), (3584, 3584), (37888, 3584),
                                                                           (3584, 18944))]
    assert len({tuple(p) for p in picks.values()}) > 1, picks


def test_persistent_falls_back_below_its_plan(sms, capsys):
    """Below the SMs the plan needs, the default decode is the kernel-per-op step, said in one
    line; asked for by name, the plan's error is raised."""
    from nanoqwen_lib.gpu.engine import persistent_or_graph
    d = load().model("7b")
    sms(74)
    assert persistent_or_graph(d, asked=False) == "persistent"
    sms(73)
    assert persistent_or_graph(d, asked=False) == "graph"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "73 SMs" in err[0] and "decode=graph" in err[0]
    with pytest.raises(LimitError, match="too few SMs"):
        persistent_or_graph(d, asked=True)


@pytest.mark.parametrize("m,tg,ks", [("DOWN", 100, 2), ("QKV", 0, 1), ("O", 132, 2), ("GU", 1, 400)])
def test_a_split_beyond_the_grid_is_refused(m, tg, ks):
    from nanoqwen_lib.gpu.persistent import persistent_plan, check_plan
    d = load().model("7b")
    plan = dict(persistent_plan(d, 132), **{f"NQ_PD_{m}_TG": tg, f"NQ_PD_{m}_KS": ks})
    with pytest.raises(LimitError, match=f"NQ_PD_{m}"):
        check_plan(d, plan, 132)


def test_nbval_under_xdist_is_said_to_share_the_gpu():
    """The header's warning: chapters run at once (`--nbval -n 4`) share one GPU and their
    same-run speed checks can fail; one worker, or no --nbval, is not warned about."""
    import types
    import conftest
    mk = lambda **k: types.SimpleNamespace(option=types.SimpleNamespace(**k))   # noqa: E731
    assert conftest.shares_the_gpu(mk(nbval=True, numprocesses=4))
    assert not conftest.shares_the_gpu(mk(nbval=True, numprocesses=1))
    assert not conftest.shares_the_gpu(mk(nbval=True, numprocesses=None))
    assert not conftest.shares_the_gpu(mk(nbval=False, numprocesses=4))
    assert not conftest.shares_the_gpu(mk(nbval=True))
