"""The engine's arena plan (CPU): every file tensor has a home, every buffer is aligned,
the qkv and gate_up stacks cover their rows exactly once."""
import pytest

from nanoqwen_lib.config import load
from nanoqwen_lib.gpu.engine import plan_arena, weight_sources
from nanoqwen_lib.format.layout import bytes_per_decode_token, packed_tensors


@pytest.mark.parametrize("name", ["7b", "tiny", "tiny-hd64"])
def test_every_tensor_uploaded_once_into_matching_slots(name):
    dims = load().model(name)
    plan = plan_arena(dims, 4096)
    files = packed_tensors(dims)
    srcs = weight_sources(dims)
    assert sorted(s for s, _, _ in srcs) == sorted(files)
    covered = {}
    for src, dst, row in srcs:
        dt, shape = files[src]
        off, sdt, sshape = plan.slots[dst]
        assert sdt == dt and tuple(shape[1:]) == sshape[1:], (src, dst)
        covered.setdefault(dst, []).append((row, row + shape[0]))
    for dst, spans in covered.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == plan.slots[dst][2][0], dst
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), dst


def test_arena_aligned_and_weights_match_decode_bytes():
    """The weights in the arena are what a decode token reads plus the embedding table; with the
    RS-form prefill (INT4's default) plus one RS copy of each projection, exactly its shapes."""
    import numpy as np
    from nanoqwen_lib.gpu.projection import Int4RsProjections
    dims = load().model("7b")
    b = bytes_per_decode_token(dims)
    # weights in the arena = what a decode token reads + the embedding table (read one row)
    expect = b["int4_weights"] + b["scales"] + b["lm_head_fp16"] + b["norms_and_biases"] + dims.vocab * dims.hidden * 2
    rs_copy = dims.num_layers * sum(int(np.prod(w)) * 4 + int(np.prod(s)) * 2
                                    for w, s in Int4RsProjections.rs_shapes(dims).values())
    # the copy holds every projection's words and scales again (rows padded to 64, none dropped)
    assert b["int4_weights"] + b["scales"] <= rs_copy < 1.01 * (b["int4_weights"] + b["scales"])
    for gemm, want in (("wgmma", expect), ("mma", expect), ("rs", expect + rs_copy), (None, expect + rs_copy)):
        plan = plan_arena(dims, 32768, prefill_gemm=gemm)
        assert all(off % 128 == 0 for off, _, _ in plan.slots.values())
        assert plan.bytes_of("w.") == want, gemm


def test_arena_refuses_what_does_not_fit_before_allocating(monkeypatch):
    """GPU out of memory at load: a clear message with the sizes, and nothing allocated.
    (CuPy is replaced by a stand-in that reports 2 GiB free and fails on any allocation.)"""
    import sys
    import types

    from nanoqwen_lib.gpu.arena import DeviceArena
    from nanoqwen_lib.errors import LimitError

    def no_alloc(n):
        raise AssertionError("allocated before checking the size")

    runtime = types.SimpleNamespace(memGetInfo=lambda: (2 << 30, 141 << 30))
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, alloc=no_alloc))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    plan = plan_arena(load().model("7b"), 32768)
    with pytest.raises(LimitError) as ei:
        DeviceArena(plan, source="7b.nanoqwen")
    msg = str(ei.value)
    assert "7b.nanoqwen" in msg and "GPU memory" in msg and "2.00 GiB free" in msg
    assert f"{plan.nbytes / 2**30:.2f} GiB" in msg and "weights" in msg and "KV" in msg


@pytest.mark.parametrize("name", ["7b", "tiny-hd64"])
@pytest.mark.parametrize("encoding", ["int4", "fp8"])
def test_engine_runs_the_layer_description(name, encoding):
    """The engine's decode step and prefill (read off the engine itself, on a stand-in
    arena) launch exactly gpu.layer's regions in order, and the regions' floors add up to
    exactly what a decode token must read."""
    from nanoqwen_lib.gpu import layer

    from .stand_in import stand_in_engine
    eng = stand_in_engine(name, 64, encoding)
    dims = eng.dims
    assert [r for r, _ in eng.step_launches(False)] == [r.name for r in layer.step_regions(dims)]
    assert [r for r, _ in eng.prefill_launches(0, 7)] == [r.prefill for r in layer.prefill_regions(dims)]
    for ctx in (1, 577, 4096):
        per_region = layer.decode_region_bytes(dims, ctx, encoding)
        assert sum(per_region.values()) == sum(bytes_per_decode_token(dims, ctx, encoding).values())


