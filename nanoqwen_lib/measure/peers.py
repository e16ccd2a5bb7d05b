"""`nanoqwen bench --peers`: every peer that can run here, each checked before it is timed.

Rows (one JSON entry each, with `how`, `version`, `ttft_ms`, `itl_ms` where it has them,
and `agreement`: measure.peer_check's verdict, teacher-forced and free-running):

  nanoqwen                  our engine, checked the same way as the peers
  torch_int4                measure/peers_torch.py
  hf_fp16_compiled/_eager   measure/peers_hf.py
  dequant_cublas_prefill    measure/prefill_dequant.py (a prefill line: TTFT only; its math
                            is the reference's, checked on the CPU in tests/test_peers.py)
  llama_cpp_Q4_K_M/_Q4_0    read from the JSON of tools/llama_cpp_bench.py (--llama-cpp),
                            built and measured on the same machine in the same run

A peer whose check fails keeps its times but gets no ratio: `wrong` says why. A peer that
cannot run says why in `error` (torch or CUDA missing, a compile failure, ...).
"""
from __future__ import annotations

import json

import numpy as np

from nanoqwen_lib.config import load


class EnginePeer:
    """Our engine behind peer_check's protocol (logits stay on the device)."""

    def __init__(self, engine):
        self.e = engine

    def prefill(self, ids):
        self.e.prefill(ids)
        return self.e.logits().copy()

    def step(self, token):
        self.e.force(token)
        return self.e.logits().copy()


def bench_prompt(n: int) -> list[int]:
    """The benchmark's prompt (benchmark_e2e's seed 0)."""
    return np.random.default_rng(0).integers(0, 151643, n).tolist()


def with_ratio(row: dict, ours: dict) -> dict:
    """Ratios to ours only for a peer that agrees; a wrong one says so instead."""
    ag = row.get("agreement", {})
    if "error" in row:
        return row
    if not ag.get("agrees"):
        row["wrong"] = ag.get("why_not") or ag.get("error") or "not checked"
        return row
    if row.get("itl_ms"):
        row["itl_ratio_vs_nanoqwen"] = row["itl_ms"] / ours["itl_ms"]["median"]
    if row.get("ttft_ms"):
        row["ttft_ratio_vs_nanoqwen"] = row["ttft_ms"] / ours["ttft_ms"]
    return row


def llama_cpp_rows(path) -> dict:
    """The rows of tools/llama_cpp_bench.py's JSON: per quantization, flash attention on
    (the faster of llama-bench's two settings is reported, both are kept)."""
    d = json.loads(open(path).read())
    rows = {}
    for kind, q in d["quants"].items():
        bench = q["bench"]
        best = min(bench, key=lambda k: bench[k].get("itl_ms", float("inf")))
        ag = q.get("agreement", {})
        verdict = ag.get(best) if isinstance(ag, dict) and best in ag else ag
        v = d["version"]
        rows[f"llama_cpp_{kind}"] = {
            "how": f"llama.cpp {kind} (convert_hf_to_gguf.py f16 -> llama-quantize), llama-bench "
                   f"pp{d['protocol']['prompt_tokens']}/tg{d['protocol']['gen_tokens']} -ngl {d['protocol']['ngl']}, "
                   f"{d['protocol']['repetitions']} repetitions, flash attention {best[-1] == '1' and 'on' or 'off'} "
                   "(the faster); TTFT = prompt tokens / pp t/s, ITL = 1 / tg t/s; checked against our reference "
                   "on the GGUF's own dequantized weights",
            "version": f"llama.cpp {v.get('llama_cpp_commit')}"
                       + (f" (build {v['build_number']}, {v.get('build_commit')})" if v.get("build_number") else "")
                       + f", built from llama-cpp-python {v.get('llama_cpp_python')}'s source",
            "protocol": d["protocol"], "model": d.get("model"),
            "ttft_ms": bench[best].get("ttft_ms"), "itl_ms": bench[best].get("itl_ms"),
            "bench": bench, "agreement": verdict or {"error": "no agreement in the JSON"}}
    return rows


