"""Issue 28's byte count before the first run: what a decode step whose weights never wait
could reach, from the persistent step's measured timeline and the bytes a token reads.

The model (one layer, then the token):
- the layer's latency chain (qkv -> attention -> o_proj) takes C, measured: the exposed time of
  those kinds in chapter 10's timeline (book/data/persistent.json), per layer;
- the chain reads its own weights at the rate it does today; the rest of the read ceiling is
  free to stream the layer's gate/up and down weights *ahead of use* into a buffer of R bytes
  (shared-memory pages on every SM, or L2);
- when the chain ends, gate/up and down consume what was staged and stream the rest at the
  ceiling: layer time = C + max(0, B - staged) / ceiling, staged = min(R, C x spare bandwidth);
- lm_head streams at the ceiling as today (its measured exposed time).
This is an upper bound on what overlap alone can give: it assumes consumers never stall on a
staged page and the chain gets no slower while the loader streams beside it.

    python tools/overlap_budget.py [--record book/data/persistent.json] [--pages-kib 160,200] [--target-ms 1.15]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from nanoqwen_lib import config
from nanoqwen_lib.gpu import hardware, layer

ROOT = Path(__file__).resolve().parent.parent
CHAIN = ("qkv", "attention", "o_proj")
STREAM = ("gate_up", "down")


def budget(record: dict, buffers: dict[str, float], target_ms: float = 1.15) -> dict:
    """record: persistent.json's data; buffers: name -> staging bytes for the whole GPU.
    Returns the per-layer chain, the stream bytes, each buffer's predicted ITL (ms) and the
    chain per layer that buffer would need for target_ms."""
    kinds = record["timeline"]["kinds"]
    tbps = record["read_ceiling_tbps"]
    bw = tbps * 1e3                                           # bytes per ns
    layers = kinds["qkv"]["count"]
    chain_ns = sum(kinds[k]["exposed_ns"] for k in CHAIN) / layers
    chain_bytes = sum(kinds[k]["floor_ns"] for k in CHAIN) / layers * bw
    stream_bytes = sum(kinds[k]["floor_ns"] for k in STREAM) / layers * bw
    spare_bw = bw - chain_bytes / chain_ns
    other_ns = sum(v["exposed_ns"] for k, v in kinds.items() if k not in CHAIN + STREAM)
    today_ms = record["timeline"]["total_ns"] / 1e6
    out = {"ceiling_tbps": tbps, "chain_us": chain_ns / 1e3, "chain_MB": chain_bytes / 1e6,
           "stream_MB": stream_bytes / 1e6, "spare_tbps": spare_bw / 1e3,
           "stageable_in_chain_MB": chain_ns * spare_bw / 1e6, "today_ms": today_ms,
           "floor_ms": record["floor_ms"], "rows": []}
    for name, r in buffers.items():
        staged = min(r, chain_ns * spare_bw)
        layer_ns = chain_ns + max(0.0, stream_bytes - staged) / bw
        itl = (layers * layer_ns + other_ns) / 1e6
        # the chain that reaches target_ms with this buffer (staging limited by r, not by the chain)
        need_ns = (target_ms * 1e6 - other_ns) / layers - max(0.0, stream_bytes - r) / bw
        out["rows"].append({"buffer": name, "MB": r / 1e6, "staged_MB": staged / 1e6,
                            "layer_us": layer_ns / 1e3, "itl_ms": itl, "chain_for_target_us": need_ns / 1e3})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", type=Path, default=ROOT / "book" / "data" / "persistent.json")
    ap.add_argument("--pages-kib", default="128,160,200", help="shared-memory staging per SM, KiB (comma list)")
    ap.add_argument("--l2-mb", default="30,45", help="L2 staging for the whole GPU, MB (comma list)")
    ap.add_argument("--target-ms", type=float, default=1.15, help="the ITL the chain is solved for (issue 28's)")
    a = ap.parse_args(argv)
    rec = json.loads(a.record.read_text())
    dims = config.load().model("7b")
    sms = hardware.design_target().sms
    buffers = {"none (today's shape)": 0.0}
    buffers |= {f"smem {k} KiB x {sms} SMs": float(k) * 1024 * sms for k in a.pages_kib.split(",")}
    buffers |= {f"L2 {m} MB": float(m) * 1e6 for m in a.l2_mb.split(",")}
    b = budget(rec, buffers, a.target_ms)
    per_token_gb = sum(layer.decode_region_bytes(dims, 579).values()) / 1e9
    print(f"record {a.record.name}: timeline token {b['today_ms']:.3f} ms, floor {b['floor_ms']:.3f} ms "
          f"({per_token_gb:.2f} GB a token), read ceiling {b['ceiling_tbps']:.2f} TB/s")
    print(f"per layer: chain qkv -> attention -> o_proj {b['chain_us']:.1f} us reading {b['chain_MB']:.1f} MB; "
          f"gate/up + down {b['stream_MB']:.1f} MB; spare bandwidth during the chain {b['spare_tbps']:.2f} TB/s, "
          f"so at most {b['stageable_in_chain_MB']:.1f} MB can be staged while it runs")
    print(f"{'staging buffer':<28}{'MB':>7}{'staged MB':>11}{'layer us':>10}{'ITL ms':>8}"
          f"{f'chain for {a.target_ms} ms':>20}")
    for r in b["rows"]:
        print(f"{r['buffer']:<28}{r['MB']:>7.1f}{r['staged_MB']:>11.1f}{r['layer_us']:>10.1f}{r['itl_ms']:>8.3f}"
              f"{r['chain_for_target_us']:>17.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
