"""llama.cpp's token and prompt, kernel by kernel: ncu over llama-bench, one token's launches.

`tools/llama_cpp_bench.py` times llama.cpp (pp512 / tg128); this says where that time goes.
Each quantization's GGUF (from llama_cpp_bench.py's convert and quantize steps) runs under
Nsight Compute (`ncu --clock-control none`, one metric: gpu__time_duration.sum) twice for
decode, `llama-bench -p 0 -n 2` and `-n 6`, and twice for the prompt, `-p 512 -n 0 -r 1` and
`-r 2`. The difference of two runs is 4 tokens (or one prompt) of steady-state work: the
warm-up, the model's upload and anything else each run does once cancel. Per token that gives
the number of kernel launches and their summed GPU time by kernel, against llama-bench's
own ITL and TTFT (the record book/data/llama-cpp.json, same build).

ncu serializes the kernels and profiles each alone (a CUDA graph's nodes one by one), so the
summed durations are the GPU's busy time without overlap; the ITL's remainder is what
happens between kernels (launch gaps, each kernel's ramp and tail not covered by the next).

  device  python3 tools/llama_cpp_profile.py run --work .peers/work --raw $OUT/llama-profile-raw
          (after llama_cpp_bench.py run --steps convert,quantize on the same machine)
  here    python3 tools/llama_cpp_profile.py summarize RAW_DIR --out book/data/llama-cpp-profile.json

Not yet run on the H200: records.MEASURES gets its entry for llama-cpp-profile.json
(tools/llama_cpp_bench.py, tools/llama_cpp_profile.py) with the first record, since every
name there must have its record (tests/test_records.py).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

METRIC = "gpu__time_duration.sum"
QUANTS = ("Q4_K_M", "Q4_0")
# name: llama-bench's arguments for the short and the long run, and what their difference is
RUNS = {
    "decode": ((["-p", "0", "-n", "2", "-r", "1"], ["-p", "0", "-n", "6", "-r", "1"]), 4, "token"),
    "prefill": ((["-p", "512", "-n", "0", "-r", "1"], ["-p", "512", "-n", "0", "-r", "2"]), 1, "prompt of 512 tokens"),
}
UNIT_NS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9, "s": 1e9}
TOP = 12          # kernels listed by name; the rest are summed as "other"


def log(msg: str) -> None:
    print(f"[llama.cpp profile] {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def base_name(kernel: str) -> str:
    """A kernel's function name without its template arguments and parameters."""
    name = kernel.split("(")[0].split("<")[0].strip()
    return name.split("::")[-1] or kernel


def parse_raw_csv(text: str, source: str = "<csv>") -> list[tuple[str, float]]:
    """ncu --csv --page raw --print-units base: [(kernel base name, duration in ns)] in launch
    order. The second row holds the units; a missing column is an error naming the file."""
    rows = [r for r in csv.reader(io.StringIO(text)) if r]
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r and METRIC in r), None)
    if start is None:
        raise ValueError(f"{source}: no header with 'Kernel Name' and '{METRIC}' (ncu's raw page)")
    head = rows[start]
    k, m = head.index("Kernel Name"), head.index(METRIC)
    first, scale = start + 1, 1.0
    if first < len(rows) and len(rows[first]) > m and rows[first][m] in UNIT_NS:   # the units row
        scale, first = UNIT_NS[rows[first][m]], first + 1
    out = []
    for i in range(first, len(rows)):
        r = rows[i]
        try:
            out.append((base_name(r[k]), float(r[m].replace(",", "")) * scale))
        except (IndexError, ValueError) as e:
            raise ValueError(f"{source}: row {i + 1}: expected a kernel name and a duration, found {r[:3]}...") from e
    return out


def per_unit(short: list[tuple[str, float]], long: list[tuple[str, float]], units: int) -> dict:
    """The long run minus the short one, per unit (token or prompt): launches and GPU time
    by kernel name. A kernel that launches a non-integral number of times per unit is kept
    as measured (the difference says it is not steady state)."""
    def tally(launches):
        t = {}
        for name, ns in launches:
            n, s = t.get(name, (0, 0.0))
            t[name] = (n + 1, s + ns)
        return t
    a, b = tally(short), tally(long)
    rows = []
    for name in sorted(set(a) | set(b)):
        n = (b.get(name, (0, 0.0))[0] - a.get(name, (0, 0.0))[0]) / units
        us = (b.get(name, (0, 0.0))[1] - a.get(name, (0, 0.0))[1]) / units / 1e3
        if n or abs(us) > 1e-3:
            rows.append({"kernel": name, "launches": round(n, 3), "us": round(us, 3)})
    rows.sort(key=lambda r: -r["us"])
    top, rest = rows[:TOP], rows[TOP:]
    if rest:
        top.append({"kernel": f"other ({len(rest)} kernels)", "launches": round(sum(r["launches"] for r in rest), 3),
                    "us": round(sum(r["us"] for r in rest), 3)})
    return {"launches": round(sum(r["launches"] for r in rows), 3), "gpu_us": round(sum(r["us"] for r in rows), 3),
            "kernels": top}