def run_peers(nq_file, ours: dict, progress=print, llama_cpp_json=None) -> dict:
    """Each peer on our prompt, checked against the reference; failures are reported."""
    import cupy as cp

    from nanoqwen_lib.measure.peer_check import check_peer, summary
    from nanoqwen_lib.measure.validate import validation_prompts
    from nanoqwen_lib.model.reference import ReferenceModel
    proto, v = ours["protocol"], load().validation
    dims = nq_file.dims
    prompt = bench_prompt(proto["prompt_tokens"])
    prompts = validation_prompts(v.peer_prompts)
    progress("the reference model on the GPU (for the checks)")
    reference = ReferenceModel(dims, nq_file.model_tensors(), xp=cp)

    def check(peer):
        r = check_peer(peer, reference, dims, prompts, v.peer_gen_tokens, cp)
        progress(summary(r))
        return r

    def engine_row():
        from nanoqwen_lib.gpu.engine import GpuBackend
        e = GpuBackend(nq_file, max_tokens=max(map(len, prompts)) + v.peer_gen_tokens + 16)
        return {"how": "nanoqwen (the run above)", "agreement": check(EnginePeer(e))}

    def torch_row():
        from nanoqwen_lib.measure.peers_torch import torch_int4_peer
        return torch_int4_peer(nq_file, prompt, proto["gen_tokens"], max(1, proto["warmup"]), check)

    def hf_rows():
        from nanoqwen_lib.measure.peers_hf import hf_rows as rows
        return rows(nq_file, prompt, proto["gen_tokens"], warmup=1, runs=3, check=check,
                    ours_tokens=ours.get("tokens"))

    def dequant_row():
        from nanoqwen_lib.measure.prefill_dequant import time_prefill_dequant
        return {**time_prefill_dequant(nq_file, prompt),
                "agreement": {"agrees": True, "why_not": "", "note": "the reference's own arithmetic with FP16 GEMMs; "
                              "checked against the reference on the CPU (tests/test_peers.py)"}}

    out = {}
    for name, fn in (("nanoqwen", engine_row), ("torch_int4", torch_row), ("hf_fp16", hf_rows),
                     ("dequant_cublas_prefill", dequant_row)):
        progress(f"running {name}")
        try:
            r = fn()
            out.update(r if name == "hf_fp16" else {name: r})
        except Exception as e:  # a peer that cannot run here is reported as such
            out[name] = {"error": f"{type(e).__name__}: {e}"[:800]}
        finally:
            cp.get_default_memory_pool().free_all_blocks()
            try:
                import torch
                torch.cuda.empty_cache()
            except Exception:
                pass
    if llama_cpp_json:
        try:
            rows = llama_cpp_rows(llama_cpp_json)
            for row in rows.values():             # the same request, or no ratio
                p, m = row["protocol"], load().model(row["model"])
                if (p["prompt_tokens"], p["gen_tokens"], m.num_layers, m.hidden) != (
                        proto["prompt_tokens"], proto["gen_tokens"], dims.num_layers, dims.hidden):
                    row["agreement"] = {"agrees": False, "why_not": f"{row['model']} at pp{p['prompt_tokens']}/"
                                        f"tg{p['gen_tokens']}, not this run's model and request",
                                        **{k: v for k, v in row["agreement"].items() if k not in ("agrees", "why_not")}}
            out.update(rows)
        except Exception as e:
            out["llama_cpp"] = {"error": f"{llama_cpp_json}: {type(e).__name__}: {e}"[:500]}
    else:
        out["llama_cpp"] = {"error": "not run: pass --llama-cpp <the JSON of tools/llama_cpp_bench.py run --cuda>"}
    for name in out:
        if name != "nanoqwen":
            with_ratio(out[name], ours)
    return out


def format_peers(r: dict) -> list[str]:
    """Console lines for bench's report: each peer's times, its check, its ratio or why none."""
    lines = []
    for name, p in r.get("peers", {}).items():
        if "error" in p:
            lines.append(f"peer {name:<24} could not run: {p['error']}")
            continue
        ttft = f"TTFT {p['ttft_ms']:.2f} ms" if p.get("ttft_ms") else "TTFT -"
        itl = f"ITL {p['itl_ms']:.3f} ms" if p.get("itl_ms") else "ITL -"
        ag = p.get("agreement", {})
        agree = (f"teacher-forced {ag['identical']}/{ag['steps']} (+{ag['near_tie_mismatches']} near-ties), "
                 f"free-running {ag['free_running']['identical_prefix_tokens']}/{ag['free_running']['tokens']}"
                 if "steps" in ag else ag.get("note", ag.get("error", "")))
        if "wrong" in p:
            verdict = f"WRONG ({p['wrong']}): no ratio"
        elif "itl_ratio_vs_nanoqwen" in p:
            verdict = f"nanoqwen {p['itl_ratio_vs_nanoqwen']:.2f}x faster per token"
        elif "ttft_ratio_vs_nanoqwen" in p:
            verdict = f"TTFT {p['ttft_ratio_vs_nanoqwen']:.2f}x ours"
        else:
            verdict = ""
        lines.append(f"peer {name:<24} {ttft}, {itl}; {agree}; {verdict}")
    return lines


