"""The engine's wiring of each weight encoding, on the CPU: every projection launch of the
FP8 engine (decode and prefill) and of the INT4 prefill (on wgmma and on mma.sync) is run
through its launchers' checks against a stand-in
arena, with the kernels replaced by a recorder. Dtypes, shapes, contiguity, 128-byte alignment and aliasing of
every argument are checked exactly as on the GPU; only the kernels do not run (their
numbers are tests/test_gpu_fp8.py's and tests/test_gpu_engine_fp8.py's)."""
from __future__ import annotations

import sys

import pytest

from nanoqwen_lib.gpu import ops_fp8, ops_prefill_mma, ops_prefill_wgmma

from .stand_in import stand_in_cupy, stand_in_engine


@pytest.fixture
def recorded(monkeypatch):
    calls = []

    def kernel(name, *_):
        def launch(grid, block, args, shared_mem=0):
            calls.append((name, tuple(grid), tuple(block)))
        return launch

    monkeypatch.setitem(sys.modules, "cupy", stand_in_cupy)
    monkeypatch.setattr(ops_fp8, "_kernel", kernel)
    # each name in the module that owns it (ops_prefill only re-exports them)
    monkeypatch.setattr(ops_prefill_mma, "_gemm_kernel", lambda name, *a: kernel(name))
    monkeypatch.setattr(ops_prefill_wgmma, "_wgmma_kernel", lambda name, *a: kernel(name))
    for mod in (ops_prefill_mma, ops_prefill_wgmma):                   # plan_gemm's, plan_wgmma's
        monkeypatch.setattr(mod, "num_sms", lambda: 132)              # the H200's, for the plans
    monkeypatch.setattr(ops_prefill_mma, "workspace", lambda: (None, None))   # every split-K GEMM's
    from nanoqwen_lib.gpu import tensor_map

    def device_map(array, box, *, swizzle="128B"):     # the map's checks, without the driver
        tensor_map.tiled_args(1 << 20, array.shape, array.dtype, box, swizzle=swizzle)
        return None
    monkeypatch.setattr(tensor_map, "device_map", device_map)
    return calls


def fp8_engine(dims_name: str, max_tokens: int, prefill_gemm: str = "mma"):
    return stand_in_engine(dims_name, max_tokens, "fp8", prefill_gemm)


SWAPPED_DECODE = {"qkv_gemv": ["nq_gemv_fp8"], "o_proj": ["nq_gemv_fp8"], "gate_up_gemv": ["nq_gemv_fp8"],
                  "swiglu_down": ["nq_swiglu_act", "nq_gemv_fp8"]}
SWAPPED_PREFILL = {"qkv_gemm": ["nq_quantize_rows_fp8", "nq_gemm_fp8"],
                   "o_proj_gemm": ["nq_quantize_rows_fp8", "nq_gemm_fp8"],
                   "gate_up_gemm": ["nq_quantize_rows_fp8", "nq_gemm_fp8"],
                   "swiglu_down_gemm": ["nq_swiglu_act", "nq_quantize_rows_fp8", "nq_gemm_fp8"]}
# The same regions on wgmma: FP8's GEMM swapped; INT4 fuses SwiGLU into gate_up.
FP8_WGMMA_PREFILL = {r: [k.replace("nq_gemm_fp8", "nq_prefill_wgmma_fp8") for k in ks] for r, ks in SWAPPED_PREFILL.items()}
INT4_PREFILL = {
    "mma": {"qkv_gemm": ["nq_prefill_gemm"], "o_proj_gemm": ["nq_prefill_gemm"], "gate_up_gemm": ["nq_prefill_gemm"],
            "swiglu_down_gemm": ["nq_swiglu_act", "nq_prefill_gemm"]},
    "wgmma": {"qkv_gemm": ["nq_prefill_wgmma"], "o_proj_gemm": ["nq_prefill_wgmma"],
              "gate_up_gemm": ["nq_prefill_wgmma_swiglu"], "swiglu_down_gemm": ["nq_prefill_wgmma"]},
}


