"""One object per weight encoding for the layer's four projections (qkv, o_proj, gate_up,
down): it owns their slots in the arena, the buffers its kernels need besides them, and the
decode and prefill launches. The engine writes the layer once (gpu.engine, gpu.layer) and
asks the file's encoding for the projections; nothing else in the engine knows how a
matrix is stored.

    int4  (layout 1)  decode: fused INT4 GEMV (+bias / +residual), SwiGLU fused into the
                      down GEMV; prefill: INT4 tensor-core GEMMs, SwiGLU fused likewise
    fp8   (layout 2)  decode: FP8 GEMV, SwiGLU as its own kernel into a.act, then the down
                      GEMV; prefill: each projection's input quantized per token (E4M3 codes
                      and one FP32 scale per row, as the reference model rounds them), then
                      the FP8 tensor-core GEMM with both scales in the epilogue

A launch is returned as a callable that reads everything per token from device memory, so
the engine's lists can be run eagerly, captured into a CUDA graph, or timed region by region.
"""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.format.layout import decode_gemv_shapes, projection_tensors


class Projections:
    """The encoding-independent half: arena slots from format.layout.projection_tensors."""

    encoding = ""
    prefill_gemms = ""                      # what the prefill's projections run on, in words

    def __init__(self, arena, gemm: str = "wgmma"):
        self.a, self.gemm = arena, gemm

    @classmethod
    def add_slots(cls, plan, layer_prefix: str, dims) -> None:
        """The layer's four matrices: `<prefix><matrix>.qweight` and `.scales`."""
        for matrix, (n, k) in decode_gemv_shapes(dims).items():
            for suffix, (dtype, shape) in projection_tensors(cls.encoding, n, k).items():
                plan.add(f"{layer_prefix}{matrix}.{suffix}", dtype, shape)

    @classmethod
    def add_buffers(cls, plan, dims, chunk: int) -> None:
        """Activation buffers this encoding's kernels need beyond the engine's own."""

    def weights(self, matrix: str) -> tuple:
        return self.a[matrix + ".qweight"], self.a[matrix + ".scales"]

    def after_upload(self, dims) -> None:
        """Once the file's tensors are in the arena: copies the kernels read besides them (none here)."""

    def prefill_gate_up(self, matrix: str, x, gate_up, act):
        """The MLP's first GEMM: gate_up = x W^T (act is formed by prefill_swiglu), unless the
        encoding fuses SwiGLU into this GEMM's epilogue (then act directly)."""
        return self.prefill(matrix, x, gate_up)


class Int4Projections(Projections):
    encoding = "int4"

    def __init__(self, arena, gemm: str = "wgmma"):
        super().__init__(arena, gemm)
        from nanoqwen_lib.gpu import ops_gemv, ops_prefill
        self.gemv, self.pf = ops_gemv, ops_prefill
        # wgmma: SwiGLU in the gate_up GEMM's epilogue (act straight out, no gate_up rows in memory)
        self.fused_gate_up = gemm == "wgmma"

    @property
    def prefill_gemms(self) -> str:
        if self.gemm == "wgmma":
            return "INT4 GEMMs on wgmma (FP16 HGMMA, dequantized by a producer warpgroup; SwiGLU fused into gate_up)"
        return "INT4 GEMMs on mma.sync (dequantized in registers)"

    def decode(self, matrix: str, x, out, bias=None, residual=None):
        qw, sc = self.weights(matrix)
        return lambda: self.gemv.gemv_int4(x, qw, sc, out, bias=bias, residual=residual)

    def decode_swiglu(self, matrix: str, gate_up, out, residual=None):
        """out (+)= W @ (silu(gate) * up), gate_up = [gate | up]."""
        qw, sc = self.weights(matrix)
        return lambda: self.gemv.gemv_int4_swiglu(gate_up, qw, sc, out, residual=residual)

    def prefill(self, matrix: str, x, out, bias=None, residual=None):
        qw, sc = self.weights(matrix)
        return lambda: self.pf.gemm_int4(x, qw, sc, out, bias=bias, residual=residual, kernel=self.gemm)

    def prefill_gate_up(self, matrix: str, x, gate_up, act):
        if not self.fused_gate_up:
            return self.prefill(matrix, x, gate_up)
        qw, sc = self.weights(matrix)
        return lambda: self.pf.gemm_int4_gate_up_swiglu(x, qw, sc, act)

    def prefill_swiglu(self, matrix: str, gate_up, act, out, residual=None):
        if self.fused_gate_up:                      # act came out of the gate_up GEMM
            return self.prefill(matrix, act, out, residual=residual)
        qw, sc = self.weights(matrix)
        return lambda: self.pf.gemm_int4_swiglu(gate_up, qw, sc, out, residual=residual, act=act, kernel=self.gemm)


