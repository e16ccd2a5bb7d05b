"""Every kernel compiles for sm_90 through NVRTC, with no GPU, with the runtime's options.

Each kernels/*.cu and kernels/lab/*.cu is built for the `7b` and `tiny` dims, and for `7b`
once more with each extra-define set its header names on a `// nq-variants: A=1[,B=2]; C=3`
line. Every tuning knob comes from nanoqwen.yaml: a build that misses one stops at its #error. The ptxas
report (registers, stack frame, spills) is printed (`pytest -s` shows it); the hot kernels
(the GEMVs and the lm_head) must not spill.
"""
from __future__ import annotations

import re

import pytest

from nanoqwen_lib import config
from nanoqwen_lib.gpu import cuda_build

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

KERNELS = sorted(p.stem for p in cuda_build.KERNEL_DIR.glob("*.cu"))
LAB = sorted(f"lab/{p.stem}" for p in (cuda_build.KERNEL_DIR / "lab").glob("*.cu"))
ALL = KERNELS + LAB
HOT = re.compile(r"^nq_(gemv|lm_head)")


variants = cuda_build.kernel_variants     # the extra-define sets of the file's `// nq-variants:` line


def entries(log: str) -> dict[str, dict]:
    """ptxas log -> {entry: {'registers', 'stack', 'spill_stores', 'spill_loads'}}."""
    out, cur = {}, None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            cur = out.setdefault(m.group(1), {})
        elif cur is not None and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                                 r"(\d+) bytes spill loads", line)):
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif cur is not None and (m := re.search(r"Used (\d+) registers", line)):
            cur["registers"] = int(m.group(1))
    return out


CASES = [(name, dims, {}) for name in ALL for dims in ("7b", "tiny")] + \
        [(name, "7b", v) for name in ALL for v in variants(name)]


@pytest.mark.parametrize("name,dims,extra", CASES,
                         ids=[f"{n}-{d}-{','.join(f'{k}={v}' for k, v in e.items()) or 'base'}" for n, d, e in CASES])
def test_kernel_compiles_sm90(name, dims, extra):
    cubin, log = cuda_build.compile_cubin(name, config.load().model(dims), extra)
    assert cubin, f"kernels/{name}.cu: empty CUBIN"
    report = entries(log)
    assert report, f"kernels/{name}.cu: no entry functions in the ptxas report:\n{log}"
    for fn, r in sorted(report.items()):
        print(f"{name}.cu [{dims} {extra or ''}] {fn}: {r.get('registers')} regs, stack {r.get('stack')} B, "
              f"spills {r.get('spill_stores')}/{r.get('spill_loads')} B")
    spilling = {fn: r for fn, r in report.items()
                if HOT.match(fn) and (r.get("spill_stores", 0) or r.get("spill_loads", 0) or r.get("stack", 0))}
    assert not spilling, f"kernels/{name}.cu {extra}: hot kernels use local memory: {spilling}"


def test_variant_line_parses():
    assert variants("gemv_int4"), "gemv_int4.cu names its variants on a `// nq-variants:` line"
    for v in variants("gemv_int4"):
        assert all(k.startswith("NQ_") and val.strip() for k, val in v.items()), v


