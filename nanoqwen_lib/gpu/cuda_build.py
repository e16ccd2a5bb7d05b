"""Compiling the kernels: one set of options, two paths.

* `compile_cubin` runs NVRTC directly (cupy_backends.cuda.libs.nvrtc). It needs no GPU, so
  CI compiles every kernel and variant for sm_90 with exactly the runtime's options and
  reads the register / spill report from the CUBIN.
* `load_module` gives a cupy.RawModule (GPU only) built from the same source and options
  (module_source: the kernel's file with its headers' digests, so CuPy's cache sees a header edit).

Constants reach the kernels as -D defines from nanoqwen.yaml (config.cuda_defines), each
kernel the ones its source reads (names_used) plus its planner's (planned_defines); the
`static_assert`s in kernels/common.cuh guard the invariants at compile time.
"""
from __future__ import annotations

import functools
import os
import site
import struct
from pathlib import Path

from nanoqwen_lib.config import ModelDims, cuda_defines

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
ARCH = "sm_90"


def _cuda_include_dirs() -> list[str]:
    """Headers NVRTC needs: cuda_fp16.h (nvidia/cu13/include from cupy's [ctk] extra, or a
    CUDA toolkit) and the libcu++ CuPy bundles."""
    dirs = []
    roots = list(site.getsitepackages()) + [site.getusersitepackages()]
    for root in roots:
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cu12/include"):
            p = Path(root) / sub
            if (p / "cuda_fp16.h").exists():
                dirs.append(str(p))
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            p = Path(os.environ[env]) / "include"
            if (p / "cuda_fp16.h").exists():
                dirs.append(str(p))
    if Path("/usr/local/cuda/include/cuda_fp16.h").exists():
        dirs.append("/usr/local/cuda/include")
    try:
        import cupy
        cccl = Path(cupy.__file__).parent / "_core/include/cupy/_cccl/libcudacxx"
        if cccl.exists():
            dirs.append(str(cccl))
    except ImportError:
        pass
    return list(dict.fromkeys(dirs))


def header_line(name: str, tag: str, lines: int = 60) -> str | None:
    """What follows `// <tag>:` on its line among the first `lines` of kernels/<name>.cu
    (None: no such line, or no such file)."""
    path = KERNEL_DIR / f"{name}.cu"
    if not path.exists():
        return None
    for line in path.read_text().splitlines()[:lines]:
        stripped = line.strip()
        if stripped.startswith(f"// {tag}:"):
            return stripped.split(":", 1)[1].strip()
    return None


def kernel_variants(name: str) -> list[dict]:
    """The extra-define sets named on kernels/<name>.cu's `// nq-variants: A=1[,B=2]; C=3` line
    (none without one): the lab builds CI compiles beside the default, and tools/sass_diff.py
    --variants compares."""
    import re
    for line in kernel_source(name).splitlines():
        m = re.match(r"\s*//\s*nq-variants:(.*)$", line)
        if m:
            out = []
            for item in m.group(1).split(";"):
                pairs = [p.strip() for p in item.split(",") if p.strip()]
                if pairs:
                    out.append(dict(p.split("=", 1) for p in pairs))
            return out
    return []


def kernel_arch(name: str) -> str:
    """The target of kernels/<name>.cu: ARCH, or what its `// nq-arch: sm_90a` line names
    (wgmma and setmaxnreg exist only on the architecture-specific sm_90a target)."""
    return header_line(name, "nq-arch", 20) or ARCH


def kernel_files(name: str) -> list[Path]:
    """kernels/<name>.cu and every kernels/ header it includes, directly or not, in the order found."""
    import re
    seen, todo = [], [KERNEL_DIR / f"{name}.cu"]
    while todo:
        path = todo.pop()
        if path in seen or not path.exists():
            continue
        seen.append(path)
        for inc in re.findall(r'#include\s+"([^"]+)"', path.read_text()):
            todo += [path.parent / inc, KERNEL_DIR / inc]
    return seen


@functools.lru_cache(maxsize=None)
def names_used(name: str) -> frozenset:
    """The NQ_* names kernels/<name>.cu and the kernels/ headers it includes mention: the
    defines it is compiled with (another kernel's knobs are not its options, so changing them
    rebuilds only the kernels that read them)."""
    import re
    return frozenset(n for path in kernel_files(name) for n in re.findall(r"\bNQ_[A-Z0-9_]+\b", path.read_text()))