def summarize(raw: Path) -> dict:
    """RAW/<quant>-<run>-<short|long>.csv (from `run`) -> the record's body."""
    out = {"quants": {}}
    meta = raw / "meta.json"
    if meta.exists():
        out.update(json.loads(meta.read_text()))
    for q in QUANTS:
        for run, (_, units, unit_name) in RUNS.items():
            files = [raw / f"{q}-{run}-{which}.csv" for which in ("short", "long")]
            if not all(f.exists() for f in files):
                continue
            short, long = (parse_raw_csv(f.read_text(), str(f)) for f in files)
            out["quants"].setdefault(q, {})[run] = {"per": unit_name, **per_unit(short, long, units)}
    if not out["quants"]:
        raise SystemExit(f"{raw}: no <quant>-<run>-<short|long>.csv pairs")
    return out


def run(a) -> None:
    """On the GPU machine: ncu over llama-bench for each quantization and run; raw CSVs out."""
    import llama_cpp_bench as lcb
    work, raw = Path(a.work), Path(a.raw)
    raw.mkdir(parents=True, exist_ok=True)
    bin_dir = work / "build-cuda" / "bin"
    if not bin_dir.exists():
        lcb.unpack_build(Path(a.prebuilt), bin_dir)
    lcb.cublas_hints()
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([str(bin_dir), os.environ.get("LD_LIBRARY_PATH", "")])
    ncu = [a.ncu, "--clock-control", "none", "--metrics", METRIC, "--print-kernel-base", "function"]
    for q in QUANTS:
        gguf = work / f"model-{q}.gguf"
        if not gguf.exists():
            log(f"{gguf}: missing (llama_cpp_bench.py --steps convert,quantize first)")
            continue
        for run_name, ((short, long), _, _) in RUNS.items():
            for which, args in (("short", short), ("long", long)):
                rep = raw / f"{q}-{run_name}-{which}"
                t0 = time.time()
                bench = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-ngl", "99", "-fa", "1", *args]
                p = subprocess.run([*ncu, "--export", str(rep), "--force-overwrite", *bench],
                                   capture_output=True, text=True, timeout=a.timeout)
                if p.returncode:
                    raise SystemExit(f"ncu {' '.join(bench)}: exit {p.returncode}\n{(p.stdout + p.stderr)[-3000:]}")
                p = subprocess.run([a.ncu, "--import", f"{rep}.ncu-rep", "--csv", "--page", "raw",
                                    "--print-units", "base", "--print-kernel-base", "function"],
                                   capture_output=True, text=True, timeout=a.timeout)
                if p.returncode:
                    raise SystemExit(f"ncu --import {rep}.ncu-rep: exit {p.returncode}\n{p.stderr[-2000:]}")
                Path(f"{rep}.csv").write_text(p.stdout)
                Path(f"{rep}.ncu-rep").unlink()
                log(f"{q} {run_name} {which}: {len(parse_raw_csv(p.stdout, str(rep)))} kernels in {time.time() - t0:.0f} s")
    version = subprocess.run([a.ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip().splitlines()
    src_version = work / "src" / "VERSION"
    meta = {"tool": "ncu --clock-control none --metrics " + METRIC, "ncu": version[-1] if version else "",
            "gpu": gpu[0] if gpu else "", "flash_attn": 1,
            "runs": {k: {"short": " ".join(v[0][0]), "long": " ".join(v[0][1]), "units": v[1]} for k, v in RUNS.items()},
            "llama_cpp": json.loads(src_version.read_text()) if src_version.exists() else {},
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (raw / "meta.json").write_text(json.dumps(meta, indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="on the GPU: ncu over llama-bench, raw CSVs")
    r.add_argument("--work", default=".peers/work")
    r.add_argument("--prebuilt", default=".peers/llama-cpp-build-sm90.tar.xz")
    r.add_argument("--raw", required=True)
    r.add_argument("--ncu", default="ncu")
    r.add_argument("--timeout", type=int, default=240)
    s = sub.add_parser("summarize", help="raw CSVs -> the record")
    s.add_argument("raw", type=Path)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--commit", default=None, help="the commit the run measured (default HEAD)")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        run(a)
    else:
        from nanoqwen_lib.measure import records
        body = summarize(a.raw)
        records.write(a.out, body, records.measures_for(a.out), commit=a.commit)
        for q, v in body["quants"].items():
            for run_name, d in v.items():
                print(f"{q} {run_name}: {d['launches']:g} launches, {d['gpu_us']:.1f} us of kernels per {d['per']}")


if __name__ == "__main__":
    main()
