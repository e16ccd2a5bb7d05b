"""The headline figures: the few numbers the landing page, the preface and the README quote,
all from one record, the scoreboard of chapter 11 (`book/data/scoreboard.json`, the JSON of
`nanoqwen bench --peers --breakdown`).

A page quotes a figure between two markers, which the rendered page does not show:

    <!-- headline:itl_ms -->1.77<!-- /headline --> ms

`tests/test_headlines.py` checks every marker of those pages against `figures()` of the
record, and `python3 -m nanoqwen_lib.measure.headlines --write` rewrites the markers' values
from the record after chapter 11 has rewritten it (NANOQWEN_WRITE_RECORDS=1, on a GPU).
"""
from __future__ import annotations

import re
from pathlib import Path

from nanoqwen_lib.config import load
from nanoqwen_lib.errors import NanoqwenError

REPO = Path(__file__).resolve().parents[2]
RECORD = REPO / "book" / "data" / "scoreboard.json"
PAGES = ("book/index.md", "book/preface.md", "README.md")   # the pages that quote headline figures
MARKER_RE = re.compile(r"<!-- headline:([a-z0-9_]+) -->(.*?)<!-- /headline -->", re.S)

# bench's protocol.decode for each decode step (measure.bench.benchmark_e2e)
DECODE_NAMES = {"persistent": "one persistent kernel per token (CUDA graph)", "graph": "CUDA graphs (a kernel per op)"}
OLD_GRAPH_NAME = "CUDA graphs"   # what bench wrote for the kernel-per-op step before the persistent one existed

# key -> (what it is, the peer whose ITL it divides by ours, or None)
FIGURES = {
    "itl_ms": ("our decode step's median ITL, ms (pp512 / tg128, batch 1)", None),
    "ttft_ms": ("our TTFT for the 512-token prompt, ms", None),
    "mbu": ("bytes a token must read over the ITL, over the read ceiling measured in the same run", None),
    "graph_itl_ms": ("the kernel-per-op step's median ITL in the same run, ms", None),
    "floor_ms": ("the bytes a token must read at the read ceiling measured in the same run, ms", None),
    "vs_llama_cpp_q4_k_m": ("llama.cpp Q4_K_M's ITL over ours (x faster)", "llama_cpp_Q4_K_M"),
    "vs_llama_cpp_q4_0": ("llama.cpp Q4_0's ITL over ours", "llama_cpp_Q4_0"),
    "vs_torch_int4": ("torch INT4 tinygemm's ITL over ours", "torch_int4"),
    "vs_hf_fp16_compiled": ("transformers FP16 (static cache, compiled)'s ITL over ours", "hf_fp16_compiled"),
}


def _need(r: dict, path: str, where: str):
    v = r
    for part in path.split("."):
        if not isinstance(v, dict) or part not in v:
            raise NanoqwenError(where, path, "a field of nanoqwen bench --peers --json", "missing")
        v = v[part]
    return v


def decode_step(r: dict) -> str:
    """Which decode step the record timed: "persistent", "graph", or what it says."""
    name = (r.get("protocol") or {}).get("decode", "?")
    for step, text in DECODE_NAMES.items():
        if name == text:
            return step
    return "graph" if name == OLD_GRAPH_NAME else name


def default_step() -> str:
    """Today's default decode step for the INT4 7B (nanoqwen.yaml engine.decode)."""
    return load().engine.decode["int4"]


def figures(r: dict, where: str = "book/data/scoreboard.json") -> dict[str, str]:
    """The headline figures of a scoreboard record, formatted as the pages print them. A
    figure the record cannot give (no graph step timed beside it, a peer that did not run or
    does not agree with the reference) is left out; a record without our own ITL, TTFT or MBU
    is refused, naming the field."""
    ours = float(_need(r, "itl_ms.median", where))
    out = {"itl_ms": f"{ours:.2f}", "ttft_ms": f"{float(_need(r, 'ttft_ms', where)):.1f}",
           "mbu": f"{float(_need(r, 'mbu', where)):.0%}",
           "floor_ms": f"{_need(r, 'bytes_per_token', where) / (_need(r, 'read_ceiling_tbps', where) * 1e12) * 1e3:.2f}"}
    if isinstance(r.get("graph_itl_ms"), dict) and "median" in r["graph_itl_ms"]:
        out["graph_itl_ms"] = f"{r['graph_itl_ms']['median']:.2f}"
    for key, (_, peer) in FIGURES.items():
        p = (r.get("peers") or {}).get(peer) if peer else None
        if not p or "error" in p or "wrong" in p or not p.get("agreement", {}).get("agrees") or not p.get("itl_ms"):
            continue
        out[key] = f"{p['itl_ms'] / ours:.2f}"
    return out


def quoted(text: str) -> list[tuple[str, str]]:
    """(key, value) of every headline marker in a page, in order."""
    return [(m.group(1), m.group(2)) for m in MARKER_RE.finditer(text)]


def rewrite(text: str, figs: dict[str, str], where: str = "<page>") -> str:
    """The page with every marker's value replaced by the record's figure (a key the record
    does not give is refused, naming the page and the key)."""
    def sub(m):
        key = m.group(1)
        if key not in figs:
            raise NanoqwenError(where, f"headline:{key}", "one of " + ", ".join(sorted(figs)), "not in the record")
        return f"<!-- headline:{key} -->{figs[key]}<!-- /headline -->"
    return MARKER_RE.sub(sub, text)


def main(argv=None) -> int:
    import argparse
    import json
    p = argparse.ArgumentParser(prog="python3 -m nanoqwen_lib.measure.headlines",
                                description="The headline figures of book/data/scoreboard.json, and the pages that quote them.")
    p.add_argument("--write", action="store_true", help="rewrite the markers' values in " + ", ".join(PAGES))
    a = p.parse_args(argv)
    r = json.loads(RECORD.read_text())
    figs = figures(r)
    for k, v in figs.items():
        print(f"{k:<22}{v:>8}  {FIGURES[k][0]}")
    if decode_step(r) != default_step():
        print(f"note: the record timed the {decode_step(r)} step; today's default is {default_step()} "
              "(re-run chapter 11 on a GPU with NANOQWEN_WRITE_RECORDS=1)")
    if a.write:
        for page in PAGES:
            path = REPO / page
            text = path.read_text()
            new = rewrite(text, figs, page)
            if new != text:
                path.write_text(new)
                print(f"rewrote {page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