def compile_options(dims: ModelDims | None = None, extra_defines: dict | None = None,
                    include_cuda: bool = True, arch: str = ARCH, name: str | None = None) -> tuple[str, ...]:
    """The exact NVRTC options of the runtime (CPU check and GPU load share them). With the
    kernel's name, only the defines it reads (names_used) besides the extra ones asked for."""
    defines = dict(cuda_defines(dims))
    if name is not None:
        used = names_used(name)
        defines = {k: v for k, v in defines.items() if k in used}
    defines.update(extra_defines or {})
    opts = [f"--gpu-architecture={arch}", "--std=c++17", f"-I{KERNEL_DIR}"]
    if include_cuda:
        opts += [f"-I{d}" for d in _cuda_include_dirs()]
    opts += [f"-D{k}={v}" for k, v in sorted(defines.items())]
    return tuple(opts)


def kernel_source(name: str) -> str:
    """kernels/<name>.cu with common.cuh resolved by the -I path."""
    return (KERNEL_DIR / f"{name}.cu").read_text()


def module_source(name: str) -> str:
    """What both compile paths hand NVRTC: kernel_source plus, after its last line, a comment
    naming the SHA-256 of every kernels/ header it includes. CuPy's kernel cache keys a module
    by its source text and options, not by the headers NVRTC opens, so without this an edited
    header would reuse the CUBIN built before the edit. A comment changes no instruction, and
    at the end it moves no line number."""
    import hashlib
    heads = [p for p in kernel_files(name) if p.suffix != ".cu"]
    key = " ".join(f"{p.name}={hashlib.sha256(p.read_bytes()).hexdigest()[:16]}" for p in heads)
    src = kernel_source(name)
    return src + ("" if src.endswith("\n") else "\n") + f"// nanoqwen headers: {key or 'none'}\n"


def planned_defines(name: str, dims: ModelDims | None, extra: dict | None = None) -> dict:
    """The constants of kernels/<name>.cu that a planner computes for this machine rather than
    nanoqwen.yaml fixes: the persistent step's split of each GEMV (gpu.persistent, for
    hardware().sms CTAs, planned for the build's own knobs in `extra`, as the engine plans it);
    and a lab kernel's build from its `// nq-build:` line (kernel_build). Only that kernel gets
    them; an extra define overrides them."""
    if name == "decode_persistent" and dims is not None:
        from nanoqwen_lib.gpu.persistent import persistent_plan
        return persistent_plan(dims, defines={k: int(v) for k, v in (extra or {}).items()})
    return kernel_build(name)


def kernel_build(name: str) -> dict:
    """The build a lab kernel names on its `// nq-build: NAME=INT ...` line ({} if none): for an
    experiment whose knobs nanoqwen.yaml does not hold. The kernel gets them as -D, its
    launcher reads the same line (one source)."""
    out = {}
    for item in (header_line(name, "nq-build") or "").split():
        key, _, value = item.partition("=")
        if not key.startswith("NQ_") or not value.lstrip("-").isdigit():
            raise ValueError(f"kernels/{name}.cu: nq-build: expected NQ_NAME=integer items, found {item!r}")
        out[key] = int(value)
    return out