@pytest.mark.parametrize("max_tokens", [64, 512, 4096])
def test_prefill_buffers_hold_one_chunk(max_tokens):
    dims = load().model("7b")
    plan = plan_arena(dims, max_tokens)
    rows = min(load().engine.prefill_chunk_tokens, max_tokens)
    for name, width in (("p.x", dims.hidden), ("p.qkv", dims.qkv_dim), ("p.gate_up", 2 * dims.intermediate),
                        ("p.act", dims.intermediate), ("p.attn", dims.q_dim)):
        assert plan.slots[name][2] == (rows, width), name
    assert plan.slots["s.prompt"][2][0] >= max_tokens


@pytest.mark.parametrize("name", ["tiny", "7b"])
@pytest.mark.parametrize("tokens,start", [(1, 0), (17, 0), (512, 0), (100, 412)])
def test_prefill_region_flops_add_up(name, tokens, start):
    """The prefill breakdown's floors: the regions' FLOPs are layout.prefill_flops' projections
    and attention (a chunk after `start` rows attends to them too); elementwise regions none."""
    from nanoqwen_lib.format.layout import prefill_flops
    from nanoqwen_lib.gpu.layer import prefill_region_flops
    d = load().model(name)
    f = prefill_region_flops(d, tokens, start)
    want = prefill_flops(d, tokens)
    assert sum(v for k, v in f.items() if k.endswith("_gemm")) == want["projections"]
    causal = d.num_layers * d.num_heads * 4 * d.head_dim * (tokens * start + tokens * (tokens + 1) // 2)
    assert f["prefill_attention"] == causal
    if start == 0:
        assert f["prefill_attention"] == want["attention"]
    assert f["norms"] == f["rope_write_kv"] == f["embed"] == 0


def test_prefill_breakdown_table_formats():
    from nanoqwen_lib.measure.breakdown import format_prefill_breakdown
    b = {"tokens": 512, "kind": "k", "tensor_ceiling_tflops": 790.0, "regions_sum_ms": 3.0, "floor_ms": 1.0,
         "regions": {"gate_up_gemm": {"ms": 2.0, "flops": 790e9, "tflops": 395.0, "floor_ms": 1.0},
                     "norms": {"ms": 1.0, "flops": 0, "tflops": None, "floor_ms": None}}}
    text = format_prefill_breakdown(b)
    assert "gate_up_gemm" in text and "50.0%" in text and "33.3%" in text and "cuBLAS ms" not in text
    b["regions"]["gate_up_gemm"]["cublas_ms"] = 0.8              # bench --breakdown: dense FP16 beside it
    text = format_prefill_breakdown(b)
    row = next(line for line in text.splitlines() if line.startswith("gate_up_gemm"))
    assert "cuBLAS ms" in text and row.split()[-2:] == ["0.800", "2.50x"], row


def test_prefill_graphs_capture_on_the_second_sight_and_keep_the_most_recent():
    """PrefillGraphs (CPU: the bookkeeping; tests/test_gpu_engine.py replays real graphs): a
    shape is captured the second time it is seen, at most `kept` graphs stay (least recently
    used out), 0 keeps none, and a bad count is refused before the engine touches the GPU."""
    from nanoqwen_lib.errors import LimitError
    from nanoqwen_lib.gpu.engine import PrefillGraphs
    g = PrefillGraphs(2)
    assert not g.seen_again((0, 512)) and g.seen_again((0, 512))
    g.keep((0, 512), "g512")
    assert g.get((0, 512)) == "g512" and g.get((0, 17)) is None and g.replays == 1
    for key in ((0, 17), (0, 33)):
        assert not g.seen_again(key) and g.seen_again(key)
        g.keep(key, f"g{key[1]}")
    assert len(g) == 2 and g.get((0, 512)) is None and g.get((0, 17)) == "g17"
    g.keep((512, 88), "g88")                       # (0, 17) was used last: (0, 33) goes
    assert g.get((0, 33)) is None and g.get((0, 17)) == "g17" and len(g) == 2
    none = PrefillGraphs(0)
    assert not none.seen_again((0, 5)) and not none.seen_again((0, 5))
    for bad in (-1, 1.5, "4"):
        with pytest.raises(LimitError, match="prefill_graphs"):
            PrefillGraphs(bad)
