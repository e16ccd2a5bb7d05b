"""llama.cpp on our synthetic checkpoint: built, converted, quantized, timed and checked.

The recipe (every step llama.cpp's own tools; llama.cpp's code never enters this repo):

  pack     (on a machine with network, once) the PyPI source distribution of
           llama-cpp-python (it vendors llama.cpp and its Python bindings) -> a smaller
           tarball without docs/models/tests/media, under the 64 MiB a device call carries:
           `pip download --no-deps --no-binary llama-cpp-python llama-cpp-python -d .peers`
           `python3 tools/llama_cpp_bench.py pack .peers/llama_cpp_python-*.tar.gz`
  run      unpack; build llama.cpp with cmake/ninja (CUDA sm_90 with --cuda, else the CPU),
           only the targets used: llama-quantize, llama-bench and libllama (for the Python
           bindings); synthesize our checkpoint (synthetic.cache); convert it with llama.cpp's
           convert_hf_to_gguf.py (f16) and quantize it to Q4_K_M and Q4_0 with llama-quantize;
           time pp<prompt_tokens>/tg<gen_tokens> with llama-bench (-ngl 99, flash attention
           off and on, 5 repetitions); check each quantization's tokens (the faster flash
           attention setting's) against our reference model run on the same quantized
           weights (dequantized to F16 by llama-quantize itself, read with llama.cpp's
           gguf-py; measure/peer_check.py judges); write one JSON.

Token agreement: llama.cpp's Q4_K_M is not our INT4 (other groups, other scales, Q6_K
for some tensors), so the reference it must agree with is our reference model
(model.reference.ReferenceModel) given llama.cpp's own dequantized weights (rounded to
fp16, the reference's weight precision). llama.cpp runs through llama-cpp-python's bindings
on the library built here (LLAMA_CPP_LIB_PATH), one token per llama_decode: the decode path
that tg128 times.

On the device (kind nvidia-h200), as run for the scoreboard (book/data/llama-cpp.json):
the CUDA build is made on a CPU machine with nvcc (no GPU needed; ~40 min on 2 cores), so that
no device minute goes to compiling, and carried with a source pack that holds only the
converter and the bindings (the carry limit is 64 MiB):
  here  python3 tools/llama_cpp_bench.py run --cuda --portable --model tiny --work /tmp/llbuild
            --steps build --jobs 2 --pack-build .peers/llama-cpp-build-sm90.tar.xz
        python3 tools/llama_cpp_bench.py pack .peers/llama_cpp_python-*.tar.gz --runtime-only
            --out .peers/llama-cpp-runtime.tar.gz
  (--portable: no -march=native, libraries found by $ORIGIN, and GGML_CUDA_NO_VMM, since a
  machine without a driver has no libcuda to link; the JSON's build entry records it.)
  device, carry [".whl", ".peers/llama-cpp-build-sm90.tar.xz", ".peers/llama-cpp-runtime.tar.gz"]
  (.whl trimmed of what the image already has, to fit): `tools/device_run.sh llama-prep-bg`
  (synthesize, convert, quantize in the background, while the GPU suite runs), `llama-wait`,
  then in the next call on the same warm machine `llama-timed` (llama-bench + the token
  check, alone on the GPU) and `bench-peers`, which adds its rows to nanoqwen's scoreboard.
Building on the device instead (~5-6 min on 16 cores) is `--steps build,convert` there.

On the CPU (proven here with the tiny model, ~15 minutes on 2 cores, most of it the build):
  python3 tools/llama_cpp_bench.py run --model tiny --work /tmp/llcpp --out /tmp/llama-cpp-tiny.json
      --prompt-tokens 64 --gen-tokens 16 --reps 2
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DROP = ("docs", "models", "media", "tests", "benches", "examples", "tools/ui", ".devops", "ci")
QUANTS = ("Q4_K_M", "Q4_0")


def log(msg: str) -> None:
    print(f"[llama.cpp] {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def sh(cmd, **kw) -> str:
    """Run a command, fail loudly with its output's tail."""
    log(" ".join(map(str, cmd))[:300])
    p = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, **kw)
    if p.returncode:
        raise RuntimeError(f"{cmd[0]} exited {p.returncode}:\n{(p.stdout + p.stderr)[-4000:]}")
    return p.stdout