@pytest.mark.parametrize("dims_name", ["7b", "tiny", "tiny-hd64"])
def test_fp8_decode_launches_pass_their_checks(recorded, dims_name):
    eng = fp8_engine(dims_name, 256)
    for layer in (0, eng.dims.num_layers - 1):
        launches = eng.layer_launches(layer)
        assert [n for n, _ in launches].count("norms") == 2 and len(launches) == 8
        for name, launch in launches:
            if name in SWAPPED_DECODE:
                del recorded[:]
                launch()
                assert [c[0] for c in recorded] == SWAPPED_DECODE[name], name


@pytest.mark.parametrize("dims_name,t,start", [("7b", 512, 0), ("7b", 37, 512), ("tiny", 1, 0), ("tiny-hd64", 100, 16)])
def test_fp8_prefill_launches_pass_their_checks(recorded, dims_name, t, start):
    eng = fp8_engine(dims_name, 1024)
    launches = eng.prefill_launches(start, t)
    assert len(launches) == 1 + 8 * eng.dims.num_layers
    seen = set()
    for name, launch in launches:
        if name in SWAPPED_PREFILL:
            del recorded[:]
            launch()
            assert [c[0] for c in recorded] == SWAPPED_PREFILL[name], name
            gemm = recorded[-1]
            assert gemm[1][0] == -(-t // ops_fp8.GEMM_BM)          # token tiles of the GEMM grid
            seen.add(name)
    assert seen == set(SWAPPED_PREFILL)


@pytest.mark.parametrize("gemm", ["wgmma", "mma"])
@pytest.mark.parametrize("dims_name,t,start", [("7b", 512, 0), ("7b", 37, 512), ("tiny", 1, 0), ("tiny-hd64", 100, 16)])
def test_prefill_projection_kernels_per_gemm(recorded, gemm, dims_name, t, start):
    """Each prefill projection region launches its encoding's kernels on the chosen GEMM, and
    every launch passes its launcher's checks (shapes, dtypes, aliasing, alignment)."""
    for encoding, want in (("int4", INT4_PREFILL[gemm]), ("fp8", SWAPPED_PREFILL if gemm == "mma" else FP8_WGMMA_PREFILL)):
        eng = stand_in_engine(dims_name, 1024, encoding, gemm)
        got = {}
        for name, launch in eng.prefill_launches(start, t):
            if name in want and name not in got:
                del recorded[:]
                launch()
                got[name] = [c[0] for c in recorded]
                for kname, _, block in recorded:   # the wgmma block size per kernel (v5: INT4 bn <= 128: 512)
                    if kname == "nq_prefill_wgmma_fp8":
                        assert block == (ops_prefill_wgmma.WGMMA_THREADS,), (kname, block)
                    elif kname.startswith("nq_prefill_wgmma"):
                        assert block[0] in (ops_prefill_wgmma.WGMMA_THREADS, 512), (kname, block)
        assert got == want, (encoding, gemm)


@pytest.mark.parametrize("dims_name,t,start", [("7b", 512, 0), ("7b", 37, 512), ("tiny", 1, 0), ("tiny-hd64", 100, 16)])
def test_int4_prefill_on_the_rs_form(monkeypatch, recorded, dims_name, t, start):
    """prefill_gemm="rs" (the RS form, INT4's default): each projection region is one nq_prefill_rs
    launch (SwiGLU in gate_up's epilogue, so no nq_swiglu_act before down) reading the RS copies
    (the arena's `.rs` / `.rs_scales` slots), with plan_rs's build and its grid; every argument
    passes the launcher's checks."""
    from nanoqwen_lib.format.layout import decode_gemv_shapes
    from nanoqwen_lib.gpu import ops_prefill_rs as prefill_rs

    builds = []

    def kernel(items):
        b = dict(items)

        def launch(grid, block, args, shared_mem=0):
            builds.append((b, tuple(grid), tuple(block)))
            recorded.append(("nq_prefill_rs", tuple(grid), tuple(block)))
        return launch
    monkeypatch.setattr(prefill_rs, "_kernel", kernel)
    eng = stand_in_engine(dims_name, 1024, "int4", "rs")
    shapes = decode_gemv_shapes(eng.dims)
    regions = {"qkv_gemm": "qkv", "o_proj_gemm": "o_proj", "gate_up_gemm": "gate_up", "swiglu_down_gemm": "down"}
    seen = set()
    for name, launch in eng.prefill_launches(start, t):
        if name in regions and name not in seen:
            del recorded[:], builds[:]
            launch()
            assert [c[0] for c in recorded] == ["nq_prefill_rs"], (name, recorded)
            b, grid, block = builds[0]
            n = shapes[regions[name]][0]
            assert b == {**prefill_rs.RS_BUILD, **prefill_rs.plan_rs(t, n, 132),
                         "NQ_RS_SWIGLU": int(name == "gate_up_gemm")}, name
            assert grid == (-(-n // (64 * b["NQ_RS_CWG"])), -(-t // b["NQ_RS_BM"])), name
            assert block == (128 * (1 + b["NQ_RS_CWG"]),)
            seen.add(name)
    assert seen == set(regions)


def test_rs_prefill_plans_its_copies():
    from nanoqwen_lib.config import load
    from nanoqwen_lib.gpu.engine import plan_arena
    dims = load().model("tiny")
    slots = plan_arena(dims, 256, "int4", prefill_gemm="rs").slots
    assert {"w.0.gate_up.rs", "w.0.gate_up.rs_scales", "w.0.down.rs"} <= set(slots)
    assert slots["w.0.gate_up.rs"][2] == (-(-dims.intermediate // 32), dims.hidden // 64, 4, 32, 4)
    assert not any(k.endswith(".rs") for k in plan_arena(dims, 256, "int4", prefill_gemm="wgmma").slots)
    assert "w.0.qkv.rs" in plan_arena(dims, 256, "int4").slots          # the RS form is INT4's default


@pytest.mark.parametrize("bn,split", [(112, 1), (128, 1), (128, 3), (144, 2), (256, 1)])
def test_int4_wgmma_block_size_follows_the_build(recorded, bn, split):
    """nq_prefill_wgmma[_swiglu] built with bn <= NQ_PW_INT4_2P_MAX_BN runs 2 producer warpgroups
    (512 threads), the wider builds 384: the launchers pass the build's block size."""
    import numpy as np
    from nanoqwen_lib.gpu.ops_prefill import gemm_int4, gemm_int4_gate_up_swiglu, wgmma_int4_threads
    want = 512 if bn <= ops_prefill_wgmma.WGMMA_INT4_2P_MAX_BN else 384
    assert wgmma_int4_threads(bn) == want
    from .stand_in import HostDeviceArray

    def zeros(shape, dtype):   # 128-byte aligned host arrays that pass the device-buffer checks
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        raw = np.zeros(n + 128, np.uint8)
        base = (-raw.__array_interface__["data"][0]) % 128
        return raw[base: base + n].view(dtype).reshape(shape).view(HostDeviceArray)
    t, n, k = 130, 512, 1024
    x = zeros((t, k), np.float16)
    words, scales = zeros((n, k // 8), np.uint32), zeros((n, k // 128), np.float16)
    gemm_int4(x, words, scales, zeros((t, n), np.float16), kernel="wgmma", bn=bn, split=split)
    gemm_int4_gate_up_swiglu(x, words, scales, zeros((t, n // 2), np.float16), bn=bn, split=split)
    assert [(c[0], c[2]) for c in recorded] == [("nq_prefill_wgmma", (want,)), ("nq_prefill_wgmma_swiglu", (want,))]


def test_each_encoding_names_its_own_prefill_gemms():
    """What bench writes as protocol.prefill: the file's encoding's GEMMs."""
    for encoding, word in (("int4", "INT4"), ("fp8", "FP8")):
        for gemm in ("wgmma", "mma"):
            eng = stand_in_engine("tiny", 64, encoding, gemm)
            eng.prefill_mode, eng.chunk = "tensor-core", 512
            assert eng.prefill_kind.startswith(word) and "512" in eng.prefill_kind
            assert ("wgmma" in eng.prefill_kind) == (gemm == "wgmma")


def test_launch_step_chooses_replay_or_eager_and_writes_the_token_first():
    """GpuBackend.launch_step's dispatch, with stand-ins for the stream and the graphs:
    decode replays when graphs exist, the prompt's tokens run eagerly, force() writes the
    token and replays; without graphs everything is eager; the KV pool's limit is checked
    before anything is enqueued."""
    import contextlib

    from nanoqwen_lib.gpu.engine import GpuBackend
    from nanoqwen_lib.errors import LimitError

    log = []

    class Graph:
        def __init__(self, new_page):
            self.new_page = new_page

        def launch(self, stream):
            log.append(("replay", self.new_page))

    eng = object.__new__(GpuBackend)
    eng.position, eng.max_tokens, eng.use_graphs = 15, 18, True
    eng.graphs = {False: Graph(False), True: Graph(True)}
    eng.stream = contextlib.nullcontext()
    eng.write_token = lambda t: log.append(("token", t))
    eng.enqueue_step = lambda new_page: log.append(("eager", new_page))
    eng.token_at = lambda position: position
    eng.launch_step(7)                       # a prompt token: eager
    eng.launch_step()                        # decode: the graph of a page boundary (position 16)
    assert eng.force(9) == 17                # teacher forcing: token, then the replay
    assert log == [("token", 7), ("eager", False), ("replay", True), ("token", 9), ("replay", False)]
    with pytest.raises(LimitError, match="sequence length"):
        eng.force(3)
    assert eng.position == 18 and len(log) == 5      # refused before anything was enqueued
    log.clear()
    eng.position, eng.use_graphs = 0, False
    eng.force(4)
    eng.launch_step(5)
    assert log == [("token", 4), ("eager", True), ("token", 5), ("eager", False)]


def test_rs_launchers_check_as_every_prefill_gemm(monkeypatch, recorded):
    """The RS launchers take launch_checks.check_prefill_gemm's checks (x, out, bias, residual,
    out not x, 32-bit offsets) and refuse a build name they set themselves (NQ_RS_SWIGLU)."""
    import numpy as np
    from nanoqwen_lib.errors import NanoqwenError
    from nanoqwen_lib.gpu import ops_prefill_rs as rs
    from .stand_in import HostDeviceArray

    monkeypatch.setattr(rs, "_kernel", lambda items: lambda grid, block, args, shared_mem=0:
                        recorded.append(("nq_prefill_rs", tuple(grid), tuple(block))))

    def zeros(shape, dtype):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        raw = np.zeros(n + 128, np.uint8)
        base = (-raw.__array_interface__["data"][0]) % 128
        return raw[base: base + n].view(dtype).reshape(shape).view(HostDeviceArray)
    t, n, k = 64, 128, 128
    x, sc = zeros((t, k), np.float16), zeros((n, 1), np.float16)
    w_rs, s_rs = zeros((2, 2, 4, 32, 4), np.uint32), zeros((2, 1, 64), np.float16)
    with pytest.raises(NanoqwenError, match="out") as e:
        rs.gemm_int4_rs(x, w_rs, sc, x, scales_rs=s_rs)                       # out is x (N = K here)
    assert "ops_prefill_rs.gemm_int4_rs" in str(e.value)
    with pytest.raises(NanoqwenError, match="bias"):
        rs.gemm_int4_rs(x, w_rs, sc, zeros((t, n), np.float16), bias=zeros((n + 8,), np.float16), scales_rs=s_rs)
    with pytest.raises(NanoqwenError, match="build"):
        rs.gemm_int4_rs(x, w_rs, sc, zeros((t, n), np.float16), scales_rs=s_rs, NQ_RS_SWIGLU=1)
    with pytest.raises(NanoqwenError, match="act"):
        rs.gemm_int4_rs_swiglu(x, w_rs, s_rs, zeros((t + 1, n // 2), np.float16))
    rs.gemm_int4_rs(x, w_rs, sc, zeros((t, n), np.float16), scales_rs=s_rs)
    rs.gemm_int4_rs_swiglu(x, w_rs, s_rs, zeros((t, n // 2), np.float16))
    assert [c[0] for c in recorded] == ["nq_prefill_rs", "nq_prefill_rs"]