def test_tuned_table_is_built_and_consistent():
    """Every (tuning, ksplit) the launcher picks for the 7B shapes is a compiled variant
    above (so CI checked it for spills) and fits one CTA's shared memory."""
    from nanoqwen_lib.gpu import ops_gemv

    built = [{}] + [{k: int(v) for k, v in d.items()} for d in variants("gemv_int4")]
    for (fn, n, k), (tuning, ksplit) in ops_gemv.tuned_table().items():
        t, s = ops_gemv.gemv_config(fn, n, k)
        assert s == ksplit and all(t[name] == v for name, v in tuning.items()), (fn, n, k, t, s)
        assert tuning in built, f"{fn} {n}x{k}: tuning {tuning} is not on the nq-variants line"
        assert -(-(k // 128) // s) * 320 <= 48 * 1024, (fn, n, k, s)
    t, s = ops_gemv.gemv_config("gemv_int4", 1000, 1152)          # not in the table
    assert s == 1 and t["NQ_GEMV_UNROLL"] == ops_gemv.GEMV_FALLBACK["NQ_GEMV_UNROLL"]


def test_sass_of_the_hot_loops():
    """What the kernels compile to (nvdisasm, no GPU). The INT4 GEMV's main loop runs on the
    tensor cores and stays under the issue budget at the read ceiling (~3.7 lane-
    instructions per INT4 weight on an H200, book/00-path-of-a-token.md, "The floors");
    the FP8 GEMV converts codes with the hardware's E4M3 unpack."""
    import collections
    if cuda_build.nvdisasm_path() is None:
        pytest.skip("nvdisasm not installed (the cuda13 extra brings it)")
    from nanoqwen_lib.gpu import ops_gemv
    loops = cuda_build.sass_loops(cuda_build.sass("gemv_int4", None, dict(ops_gemv.GEMV_TUNING)), "nq_gemv_int4")
    main = max(loops, key=len)
    count = collections.Counter(main)
    loads = sum(v for k, v in count.items() if k.startswith("LDG") and ".128" in k)
    assert count["HMMA.16816.F32"] > 0 and loads > 0
    per_weight = len(main) / (32 * loads)
    print(f"nq_gemv_int4 main loop: {len(main)} instructions, {loads} 16-byte loads, {per_weight:.2f} per weight")
    assert per_weight < 3.7, per_weight
    fp8 = collections.Counter(max(cuda_build.sass_loops(cuda_build.sass("fp8"), "nq_gemv_fp8"), key=len))
    assert any(k.startswith("F2FP.F16.E4M3.UNPACK") for k in fp8), fp8.most_common(5)


@pytest.mark.parametrize("bn", [112, 128, 144, 256])
def test_sass_of_the_wgmma_prefill(bn):
    """kernels/prefill_wgmma.cu (sm_90a) reaches Hopper's warpgroup MMA: the INT4 and SwiGLU
    kernels' consumer loops issue HGMMA (f16, N = bn) and the FP8 one QGMMA (E4M3), with no
    HMMA (mma.sync) anywhere; the operands come by TMA (UTMALDG.2D, no cp.async LDGSTS); the
    producer / consumer register split (setmaxnreg) survives in the 384-thread builds (512: none);
    no local memory in the INT4 kernels."""
    import collections
    import re
    if cuda_build.nvdisasm_path() is None:
        pytest.skip("nvdisasm not installed (the cuda13 extra brings it)")
    from nanoqwen_lib.gpu import ops_prefill
    assert cuda_build.kernel_arch("prefill_wgmma") == "sm_90a"
    text = cuda_build.sass("prefill_wgmma", None, {"NQ_PW_BN": bn})
    for kernel, op in (("nq_prefill_wgmma", f"HGMMA.64x{bn}x16.F32"), ("nq_prefill_wgmma_swiglu", f"HGMMA.64x{bn}x16.F32"),
                       ("nq_prefill_wgmma_fp8", f"QGMMA.64x{bn}x32.F32.E4M3.E4M3")):
        loops = cuda_build.sass_loops(text, kernel)
        hot = [collections.Counter(loop) for loop in loops if any(o.startswith(op) for o in loop)]
        assert hot, f"{kernel}: no loop issues {op}"
        assert sum(c[o] for c in hot for o in c if o.startswith(op)) >= 4, f"{kernel}: 4 wgmmas per stage"
        start = text.index(f".text.{kernel}:")
        body = text[start:text.find("//----", start)]
        assert not re.search(r"\bHMMA\.", body), f"{kernel}: mma.sync (HMMA) in the SASS"
        if kernel == "nq_prefill_wgmma_fp8" or ops_prefill.wgmma_int4_threads(bn) == ops_prefill.WGMMA_THREADS:
            assert "USETMAXREG.DEALLOC" in body and "USETMAXREG.TRY_ALLOC" in body, f"{kernel}: setmaxnreg dropped"
        else:   # 512 threads (2 producer warpgroups): 128 registers each, no split
            assert "USETMAXREG" not in body, f"{kernel}: setmaxnreg in a 512-thread build"
        assert "UTMALDG.2D" in body, f"{kernel}: no TMA load (X, and W: packed INT4 words / E4M3 codes)"
        assert not re.search(r"\bLDGSTS\b", body), f"{kernel}: cp.async left in the producer"
        if kernel != "nq_prefill_wgmma_fp8" or bn <= 128:
            assert not re.search(r"\b(LDL|STL)\b", body), f"{kernel} bn={bn}: local memory"


@pytest.mark.parametrize("promote", [32, 64, 128])
def test_fp8_wgmma_promotes_every_interval(promote):
    """NQ_PW_FP8_PROMOTE: the FP8 consumer's k loop (4 QGMMA a 128-k stage) waits for the tensor
    core once per interval, 128 / promote times a stage, before each FP32 add; no spill."""
    if cuda_build.nvdisasm_path() is None:
        pytest.skip("nvdisasm not installed (the cuda13 extra brings it)")
    build = {"NQ_PW_FP8_PROMOTE": promote, "NQ_PW_BN": 128}
    _, log = cuda_build.compile_cubin("prefill_wgmma", None, build)
    assert all("0 bytes spill" in ln for ln in cuda_build.resource_report(log) if "spill" in ln), log
    loops = [lp for lp in cuda_build.sass_loops(cuda_build.sass("prefill_wgmma", None, build), "nq_prefill_wgmma_fp8")
             if any(o.startswith("QGMMA") for o in lp)]
    assert len(loops) == 1, len(loops)
    assert sum(o.startswith("QGMMA") for o in loops[0]) == 4
    assert sum(o.startswith("WARPGROUP.DEPBAR") for o in loops[0]) == 128 // promote


def test_sass_classes():
    """Every class present, in order; an opcode goes to the first class that names it or its
    dotted prefix; what no class names is "other"."""
    ops = ["HADD2.F32", "HADD2.F32", "HADD2", "F2FP.F16.E4M3.UNPACK_B", "HGMMA.64x128x16.F32", "LDG.E.EF.128",
           "LDS.128", "STS.128", "ST.E", "F2F.F16.F32", "IADD3.X", "BRA", "NOP", "STL.64"]
    got = cuda_build.sass_classes(ops)
    assert list(got) == [name for name, _ in cuda_build.SASS_CLASSES] + ["other"]
    assert got == {"tensor core": 1, "FP8/FP16 conversion": 4, "FP32 math": 0, "FP16 math": 1, "global loads": 1,
                   "shared and constant loads": 1, "stores": 2, "integer and bits": 1,
                   "barriers and branches": 1, "other": 2}                 # NOP, STL (not ST, not STS)
    assert sum(got.values()) == len(ops)


def test_lab_files_say_what_they_are():
    """Every lab kernel file opens with a line naming itself and saying what it is, and the
    engines' directory holds no lab variant knob."""
    assert LAB, "kernels/lab/ holds the earlier and experimental versions"
    for name in LAB:
        first = cuda_build.kernel_source(name).splitlines()[0]
        assert first.startswith(f"// {name}.cu: ") and len(first) > len(name) + 20, (name, first)
    for name in KERNELS:
        src = "\n".join(f.read_text() for f in cuda_build.kernel_files(name))   # with the headers it includes
        for knob in ("NQ_GEMV_BRANCHLESS", "NQ_BULK_", "NQ_GEMV_STREAM_", "NQ_ATTN_BUGGY_SYNC"):
            assert knob not in src, f"kernels/{name}.cu still carries the lab knob {knob}"


def guarded_knobs(name: str) -> list[str]:
    """The NQ_* knobs kernels/<name>.cu (with the headers it includes from kernels/) requires
    through `#ifndef NQ_X` + `#error`."""
    knobs = [k for path in cuda_build.kernel_files(name)
             for k in re.findall(r"#ifndef (NQ_\w+)[^\n]*\n#error", path.read_text())]
    return sorted(set(knobs))


def compile_without(name: str, knob: str) -> str:
    """NVRTC's log for kernels/<name>.cu built with the runtime's options minus -D<knob>."""
    from cupy_backends.cuda.libs import nvrtc
    opts = [o for o in cuda_build.compile_options(config.load().model("7b"), arch=cuda_build.kernel_arch(name))
            if not o.startswith(f"-D{knob}=")]
    prog = nvrtc.createProgram(cuda_build.kernel_source(name), f"{name}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, opts)
        return ""
    except nvrtc.NVRTCError:
        return nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


TUNED = [(name, knob) for name in ALL for knob in guarded_knobs(name)
         if knob in config.tuning_defines()]


def test_every_tuning_knob_is_guarded_and_configured():
    """Each knob of nanoqwen.yaml `tuning:` is required by some kernel file, and every
    #error-guarded NQ_* name of a kernel is set by config.cuda_defines or, for a kernel a
    planner configures, by its plan (cuda_build.planned_defines)."""
    guarded = {k for name in ALL for k in guarded_knobs(name)}
    assert set(config.tuning_defines()) <= guarded, set(config.tuning_defines()) - guarded
    dims = config.load().model("7b")
    for name in ALL:
        have = set(config.cuda_defines(dims)) | set(cuda_build.planned_defines(name.split("/")[-1], dims))
        assert set(guarded_knobs(name)) <= have, (name, set(guarded_knobs(name)) - have)


@pytest.mark.parametrize("name,knob", TUNED, ids=[f"{n}-{k}" for n, k in TUNED])
def test_a_missing_knob_fails_to_compile(name, knob):
    log = compile_without(name, knob)
    assert log, f"kernels/{name}.cu compiled without -D{knob}"
    assert f"{knob}: set by nanoqwen_lib.config (nanoqwen.yaml tuning)" in log, log[-2000:]


def test_tuning_table_entries_name_a_commit_or_unmeasured():
    for module, e in config.load().tuning.items():
        assert (cuda_build.KERNEL_DIR / f"{module}.cu").exists(), module
        for when in [e.measured_at] + [s.measured_at for s in e.shapes]:
            assert when == "unmeasured" or re.fullmatch(r"[0-9a-f]{7,40}", when), (module, when)


def test_hopper_primitives_reach_the_sass():
    """Every wrapper of kernels/hopper.cuh, used once in kernels/lab/hopper_probe.cu, becomes
    its Hopper instruction (nvdisasm, no GPU): nothing is dropped or lowered to something else."""
    if cuda_build.nvdisasm_path() is None:
        pytest.skip("nvdisasm not installed (the cuda13 extra brings it)")
    text = cuda_build.sass("lab/hopper_probe")
    ops = set(re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", text))
    want = {"tensor_copy_2d_g2s": "UTMALDG.2D", "prefetch_tensor_map": "UTMACCTL.PF", "bulk_copy_g2s": "UBLKCP.S.G",
            "mbar_arrive_expect_tx": "SYNCS.ARRIVE.TRANS64", "mbar_wait": "SYNCS.PHASECHK.TRANS64.TRYWAIT",
            "fence_proxy_async_smem": "FENCE.VIEW.ASYNC.S", "mma_16816": "HMMA.16816.F32",
            "wgmma (smem_desc operands)": "QGMMA.64x64x32.F32.E4M3.E4M3", "wgmma_fence": "WARPGROUP.ARRIVE",
            "wgmma_wait": "WARPGROUP.DEPBAR.LE", "setmaxnreg_dec": "USETMAXREG.DEALLOC.CTAPOOL",
            "setmaxnreg_inc": "USETMAXREG.TRY_ALLOC.CTAPOOL"}
    missing = {fn: op for fn, op in want.items() if op not in ops}
    assert not missing, f"hopper.cuh wrappers without their instruction: {missing}\n{sorted(ops)}"


@pytest.mark.parametrize("name,layout", [("fp8", "NQ_FP8_LAYOUT_ID"), ("gemv_int4", "NQ_LAYOUT_ID"),
                                         ("prefill_gemm", "NQ_LAYOUT_ID")])
def test_each_kernel_asserts_its_own_layout(name, layout):
    """The INT4 kernels check the INT4 layout id, the FP8 kernels the FP8 one, neither the other's."""
    dims = config.load().model("7b")
    other = {"NQ_LAYOUT_ID", "NQ_FP8_LAYOUT_ID"} - {layout}
    cuda_build.compile_cubin(name, dims, {k: 99 for k in other})        # the other encoding's id: no concern
    with pytest.raises(RuntimeError, match="layout"):
        cuda_build.compile_cubin(name, dims, {layout: 99})


@pytest.mark.parametrize("edit,field", [
    (lambda raw: raw["tuning"]["gemv_int4"]["defines"].update(NQ_GEMV_WARPS="four"), "tuning.gemv_int4.defines"),
    (lambda raw: raw["tuning"]["lm_head"].pop("measured_at"), "tuning.lm_head"),
    (lambda raw: raw["tuning"]["gemv_int4"]["shapes"][0].update(n="qkv_dims"), "tuning.gemv_int4.shapes[0].n"),
    (lambda raw: raw["geometry"]["fp8"].update(NQ_GEMV_WARPS=4), "geometry"),          # a knob named twice
])
def test_a_bad_tuning_table_is_refused_naming_the_field(tmp_path, monkeypatch, edit, field):
    import yaml
    from nanoqwen_lib.errors import ConfigError
    raw = yaml.safe_load(config.CONFIG_PATH.read_text())
    edit(raw)
    bad = tmp_path / "nanoqwen.yaml"
    bad.write_text(yaml.safe_dump(raw))
    monkeypatch.setattr(config, "CONFIG_PATH", bad)
    config.load.cache_clear()
    try:
        with pytest.raises(ConfigError, match=re.escape(field)):
            config.load()
    finally:
        monkeypatch.undo()
        config.load.cache_clear()


@pytest.mark.parametrize("name", ALL)
def test_each_kernel_gets_the_defines_it_reads(name):
    """compile_options(name=...) passes a kernel only the NQ_* defines its file and headers
    mention, and every knob it requires (#error-guarded) among them."""
    dims = config.load().model("7b")
    short = name.split("/")[-1] if name.startswith("lab/") else name
    opts = cuda_build.compile_options(dims, cuda_build.planned_defines(short, dims), include_cuda=False, name=name)
    passed = {o[2:].split("=")[0] for o in opts if o.startswith("-D")}
    assert passed <= cuda_build.names_used(name) | set(cuda_build.planned_defines(short, dims))
    assert set(guarded_knobs(name)) <= passed, set(guarded_knobs(name)) - passed
    assert len(passed) < len(config.cuda_defines(dims))


@pytest.mark.parametrize("name", ["gemv_int4", "decode_persistent"])
def test_own_defines_compile_to_the_same_cubin(name):
    """Leaving out the defines a kernel never reads changes none of its code."""
    from cupy_backends.cuda.libs import nvrtc
    dims = config.load().model("tiny")
    extra = cuda_build.planned_defines(name, dims)

    def build(opts):
        prog = nvrtc.createProgram(cuda_build.kernel_source(name), f"{name}.cu", [], [])
        try:
            nvrtc.compileProgram(prog, list(opts))
            return nvrtc.getCUBIN(prog)
        finally:
            nvrtc.destroyProgram(prog)
    arch = cuda_build.kernel_arch(name)
    assert build(cuda_build.compile_options(dims, extra, arch=arch, name=name)) == \
        build(cuda_build.compile_options(dims, extra, arch=arch))


def test_a_header_edit_changes_the_module_source(tmp_path, monkeypatch):
    """CuPy's kernel cache keys a RawModule by its source text and options, never by the headers
    NVRTC opens: the source both compile paths use (module_source) names every included
    header's digest, so an edit of gemv_int4.cuh (included by gemv_int4.cu and, through it,
    by decode_persistent.cu) reaches both modules and no other."""
    import shutil
    before = {n: cuda_build.module_source(n) for n in ("gemv_int4", "decode_persistent", "lm_head")}
    assert before["gemv_int4"].startswith(cuda_build.kernel_source("gemv_int4"))
    assert "gemv_int4.cuh=" in before["gemv_int4"] and "common.cuh=" in before["gemv_int4"]
    scratch = tmp_path / "kernels"
    shutil.copytree(cuda_build.KERNEL_DIR, scratch)
    monkeypatch.setattr(cuda_build, "KERNEL_DIR", scratch)
    assert {n: cuda_build.module_source(n) for n in before} == before      # same bytes, same key
    with open(scratch / "gemv_int4.cuh", "a") as f:
        f.write("\n// an edit\n")
    after = {n: cuda_build.module_source(n) for n in before}
    assert after["gemv_int4"] != before["gemv_int4"]
    assert after["decode_persistent"] != before["decode_persistent"]
    assert after["lm_head"] == before["lm_head"]
    # what follows the kernel's own text is one comment line: no line of the kernel moves
    assert after["gemv_int4"].splitlines()[:-1] == cuda_build.kernel_source("gemv_int4").splitlines()
    assert after["gemv_int4"].splitlines()[-1].startswith("// nanoqwen headers: ")


def test_the_header_key_changes_no_instruction():
    """The digest comment compiles to the same CUBIN as the kernel's file alone."""
    from cupy_backends.cuda.libs import nvrtc
    name, dims = "gemv_int4", config.load().model("tiny")

    def build(src):
        prog = nvrtc.createProgram(src, f"{name}.cu", [], [])
        try:
            nvrtc.compileProgram(prog, list(cuda_build.compile_options(dims, arch=cuda_build.kernel_arch(name), name=name)))
            return nvrtc.getCUBIN(prog)
        finally:
            nvrtc.destroyProgram(prog)
    assert build(cuda_build.module_source(name)) == build(cuda_build.kernel_source(name))


def test_a_compile_without_its_ptxas_report_is_logged_by_a_new_process(monkeypatch):
    """The H200's NVRTC 13.0 answered a repeated compile in one process with an empty log.
    compile_cubin then takes the log of the same program compiled in a new process; a log
    that stays empty is an error, never an empty report."""
    from cupy_backends.cuda.libs import nvrtc
    dims = config.load().model("tiny")
    monkeypatch.setattr(nvrtc, "getProgramLog", lambda prog: "")      # this process only
    cubin, log = cuda_build.compile_cubin("paged_attention", dims)
    assert "Compiling entry function 'paged_attention_split'" in log and "Used" in log
    assert cubin[:4] == b"\x7fELF"

    monkeypatch.setattr(cuda_build, "_log_from_a_new_process", lambda *a: "")
    with pytest.raises(RuntimeError, match=r"kernels/paged_attention\.cu: NVRTC compiled it but returned no ptxas report"):
        cuda_build.compile_cubin("paged_attention", dims)


def test_wgmma_headers_are_their_generators_output():
    """kernels/wgmma_ops.cuh and wgmma_rs_ops.cuh are committed exactly as tools/gen_wgmma_ops.py
    renders them (one source for every wgmma wrapper)."""
    import importlib.util
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("gen_wgmma_ops", root / "tools" / "gen_wgmma_ops.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    rendered = gen.render()
    assert {p.name for p in rendered} == {"wgmma_ops.cuh", "wgmma_rs_ops.cuh"}
    for path, text in rendered.items():
        assert path.read_text() == text, f"stale kernels/{path.name}: run python3 tools/gen_wgmma_ops.py"
        assert text.startswith(f"// {path.name}: GENERATED by tools/gen_wgmma_ops.py")