# ---------------------------------------------------------------- pack
# What a prebuilt run needs of the source (pack --runtime-only): the converter and the
# bindings; the C/C++ sources stay out.
RUNTIME_KEEP = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "LICENSE")


def pack(sdist: Path, out: Path, runtime_only: bool = False) -> Path:
    """sdist -> out: vendor/llama.cpp (less DROP) as llama.cpp/, the bindings as
    llama_cpp/, and VERSION (the package version and the llama.cpp commit it vendors)."""
    name = sdist.name.removesuffix(".tar.gz")
    version = name.rsplit("-", 1)[-1]
    commit = "unknown"
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(sdist) as src, tarfile.open(tmp, "w:gz") as dst:
        for m in src.getmembers():
            rel = m.name.split("/", 1)[1] if "/" in m.name else ""
            if rel == "CHANGELOG.md":
                for line in src.extractfile(m).read().decode().splitlines():
                    if "update llama.cpp to ggml-org/llama.cpp@" in line:
                        commit = line.rsplit("@", 1)[1].strip()
                        break
            if rel.startswith("vendor/llama.cpp/"):
                inner = rel[len("vendor/llama.cpp/"):]
                if any(inner == d or inner.startswith(d + "/") for d in DROP):
                    continue
                if runtime_only and not any(inner == d or inner.startswith(d + "/") for d in RUNTIME_KEEP):
                    continue
                m.name = "llama.cpp/" + inner
            elif rel.startswith("llama_cpp/"):
                m.name = rel
            else:
                continue
            m.pax_headers.pop("path", None)      # a long name lives there and would win over m.name
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
        blob = json.dumps({"llama_cpp_python": version, "llama_cpp_commit": commit}).encode()
        info = tarfile.TarInfo("VERSION")
        info.size = len(blob)
        import io
        dst.addfile(info, io.BytesIO(blob))
    tmp.replace(out)
    log(f"{out}: {out.stat().st_size / 2**20:.1f} MiB (llama-cpp-python {version}, llama.cpp {commit})")
    return out


# ---------------------------------------------------------------- build
def cublas_hints() -> list[str]:
    """CMake cache entries pointing FindCUDAToolkit at pip's cuBLAS when the toolkit lacks it
    (the device's /usr/local/cuda may; torch's nvidia-cublas wheel is in site-packages)."""
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    site = Path(sysconfig.get_paths()["purelib"])
    # The CUDA runtime that libggml-cuda needs, for child processes and this one (a build
    # made elsewhere finds it neither by its RUNPATH nor, maybe, by the system's paths).
    cudart = sorted(glob.glob(str(cuda / "lib64" / "libcudart.so.*"))) or \
        sorted(glob.glob(str(site / "nvidia" / "**" / "libcudart.so.*"), recursive=True))
    if cudart:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([str(Path(cudart[0]).parent),
                                                         os.environ.get("LD_LIBRARY_PATH", "")])
        try:
            ctypes.CDLL(cudart[0], mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            log(f"could not preload {cudart[0]}: {e}")
    if list(cuda.glob("lib64/libcublas.so*")) or list(cuda.glob("targets/*/lib/libcublas.so*")):
        return []
    libs = {n: sorted(glob.glob(str(site / "nvidia" / "**" / f"lib{n}.so*"), recursive=True)) for n in ("cublas", "cublasLt")}
    heads = sorted(glob.glob(str(site / "nvidia" / "**" / "cublas_v2.h"), recursive=True))
    if not libs["cublas"] or not libs["cublasLt"] or not heads:
        raise RuntimeError(f"no cuBLAS in {cuda} nor under {site / 'nvidia'}: llama.cpp's CUDA backend links it")
    # Only cuBLAS's own headers: the wheel's folder also holds a CUDA runtime's headers, which
    # must not shadow those of the nvcc that compiles (CCCL refuses a version mismatch).
    inc_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "nq-cublas-include"
    inc_dir.mkdir(exist_ok=True)
    for h in Path(heads[0]).parent.glob("cublas*.h"):
        link = inc_dir / h.name
        if not link.exists():
            link.symlink_to(h)
    inc = str(inc_dir)
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(Path(libs["cublas"][0]).parent), os.environ.get("LD_LIBRARY_PATH", "")])
    log(f"cuBLAS from pip: {libs['cublas'][0]}, headers {inc}")
    for lib in (libs["cublasLt"][0], libs["cublas"][0]):    # for libggml-cuda loaded in this process
        try:                                                  # (LD_LIBRARY_PATH counts only for children)
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            log(f"could not preload {lib}: {e}")
    return [f"-DCUDA_cublas_LIBRARY={libs['cublas'][0]}", f"-DCUDA_cublasLt_LIBRARY={libs['cublasLt'][0]}",
            f"-DCMAKE_CUDA_FLAGS=-I{inc}", f"-DCMAKE_CXX_FLAGS=-I{inc}"]


