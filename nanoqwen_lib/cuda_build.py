"""Compiling the kernels: one set of options, two paths.

* `compile_cubin` runs NVRTC directly (cupy_backends.cuda.libs.nvrtc). It needs no GPU, so
  CI compiles every kernel and variant for sm_90 with exactly the runtime's options and
  reads the register / spill report from the CUBIN.
* `load_module` gives a cupy.RawModule (GPU only) built from the same source and options.

Constants reach the kernels as -D defines from nanoqwen.yaml (config.cuda_defines); the
`static_assert`s in kernels/common.cuh guard the invariants at compile time.
"""
from __future__ import annotations

import functools
import os
import site
from pathlib import Path

from .config import ModelDims, cuda_defines

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
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


def compile_options(dims: ModelDims | None = None, extra_defines: dict | None = None,
                    include_cuda: bool = True) -> tuple[str, ...]:
    """The exact NVRTC options of the runtime (CPU check and GPU load share them)."""
    defines = dict(cuda_defines(dims))
    defines.update(extra_defines or {})
    opts = [f"--gpu-architecture={ARCH}", "--std=c++17", f"-I{KERNEL_DIR}"]
    if include_cuda:
        opts += [f"-I{d}" for d in _cuda_include_dirs()]
    opts += [f"-D{k}={v}" for k, v in sorted(defines.items())]
    return tuple(opts)


def kernel_source(name: str) -> str:
    """kernels/<name>.cu with common.cuh resolved by the -I path."""
    return (KERNEL_DIR / f"{name}.cu").read_text()


def compile_cubin(name: str, dims: ModelDims | None = None, extra_defines: dict | None = None,
                  name_expressions: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """Compile kernels/<name>.cu for sm_90 through NVRTC without a GPU. Returns (cubin, log)."""
    from cupy_backends.cuda.libs import nvrtc

    src = kernel_source(name)
    prog = nvrtc.createProgram(src, f"{name}.cu", [], [])
    try:
        for expr in name_expressions:
            nvrtc.addNameExpression(prog, expr)
        opts = compile_options(dims, extra_defines) + ("-Xptxas=-v",)
        try:
            nvrtc.compileProgram(prog, list(opts))
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"kernels/{name}.cu failed to compile for {ARCH}:\n{log}") from e
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def resource_report(log: str) -> list[str]:
    """The ptxas lines of an NVRTC log: registers, shared memory, stack frame, spills."""
    return [ln.strip() for ln in log.splitlines()
            if "registers" in ln or "spill" in ln or "Compiling entry" in ln or "stack frame" in ln]


@functools.lru_cache(maxsize=None)
def _load_module_cached(name: str, dims: ModelDims | None, extra: tuple) -> "object":
    import cupy

    opts = compile_options(dims, dict(extra), include_cuda=True)
    return cupy.RawModule(code=kernel_source(name), options=opts, backend="nvrtc")


def load_module(name: str, dims: ModelDims | None = None, extra_defines: dict | None = None):
    """cupy.RawModule for kernels/<name>.cu with the runtime's options (needs a GPU)."""
    return _load_module_cached(name, dims, tuple(sorted((extra_defines or {}).items())))


def have_gpu() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False