def compile_cubin(name: str, dims: ModelDims | None = None, extra_defines: dict | None = None,
                  name_expressions: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """Compile kernels/<name>.cu for its target (sm_90, or its nq-arch line) through NVRTC
    without a GPU. Returns (cubin, log), the log with ptxas's -v report of every entry."""
    extra_defines = {**planned_defines(name, dims, extra_defines), **(extra_defines or {})}
    opts = compile_options(dims, extra_defines, arch=kernel_arch(name), name=name) + ("-Xptxas=-v",)
    src = module_source(name)
    cubin, log = _nvrtc_cubin(name, src, opts, name_expressions)
    if "Compiling entry" not in log:
        # Seen on the H200 with NVRTC 13.0: the first compile of a program in a process logs
        # ptxas's -v report; a repeat of it in the same process (even with a comment added)
        # returns the same CUBIN and an empty log. A new process compiles it afresh.
        log = _log_from_a_new_process(name, src, opts, name_expressions)
        if "Compiling entry" not in log:
            raise RuntimeError(f"kernels/{name}.cu: NVRTC compiled it but returned no ptxas report "
                               f"(-Xptxas=-v), even in a new process; its log: {log[:400]!r}")
    return cubin, log


def _log_from_a_new_process(name: str, src: str, opts: tuple, name_expressions: tuple) -> str:
    """The NVRTC log of the same program compiled in a child Python process."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; from nanoqwen_lib.gpu.cuda_build import _nvrtc_cubin; "
            "a = json.load(sys.stdin); sys.stdout.write(_nvrtc_cubin(a[0], a[1], tuple(a[2]), tuple(a[3]))[1])")
    import site
    import tempfile

    # The repeat's empty log held in a new process too (H200, NVRTC 13.0): the compiled
    # program outlives the process, and the files a compile wrote there were the CUDA JIT cache
    # (~/.nv/ComputeCache). The child gets that cache off, and a home, caches and temporary
    # folder of its own (its user site-packages kept); so it logged every time on the H200.
    with tempfile.TemporaryDirectory(prefix="nanoqwen-nvrtc-") as home:
        env = {**os.environ, "HOME": home, "XDG_CACHE_HOME": home, "TMPDIR": home, "CUDA_CACHE_DISABLE": "1",
               "CUDA_CACHE_PATH": home, "PYTHONUSERBASE": site.getuserbase(),
               "PYTHONPATH": os.pathsep.join([str(KERNEL_DIR.parent), os.environ.get("PYTHONPATH", "")])}
        p = subprocess.run([sys.executable, "-c", code], input=json.dumps([name, src, list(opts), list(name_expressions)]),
                           capture_output=True, text=True, env=env, timeout=900)
    if p.returncode:
        raise RuntimeError(f"kernels/{name}.cu: the compile in a new process failed:\n{p.stderr[-2000:]}")
    return p.stdout


def _nvrtc_cubin(name: str, src: str, opts: tuple, name_expressions: tuple) -> tuple[bytes, str]:
    """One NVRTC program: compiled, its CUBIN and log read, destroyed."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(src, f"{name}.cu", [], [])
    try:
        for expr in name_expressions:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, list(opts))
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"kernels/{name}.cu failed to compile for {ARCH}:\n{log}") from e
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def _whole_elf(cubin: bytes) -> bytes:
    """NVRTC's CUBIN as CuPy returns it can miss trailing bytes of the ELF (its tables end
    past the buffer); pad it to the length the ELF header implies, for nvdisasm."""
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    need = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return cubin + b"\0" * max(0, need - len(cubin))


def elf_constant(cubin: bytes, symbol: str, index: int = 0) -> int:
    """The int32 value of an initialized `extern "C" __device__ const int` in a CUBIN (its
    symbol's bytes in .nv.global.init), or element `index` of such an array (or struct of
    ints), read without a GPU; a KeyError names a missing one."""
    elf = _whole_elf(cubin)
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    for sh_type, off, size, link in ((s[1], s[4], s[5], s[6]) for s in secs):
        if sh_type != 2:                                # SHT_SYMTAB
            continue
        names = secs[link][4]
        for j in range(size // 24):                     # Elf64_Sym
            st_name, _, _, shndx, value, nbytes = struct.unpack_from("<IBBHQQ", elf, off + 24 * j)
            end = elf.index(b"\0", names + st_name)
            if elf[names + st_name:end].decode() == symbol and nbytes >= 4 * (index + 1) and shndx < len(secs):
                return struct.unpack_from("<i", elf, secs[shndx][4] + value + 4 * index)[0]
    raise KeyError(f"{symbol}: no initialized symbol of that name with int32 [{index}] in the CUBIN")


def nvdisasm_path() -> str | None:
    """nvdisasm: $NVDISASM, PATH, the PyPI wheel `nvidia-cuda-nvdisasm` (the cuda13 extra
    installs it), or a CUDA toolkit."""
    import shutil
    if os.environ.get("NVDISASM"):
        return os.environ["NVDISASM"]
    if shutil.which("nvdisasm"):
        return shutil.which("nvdisasm")
    for root in list(site.getsitepackages()) + [site.getusersitepackages()]:
        for sub in ("nvidia/cu13/bin/nvdisasm", "nvidia/cu12/bin/nvdisasm"):
            if (Path(root) / sub).exists():
                return str(Path(root) / sub)
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env) and (Path(os.environ[env]) / "bin/nvdisasm").exists():
            return str(Path(os.environ[env]) / "bin/nvdisasm")
    return None


def sass(name: str, dims: ModelDims | None = None, extra_defines: dict | None = None) -> str:
    """The SASS of kernels/<name>.cu as the runtime builds it for sm_90 (NVRTC, no GPU),
    disassembled by nvdisasm."""
    import subprocess
    import tempfile
    tool = nvdisasm_path()
    if tool is None:
        raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (or set NVDISASM)")
    cubin, _ = compile_cubin(name, dims, extra_defines)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(_whole_elf(cubin))
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout


def sass_code(sass_text: str, kernel: str) -> tuple[list[str], dict[str, int]]:
    """One kernel's instructions in `sass` text, whole (operands kept, predicates dropped), in
    program order, and each label's position among them."""
    import re
    start = sass_text.index(f".text.{kernel}:")
    end = sass_text.find("//----", start)
    instrs, labels = [], {}
    for line in sass_text[start:end if end > 0 else None].splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(instrs)
        elif m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
            instrs.append(re.sub(r"^@!?U?P\w+\s+", "", m.group(1).strip()))
    return instrs, labels