def build(src: Path, build_dir: Path, cuda: bool, jobs: int, portable: bool = False) -> Path:
    """cmake + ninja, only the targets used; -> the bin directory (tools and shared libs).
    portable: no -march=native (for a build made on one machine and run on another)."""
    args = ["cmake", "-S", src, "-B", build_dir, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
            f"-DGGML_NATIVE={'OFF' if portable else 'ON'}"]
    if portable:            # the libraries find each other beside themselves wherever they are unpacked
        args.append("-DCMAKE_BUILD_RPATH=$ORIGIN")
    if cuda and portable:   # a machine without a driver has no libcuda to link: the legacy memory pool
        args.append("-DGGML_CUDA_NO_VMM=ON")
    if cuda:
        args += ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_CUDA_NCCL=OFF", *cublas_hints()]
        nvcc = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
        if not shutil.which("nvcc") and nvcc.exists():         # the toolkit off the PATH
            args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
    sh(args)
    sh(["cmake", "--build", build_dir, "-j", str(jobs), "--target", "llama-quantize", "llama-bench", "llama"])
    return build_dir / "bin"


BUILT = ("llama-quantize", "llama-bench")


def pack_build(bin_dir: Path, info: dict, out: Path) -> Path:
    """The built tools and shared libraries (stripped) in one tarball with the build's facts,
    so that a build made here runs on the device without spending its minutes on a compile."""
    out.parent.mkdir(parents=True, exist_ok=True)
    files = [bin_dir / n for n in BUILT] + sorted(p for p in bin_dir.glob("lib*.so*") if not p.is_symlink())
    for f in files:
        subprocess.run(["strip", "--strip-unneeded", str(f)], check=False)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w:xz") as t:
        for f in files:
            t.add(f, arcname=f.name)
        for link in (p for p in bin_dir.glob("lib*.so*") if p.is_symlink()):
            t.add(link, arcname=link.name)
        data = json.dumps({**info, "built_on": os.uname().nodename}).encode()
        ti = tarfile.TarInfo("build.json")
        ti.size = len(data)
        t.addfile(ti, __import__("io").BytesIO(data))
    tmp.replace(out)
    log(f"packed the build: {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return out


def unpack_build(tarball: Path, bin_dir: Path) -> dict:
    """pack_build's tarball -> bin_dir; the build's facts, marked as made elsewhere."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as t:
        t.extractall(bin_dir, filter="tar")
    info = json.loads((bin_dir / "build.json").read_text())
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([str(bin_dir), os.environ.get("LD_LIBRARY_PATH", "")])
    log(f"using the prebuilt llama.cpp from {tarball}: {info}")
    return {**info, "prebuilt": True}


# ---------------------------------------------------------------- convert, quantize, time
def convert_start(src: Path, checkpoint: Path, out: Path) -> subprocess.Popen:
    """Start convert_hf_to_gguf.py (f16) in the background: it needs no build, so it runs
    beside the compiler. convert_finish waits for it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, src / "convert_hf_to_gguf.py", checkpoint, "--outtype", "f16", "--outfile",
           out.with_name(out.name + ".tmp")]
    log(" ".join(map(str, cmd)))
    return subprocess.Popen(list(map(str, cmd)), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def convert_finish(proc: subprocess.Popen, out: Path) -> Path:
    text, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py exited {proc.returncode}:\n{text[-4000:]}")
    out.with_name(out.name + ".tmp").replace(out)
    log(f"converted {out} ({out.stat().st_size / 1e9:.2f} GB)")
    return out


def quantize(bin_dir: Path, f16: Path, kind: str, threads: int) -> Path:
    out = f16.with_name(f"model-{kind}.gguf")
    tmp = out.with_name(out.name + ".tmp")
    sh([bin_dir / "llama-quantize", f16, tmp, kind, str(threads)])
    tmp.replace(out)
    return out


def llama_bench(bin_dir: Path, gguf: Path, prompt_tokens: int, gen_tokens: int, cuda: bool, reps: int) -> list[dict]:
    """llama-bench's JSON rows: pp<prompt_tokens> and tg<gen_tokens>, flash attention 0 and 1."""
    cmd = [bin_dir / "llama-bench", "-m", gguf, "-p", prompt_tokens, "-n", gen_tokens, "-fa", "0,1",
           "-ngl", 99 if cuda else 0, "-r", reps, "-o", "json"]
    return json.loads(sh(cmd))


def summarize_bench(rows: list[dict]) -> dict:
    """-> {"fa0": {...}, "fa1": {...}}: TTFT = the prompt's time (pp), ITL = 1 / tg t/s."""
    out = {}
    for r in rows:
        key = f"fa{int(bool(r.get('flash_attn')))}"
        d = out.setdefault(key, {})
        if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0:
            d["pp_tokens_per_s"], d["ttft_ms"] = r["avg_ts"], 1e3 * r["n_prompt"] / r["avg_ts"]
        elif r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0:
            d["tg_tokens_per_s"], d["itl_ms"] = r["avg_ts"], 1e3 / r["avg_ts"]
    return out


# ---------------------------------------------------------------- agreement
GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
BLOCK_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
               "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
               "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
               "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
               "attn_v.bias": "self_attn.v_proj.bias", "ffn_gate.weight": "mlp.gate_proj.weight",
               "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}


def hf_name(gguf_name: str) -> str:
    if gguf_name in GGUF_NAMES:
        return GGUF_NAMES[gguf_name]
    blk, i, rest = gguf_name.split(".", 2)
    if blk != "blk" or rest not in BLOCK_NAMES:
        raise KeyError(gguf_name)
    return f"model.layers.{i}.{BLOCK_NAMES[rest]}"


def gguf_tensors(path: Path, src: Path) -> dict:
    """A GGUF's tensors -> HF names, fp16 (the unquantized encoding of
    layout.packed_tensors, which ReferenceModel takes). F16/F32 tensors are read as they
    are; quantized ones are dequantized by gguf-py (NumPy, one core: slow on the 7B, where
    dequantized_copy lets llama-quantize do it first)."""
    import numpy as np
    sys.path.insert(0, str(src / "gguf-py"))
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize
    out = {}
    for t in GGUFReader(str(path)).tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if t.tensor_type in (GGMLQuantizationType.F16, GGMLQuantizationType.F32):
            w = np.asarray(t.data).reshape(shape)
        else:
            w = dequantize(t.data, t.tensor_type).reshape(shape)
        out[hf_name(t.name)] = np.ascontiguousarray(w, dtype=np.float16)
    return out


def dequantized_copy(bin_dir: Path, gguf: Path, threads: int) -> Path:
    """llama.cpp's own dequantization of every tensor to F16 (llama-quantize
    --allow-requantize ... F16, all cores): the same values as gguf-py's (checked on tiny,
    bit for bit), in seconds instead of minutes on the 7B."""
    out = gguf.with_name(gguf.stem + "-dequantized-f16.gguf")
    tmp = out.with_name(out.name + ".tmp")
    sh([bin_dir / "llama-quantize", "--allow-requantize", gguf, tmp, "F16", str(threads)])
    tmp.replace(out)
    return out


class LlamaCppPeer:
    """llama.cpp through llama-cpp-python's bindings: prefill(ids) -> last logits;
    step(token) -> the next position's logits (one llama_decode of one token)."""

    def __init__(self, gguf: Path, n_ctx: int, cuda: bool, flash_attn: bool):
        import llama_cpp
        self.lc = llama_cpp
        self.llm = llama_cpp.Llama(str(gguf), n_gpu_layers=-1 if cuda else 0, n_ctx=n_ctx, n_batch=512,
                                   flash_attn=flash_attn, verbose=False, seed=0)
        self.n_vocab = self.llm.n_vocab()

    def _logits(self):
        import numpy as np
        p = self.lc.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(p, shape=(self.n_vocab,)).copy()

    def prefill(self, ids):
        self.llm.reset()
        self.llm.eval(list(ids))
        return self._logits()

    def step(self, token):
        self.llm.eval([int(token)])
        return self._logits()


def agreement(gguf: Path, src: Path, bin_dir: Path, dims, cuda: bool, flash_attn: bool, threads: int) -> dict:
    """measure.peer_check on llama.cpp against our reference on the GGUF's own weights."""
    from nanoqwen_lib.config import load
    from nanoqwen_lib.measure.peer_check import check_peer, summary
    from nanoqwen_lib.measure.validate import validation_prompts
    from nanoqwen_lib.model.reference import ReferenceModel
    v = load().validation
    xp = __import__("cupy") if cuda else __import__("numpy")
    deq = dequantized_copy(bin_dir, gguf, threads)
    reference = ReferenceModel(dims, gguf_tensors(deq, src), xp=xp)
    deq.unlink()
    prompts = validation_prompts(v.peer_prompts)
    peer = LlamaCppPeer(gguf, max(map(len, prompts)) + v.peer_gen_tokens + 8, cuda, flash_attn)
    r = check_peer(peer, reference, dims, prompts, v.peer_gen_tokens, xp)
    log(f"{gguf.name} fa{int(flash_attn)}: {summary(r)}")
    del peer, reference
    return r


# ---------------------------------------------------------------- run
STEPS = ("build", "convert", "quantize", "bench", "check")


def write_json(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    tmp.replace(path)


def run(a) -> dict | None:
    """The steps named in a.steps, in order; each leaves its result in a.work, and a later
    call (another device command on the same warm machine) goes on from there. After the
    last step, the JSON a.out gathers all of them."""
    from nanoqwen_lib.config import load
    from nanoqwen_lib.measure.bench import git_commit
    from nanoqwen_lib.synthetic.cache import synthetic_checkpoint
    from nanoqwen_lib.synthetic.checkpoint import synthesize_dims
    steps = [x for x in a.steps.split(",") if x]
    if any(x not in STEPS for x in steps):
        raise SystemExit(f"--steps: a subset of {','.join(STEPS)}, got {a.steps!r}")
    proto = load().benchmark
    pp, tg = a.prompt_tokens or proto.prompt_tokens, a.gen_tokens or proto.gen_tokens
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    src_root = work / "src"
    if not (src_root / "VERSION").exists():
        with tarfile.open(a.src) as t:
            t.extractall(src_root, filter="tar")
    src, bin_dir = src_root / "llama.cpp", work / ("build-cuda" if a.cuda else "build-cpu") / "bin"
    state_path = work / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    dims, f16 = synthesize_dims(a.model), work / "model-f16.gguf"
    converting = convert_start(src, synthetic_checkpoint(a.model, progress=False), f16) if "convert" in steps else None
    if "build" in steps:
        t0 = time.time()
        try:
            build(src, bin_dir.parent, a.cuda, a.jobs, a.portable)
        except BaseException:
            if converting is not None:
                converting.kill()
            raise
        state["build"] = {"cuda": a.cuda, "arch": "sm_90" if a.cuda else "cpu", "seconds": round(time.time() - t0, 1),
                          "portable": a.portable, "vmm_pool": not (a.cuda and a.portable)}
        if a.pack_build:
            pack_build(bin_dir, state["build"], Path(a.pack_build))
    elif a.prebuilt and not bin_dir.exists():
        state["build"] = unpack_build(Path(a.prebuilt), bin_dir)
        if a.cuda:
            cublas_hints()
    elif a.cuda:
        cublas_hints()                                       # LD_LIBRARY_PATH for pip's cuBLAS, if used
    os.environ["LLAMA_CPP_LIB_PATH"] = str(bin_dir)
    sys.path.insert(0, str(src_root))                        # the llama_cpp bindings
    if converting is not None:
        convert_finish(converting, f16)
    for kind in QUANTS:
        entry = state.setdefault("quants", {}).setdefault(kind, {})
        q = f16.with_name(f"model-{kind}.gguf")
        if "quantize" in steps:
            quantize(bin_dir, f16, kind, a.jobs)
            entry["file_bytes"] = q.stat().st_size
        if "bench" in steps:
            rows = llama_bench(bin_dir, q, pp, tg, a.cuda, a.reps)
            entry.update(bench=summarize_bench(rows), llama_bench_rows=rows)
            log(f"{kind}: {json.dumps(entry['bench'])}")
        if "check" in steps:
            # the setting the row reports (the faster one, peers.llama_cpp_rows) is the one checked
            best = min(entry["bench"], key=lambda k: entry["bench"][k].get("itl_ms", float("inf")))
            try:
                entry["agreement"] = {best: agreement(q, src, bin_dir, dims, a.cuda, best == "fa1", a.jobs)}
            except Exception as e:  # reported, not hidden: the peer is then not judged correct
                entry["agreement"] = {"error": f"{type(e).__name__}: {e}"[:800]}
                log(f"{kind}: agreement could not run: {entry['agreement']['error']}")
        write_json(state, state_path)
    if "quantize" in steps and a.drop_f16:
        f16.unlink()                                         # 15 GB on the 7B; the quantized files stay
    version = json.loads((src_root / "VERSION").read_text())
    rows = state.get("quants", {}).get(QUANTS[0], {}).get("llama_bench_rows") or [{}]
    if rows[0].get("build_commit") not in (None, "unknown"):   # a source tarball has no git: VERSION's commit
        version.update(build_commit=rows[0]["build_commit"], build_number=rows[0].get("build_number"))
    result = {"peer": "llama.cpp", "version": version, "build": state.get("build"), "model": a.model,
              "protocol": {"prompt_tokens": pp, "gen_tokens": tg, "repetitions": a.reps, "ngl": 99 if a.cuda else 0},
              "quants": state.get("quants", {}), "git_commit": git_commit(),
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_json(result, Path(a.out))
    log(f"wrote {a.out} (steps {','.join(steps)})")
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="repack llama-cpp-python's sdist to fit a device carry")
    p.add_argument("sdist", type=Path)
    p.add_argument("--out", type=Path, default=ROOT / ".peers" / "llama-cpp-src.tar.gz")
    p.add_argument("--runtime-only", action="store_true",
                   help="only the converter and the bindings (for a run with --prebuilt)")
    r = sub.add_parser("run", help="build, convert, quantize, time and check llama.cpp")
    r.add_argument("--src", default=str(ROOT / ".peers" / "llama-cpp-src.tar.gz"))
    r.add_argument("--model", default="tiny")
    r.add_argument("--work", default="/tmp/llcpp")
    r.add_argument("--out", default="llama-cpp.json")
    r.add_argument("--cuda", action="store_true")
    r.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    r.add_argument("--reps", type=int, default=5)
    r.add_argument("--prompt-tokens", type=int, default=0)
    r.add_argument("--gen-tokens", type=int, default=0)
    r.add_argument("--steps", default=",".join(STEPS), help=f"a subset of {','.join(STEPS)} (default: all)")
    r.add_argument("--portable", action="store_true", help="build without -march=native")
    r.add_argument("--pack-build", default="", help="after the build step, pack the tools and libraries here")
    r.add_argument("--prebuilt", default="", help="a --pack-build tarball to use instead of building")
    r.add_argument("--drop-f16", action="store_true", help="remove the f16 GGUF once both quantizations exist")
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        pack(a.sdist, a.out, a.runtime_only)
    else:
        run(a)


if __name__ == "__main__":
    main()