# ---------------------------------------------------------------- the scoreboard (chapter 10)
ROWS = (("llama_cpp_Q4_K_M", "llama.cpp Q4_K_M"), ("llama_cpp_Q4_0", "llama.cpp Q4_0"),
        ("torch_int4", "torch INT4 tinygemm"), ("hf_fp16_compiled", "transformers FP16, static + compiled"),
        ("hf_fp16_eager", "transformers FP16, eager"), ("dequant_cublas_prefill", "dequantize + cuBLAS prefill"))


def peer_status(p: dict | None) -> str:
    """What a row's check says, in a few words."""
    if p is None:
        return "not in this JSON"
    if "error" in p:
        return "could not run: " + p["error"]
    ag = p.get("agreement")
    if not ag:
        return "not checked (no agreement in this JSON): no ratio"
    if "wrong" in p or not ag.get("agrees"):
        return "WRONG: " + (p.get("wrong") or ag.get("why_not") or ag.get("error", "")) + ": no ratio"
    if "steps" in ag:
        return (f"agrees: {ag['identical']}/{ag['steps']} teacher-forced (+{ag['near_tie_mismatches']} near-ties, "
                f"noise {ag['noise_logits']:.2g}), free-running {ag['free_running']['identical_prefix_tokens']}"
                f"/{ag['free_running']['tokens']}")
    return "agrees: " + ag.get("note", "")


def scoreboard_rows(r: dict) -> list[dict]:
    """bench's JSON -> rows: ours first, then ROWS, then any other peer the JSON holds.
    Each row: label, itl_ms, ttft_ms (None where the row has none or it is absent),
    status, and the ratio of the peer's ITL to ours (only for a peer that agrees)."""
    peers = r.get("peers", {})
    rows = [{"key": "nanoqwen", "label": "nanoqwen (ours)", "itl_ms": r["itl_ms"]["median"], "ttft_ms": r["ttft_ms"],
             "status": peer_status(peers["nanoqwen"]) if "nanoqwen" in peers else "not checked in this JSON",
             "ratio": 1.0}]
    keys = [k for k, _ in ROWS] + [k for k in peers if k not in dict(ROWS) and k not in ("nanoqwen", "llama_cpp")]
    for key in keys:
        p = peers.get(key)
        ok = p is not None and "error" not in p and p.get("agreement", {}).get("agrees") and "wrong" not in p
        itl = (p or {}).get("itl_ms")
        rows.append({"key": key, "label": dict(ROWS).get(key, key), "itl_ms": itl, "ttft_ms": (p or {}).get("ttft_ms"),
                     "status": peer_status(p), "ratio": itl / r["itl_ms"]["median"] if ok and itl else None})
    if "llama_cpp" in peers:
        rows.append({"key": "llama_cpp", "label": "llama.cpp", "itl_ms": None, "ttft_ms": None,
                     "status": peer_status(peers["llama_cpp"]), "ratio": None})
    return rows


def format_scoreboard(rows: list[dict], article: dict) -> str:
    """The table: measured rows, then the article's, quoted with their source."""
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"{'':<38}{'ITL ms':>8}{'TTFT ms':>9}{'ITL/ours':>10}  check"]
    for x in rows:
        lines.append(f"{x['label']:<38}{f(x['itl_ms'], '.3f'):>8}{f(x['ttft_ms'], '.1f'):>9}"
                     f"{f(x['ratio'], '.2f'):>10}  {x['status']}")
    for name, a in article.items():
        lines.append(f"{name:<38}{a['itl_ms']:>8.2f}{a['ttft_ms']:>9.0f}{'-':>10}  quoted: {a['source']}")
    return "\n".join(lines)