def sass_loop_spans(instrs: list[str], labels: dict[str, int]) -> list[tuple[int, int]]:
    """The loops of `sass_code`'s instructions: (first, last) index of each span that ends in a
    backward branch to a label, in program order."""
    import re
    out = []
    for i, ins in enumerate(instrs):
        m = re.search(r"BRA\s.*?(\.L_x_\d+)", ins)
        if m and labels.get(m.group(1), i + 1) <= i:
            out.append((labels[m.group(1)], i))
    return out


def sass_loops(sass_text: str, kernel: str) -> list[list[str]]:
    """The loops of one kernel in `sass` text (a backward branch to a label), each as its
    list of opcodes with their modifiers (predicates dropped), in program order."""
    instrs, labels = sass_code(sass_text, kernel)
    return [[x.split()[0] for x in instrs[a:b + 1]] for a, b in sass_loop_spans(instrs, labels)]


# What a hot loop spends its issue slots on, in classes that every toolkit's SASS has (the
# opcodes themselves, and how ptxas mixes them, change between NVRTC versions).
SASS_CLASSES = (
    ("tensor core", ("HMMA", "HGMMA", "QGMMA", "IMMA", "WARPGROUP")),
    ("FP8/FP16 conversion", ("F2FP", "F2F", "I2F", "HADD2.F32")),
    ("FP32 math", ("FFMA", "FADD", "FMUL", "FMNMX")),
    ("FP16 math", ("HFMA2", "HADD2", "HMUL2")),
    ("global loads", ("LDG", "LDGSTS", "UBLKCP", "UTMALDG")),
    ("shared and constant loads", ("LDS", "LDSM", "LDC", "ULDC")),
    ("stores", ("STS", "STG", "ST", "STSM", "RED", "ATOM", "ATOMS")),
    ("integer and bits", ("IMAD", "IADD3", "LOP3", "SHF", "PRMT", "LEA", "ISETP", "SEL", "MOV", "CS2R", "UIADD3",
                          "UMOV", "ULEA", "ULOP3", "USHF", "UISETP")),
    ("barriers and branches", ("BAR", "SYNCS", "BRA", "DEPBAR", "WARPSYNC", "BSSY", "BSYNC")),
)


def sass_classes(ops) -> dict[str, int]:
    """Opcodes (a loop from `sass_loops`, or a Counter of them) -> count per SASS_CLASSES class,
    every class present, in order, plus "other". An opcode belongs to the first class that
    names it or a prefix of it ending at a dot (`HADD2.F32` is the FP16->FP32 conversion, named
    before FP16 math's `HADD2`)."""
    import collections
    out = {name: 0 for name, _ in SASS_CLASSES} | {"other": 0}
    for op, n in collections.Counter(ops).items():
        for name, members in SASS_CLASSES:
            if any(op == m or op.startswith(m + ".") for m in members):
                out[name] += n
                break
        else:
            out["other"] += n
    return out


def resource_report(log: str) -> list[str]:
    """The ptxas lines of an NVRTC log: registers, shared memory, stack frame, spills."""
    return [ln.strip() for ln in log.splitlines()
            if "registers" in ln or "spill" in ln or "Compiling entry" in ln or "stack frame" in ln]


@functools.lru_cache(maxsize=None)
def _load_module_cached(name: str, dims: ModelDims | None, extra: tuple) -> "object":
    from nanoqwen_lib.gpu.hardware import require_hopper
    require_hopper(f"kernels/{name}.cu")        # before CuPy hands another GPU's -arch to NVRTC
    import cupy

    opts = compile_options(dims, dict(extra), include_cuda=True, arch=kernel_arch(name), name=name)
    return cupy.RawModule(code=module_source(name), options=opts, backend="nvrtc")


def load_module(name: str, dims: ModelDims | None = None, extra_defines: dict | None = None):
    """cupy.RawModule for kernels/<name>.cu with the runtime's options (needs a Hopper GPU:
    anything else is refused in one line, gpu.hardware.require_hopper)."""
    extra = {**planned_defines(name, dims, extra_defines), **(extra_defines or {})}
    return _load_module_cached(name, dims, tuple(sorted(extra.items())))


def have_gpu() -> bool:
    """True when this machine's GPU can run the kernels (gpu.hardware.gpu_status: CuPy imports,
    talks to the driver, and device 0 is Hopper sm_90). The chapters take their GPU path and
    the GPU tests run only then; gpu_status().reason says why not."""
    from nanoqwen_lib.gpu.hardware import gpu_status
    return gpu_status().usable