class Int4RsProjections(Int4Projections):
    """INT4 with the prefill on the RS-form GEMM (kernels/prefill_rs.cu: the weight is
    wgmma's register A operand, converted by the consumers), INT4's default prefill
    (engine.prefill_gemm). Decode as Int4Projections. Each projection gets a copy in the
    RS order (and gate_up in the SwiGLU row order, its epilogue forming act), made on the GPU from
    the layout-1 words at upload (add_slots, after_upload)."""

    def __init__(self, arena, gemm: str = "rs"):
        super().__init__(arena, "rs")
        from nanoqwen_lib.gpu.hardware import hardware
        from nanoqwen_lib.gpu import ops_prefill_rs as prefill_rs
        self.rs, self.sms, self.fused_gate_up = prefill_rs, hardware().sms, True

    @property
    def prefill_gemms(self) -> str:
        return "INT4 GEMMs in wgmma's RS form (W the register operand, converted by the consumers; SwiGLU fused)"

    @staticmethod
    def rs_shapes(dims) -> dict:
        """matrix -> ((blocks, K/64, 4, 32, 4) words, (blocks, K/128, 64) scales) of its RS copy."""
        from nanoqwen_lib.format.quant import GROUP_SIZE
        out = {}
        for m, (n, k) in decode_gemv_shapes(dims).items():
            nb = -(-(n // 2) // 32) if m == "gate_up" else -(-n // 64)
            out[m] = ((nb, k // 64, 4, 32, 4), (nb, k // GROUP_SIZE, 64))
        return out

    @classmethod
    def add_slots(cls, plan, layer_prefix: str, dims) -> None:
        """Layout 1's slots (the decode GEMVs read them, and the RS copies are made from them), then
        each matrix's RS copy: `.rs` and `.rs_scales`."""
        super().add_slots(plan, layer_prefix, dims)
        for m, (w_shape, s_shape) in cls.rs_shapes(dims).items():
            plan.add(f"{layer_prefix}{m}.rs", np.uint32, w_shape)
            plan.add(f"{layer_prefix}{m}.rs_scales", np.float16, s_shape)

    def after_upload(self, dims) -> None:
        """The RS copies from the layout-1 words and scales in the arena (on the GPU)."""
        import cupy as cp
        for l in range(dims.num_layers):
            for m in decode_gemv_shapes(dims):
                w = f"w.{l}.{m}"
                qw, sc = self.weights(w)
                if m == "gate_up":
                    qw, sc = self.rs.swiglu_rows(qw, sc)
                self.a[w + ".rs"][...] = self.rs.rs_order(qw)
                self.a[w + ".rs_scales"][...] = self.rs.rs_scales(sc)
        cp.cuda.Device().synchronize()      # the default stream's copies before the engine's stream reads them

    def prefill(self, matrix: str, x, out, bias=None, residual=None):
        qw, sc = self.weights(matrix)
        w_rs, s_rs = self.a[matrix + ".rs"], self.a[matrix + ".rs_scales"]
        build = self.rs.plan_rs(x.shape[0], qw.shape[0], self.sms)
        return lambda: self.rs.gemm_int4_rs(x, w_rs, sc, out, bias=bias, residual=residual, scales_rs=s_rs, **build)

    def prefill_gate_up(self, matrix: str, x, gate_up, act):
        w_rs, s_rs = self.a[matrix + ".rs"], self.a[matrix + ".rs_scales"]
        build = self.rs.plan_rs(x.shape[0], 2 * act.shape[1], self.sms)
        return lambda: self.rs.gemm_int4_rs_swiglu(x, w_rs, s_rs, act, **build)


class Fp8Projections(Projections):
    encoding = "fp8"

    def __init__(self, arena, gemm: str = "wgmma"):
        super().__init__(arena, gemm)
        from nanoqwen_lib.gpu import ops_fp8, ops_prefill
        self.f8, self.pf = ops_fp8, ops_prefill

    @property
    def prefill_gemms(self) -> str:
        how = "wgmma (QGMMA)" if self.gemm == "wgmma" else "mma.sync"
        return f"FP8 E4M3 GEMMs on {how}, per-token activation scales"

    @classmethod
    def add_buffers(cls, plan, dims, chunk: int) -> None:
        h, i = dims.hidden, dims.intermediate
        plan.add("a.act", np.float16, (i,))                           # decode: silu(g) * u
        plan.add("p.xq", np.uint8, (chunk * max(h, dims.q_dim, i),))   # prefill: E4M3 activations [T, K]
        plan.add("p.ts", np.float32, (chunk,))                        # ... and their per-token scales

    def decode(self, matrix: str, x, out, bias=None, residual=None):
        qw, sc = self.weights(matrix)
        return lambda: self.f8.gemv_fp8(x, qw, sc, out, bias=bias, residual=residual)

    def decode_swiglu(self, matrix: str, gate_up, out, residual=None):
        act = self.a["a.act"]
        gemv = self.decode(matrix, act, out, residual=residual)

        def launch():
            self.pf.swiglu_act(gate_up.reshape(1, -1), act.reshape(1, -1))
            gemv()
        return launch

    def prefill(self, matrix: str, x, out, bias=None, residual=None):
        qw, sc = self.weights(matrix)
        t, k = x.shape
        xq, ts = self.a["p.xq"][:t * k].reshape(t, k), self.a["p.ts"][:t]

        def launch():
            self.f8.quantize_rows_fp8(x, xq, ts)
            self.f8.gemm_fp8(xq, ts, qw, sc, out, bias=bias, residual=residual, kernel=self.gemm)
        return launch

    def prefill_swiglu(self, matrix: str, gate_up, act, out, residual=None):
        gemm = self.prefill(matrix, act, out, residual=residual)

        def launch():
            self.pf.swiglu_act(gate_up, act)
            gemm()
        return launch


ENCODINGS = {p.encoding: p for p in (Int4Projections, Fp8Projections)}


def projections_for(encoding: str, gemm: str) -> type:
    """The projections class of a weight encoding with this prefill GEMM (rs: INT4's RS form)."""
    return Int4RsProjections if (encoding, gemm) == ("int4", "rs") else ENCODINGS[encoding]
