"""The GPU engine for FP8 E4M3 weights (file layout 2): GpuBackend with four projections
swapped per layer, everything else (norms, RoPE and the KV pages, attention, lm_head,
graphs, the step's bookkeeping) unchanged.

    decode   gemv_fp8 for qkv (+bias), o_proj (+residual), gate_up; SwiGLU (swiglu_act into
             a.act) then gemv_fp8 for down (+residual). Activations stay fp16.
    prefill  each projection's input is quantized per token (quantize_rows_fp8: E4M3 codes
             and one FP32 scale per row), then gemm_fp8 on E4M3 tensor cores (mma.sync
             m16n8k32, FP32 accumulation), both scales in the epilogue. The reference model
             rounds the same four inputs the same way (quant.fp8_rows) in its prefill.

The regions keep the INT4 engine's names, so breakdown.py and the chapters read both.
"""
from __future__ import annotations

from nanoqwen_lib.gpu import ops_fp8
from nanoqwen_lib.gpu.engine import GpuBackend


class GpuBackendFp8(GpuBackend):
    encoding = "fp8"
    PREFILL_GEMMS = "FP8 E4M3 GEMMs (mma.sync, per-token activation scales)"
    f8 = ops_fp8

    def layer_launches(self, l: int) -> list[tuple[str, object]]:
        a, f8, w = self.arena, self.f8, f"w.{l}."
        x, y = a["a.x"], a["a.y"]
        gate_up2, act2 = a["a.gate_up"].reshape(1, -1), a["a.act"].reshape(1, -1)

        def swiglu_down():
            self.pf.swiglu_act(gate_up2, act2)
            f8.gemv_fp8(a["a.act"], a[w + "down.qweight"], a[w + "down.scales"], x, residual=x)

        swap = {
            "qkv_gemv": lambda: f8.gemv_fp8(y, a[w + "qkv.qweight"], a[w + "qkv.scales"], a["a.qkv"],
                                            bias=a[w + "qkv.bias"]),
            "o_proj": lambda: f8.gemv_fp8(a["a.attn"], a[w + "o.qweight"], a[w + "o.scales"], x, residual=x),
            "gate_up_gemv": lambda: f8.gemv_fp8(y, a[w + "gate_up.qweight"], a[w + "gate_up.scales"], a["a.gate_up"]),
            "swiglu_down": swiglu_down,
        }
        return [(name, swap.get(name, launch)) for name, launch in super().layer_launches(l)]

    def prefill_launches(self, start: int, t: int) -> list[tuple[str, object]]:
        a, d, f8 = self.arena, self.dims, self.f8
        x, y, qkv = a["p.x"][:t], a["p.y"][:t], a["p.qkv"][:t]
        attn, gate_up, act = a["p.attn"][:t], a["p.gate_up"][:t], a["p.act"][:t]
        ts = a["p.ts"][:t]

        def xq(k: int):
            return a["p.xq"][:t * k].reshape(t, k)          # E4M3 rows of the projection's input

        def projection(inp, name: str, out, bias=None, residual=None):
            k = inp.shape[1]
            f8.quantize_rows_fp8(inp, xq(k), ts)
            f8.gemm_fp8(xq(k), ts, a[name + ".qweight"], a[name + ".scales"], out, bias=bias, residual=residual)

        def swap(l: int) -> dict:
            w = f"w.{l}."

            def swiglu_down():
                self.pf.swiglu_act(gate_up, act)
                projection(act, w + "down", x, residual=x)

            return {
                "qkv_gemm": lambda: projection(y, w + "qkv", qkv, bias=a[w + "qkv.bias"]),
                "o_proj_gemm": lambda: projection(attn, w + "o", x, residual=x),
                "gate_up_gemm": lambda: projection(y, w + "gate_up", gate_up),
                "swiglu_down_gemm": swiglu_down,
            }

        base = super().prefill_launches(start, t)
        per_layer = (len(base) - 1) // d.num_layers          # embed, then the same launches per layer
        out = [base[0]]
        for i, (name, launch) in enumerate(base[1:]):
            out.append((name, swap(i // per_layer).get(name, launch)))
        return out
