"""The prefill kernels' front door: gemm_int4 picks the GEMM kernel, and every prefill launcher
the engine calls is here, re-exported from the module of its kernel file:

    ops_prefill_wgmma.py      kernels/prefill_wgmma.cu: gemm_int4(kernel="wgmma"), gemm_int4_gate_up_swiglu,
                              plan_wgmma and the wgmma_* build helpers
    ops_prefill_mma.py        kernels/prefill_gemm.cu: gemm_int4(kernel="mma"), gemm_int4_swiglu, swiglu_act,
                              plan_gemm, the split-K workspace() both GEMMs use
    ops_prefill_attention.py  kernels/prefill_attention.cu: prefill_rope_write_kv, prefill_attention

GEMM kernels: gemm_int4(..., kernel="wgmma" | "mma"): prefill_wgmma.cu (sm_90a, warp-specialized
wgmma, plan_wgmma picks BN and split-K) or prefill_gemm.cu (mma.sync, plan_gemm); None takes
DEFAULT_GEMM_KERNEL ("mma" wherever an mma-only option is given or N % 8 != 0). The engine
names the kernel itself (nanoqwen.yaml engine.prefill_gemm: wgmma for INT4).
gemm_int4_gate_up_swiglu(x, gate_up.qweight, gate_up.scales, act) (wgmma only) writes act [T, I]
= fp16(silu(g) * u) straight from the gate_up GEMM: the bits of gemm_int4 + swiglu_act.

Per layer, for a prompt of T tokens at positions start_pos .. start_pos+T-1 (the engine calls,
INT4 on wgmma; gpu.projection chooses the GEMMs):
    gemm_int4(x, qkv.qweight, qkv.scales, qkv_out, bias=qkv.bias)         qkv [T, qkv_dim]
    prefill_rope_write_kv(qkv_out, k_pool, v_pool, block_table, q, dims)  q [T, heads, d]; K, V -> pages
    prefill_attention(q, k_pool, v_pool, block_table, attn, dims)         attn [T, heads*d]
    gemm_int4(attn, o.qweight, o.scales, x, residual=x)                   x += W_o attn (in place)
    gemm_int4_gate_up_swiglu(y, gate_up.qweight, gate_up.scales, act)     act [T, I] = silu(g) * u
    gemm_int4(act, down.qweight, down.scales, x, residual=x)              x += W_down act
(on mma.sync the MLP is gemm_int4 into gate_up [T, 2I], then gemm_int4_swiglu with act as scratch)

Attention reads K and V from the paged cache, the same place decode reads them: the RoPE
kernel writes them there, so no contiguous K/V copy exists (k_pool / v_pool are one layer's
pool[layer, 0] / pool[layer, 1], [num_pages, kv_heads, 16, d]; block_table int32 maps the
sequence's logical pages, device resident). start_pos > 0 (a prompt after cached context)
works too: the queries see the earlier keys in the pages.

Every launcher checks each buffer (cupy array, dtype, shape, C-contiguous, 128-byte
aligned; both GEMMs through launch_checks.check_prefill_gemm) and raises a NanoqwenError
naming it and the public launcher (ops_prefill.<fn>); nothing is allocated per call (the
RoPE inv_freq table is made once per dims). Launches go to the current CuPy stream.
"""
from __future__ import annotations

from nanoqwen_lib.errors import NanoqwenError
from nanoqwen_lib.gpu import ops_prefill_mma, ops_prefill_wgmma
from nanoqwen_lib.gpu.launch_checks import check_int4_weights
# The kernel files' modules' public names, re-exported for ops_prefill.<name> callers. A test that
# monkeypatches one patches the module that owns it (a re-export is a second binding, read by no launcher).
from nanoqwen_lib.gpu.ops_gemv import num_sms  # noqa: F401  (the planners' SM count)
from nanoqwen_lib.gpu.ops_prefill_attention import (  # noqa: F401
    ATTN_BQ, ATTN_THREADS, PAGE_TOKENS, ROPE_THREADS, PrefillAttentionKernels, attention_kernels, prefill_attention,
    prefill_rope_write_kv)
from nanoqwen_lib.gpu.ops_prefill_mma import (  # noqa: F401
    ACT_THREADS, GEMM_BK, GEMM_BM128_MIN_WAVES, GEMM_BM_CHOICES, GEMM_BN, GEMM_CTAS_PER_SM, GEMM_STAGES,
    GEMM_THREADS, GEMM_WARPS_M, GEMM_XS, SPLIT_FILL_KTILES, SPLIT_MAX, SPLIT_MIN_KTILES, WS_COUNTERS, WS_FLOATS,
    gemm_int4_swiglu, gemm_smem_bytes, plan_gemm, swiglu_act, workspace)
from nanoqwen_lib.gpu.ops_prefill_wgmma import (  # noqa: F401
    SMEM_OPTIN, WGMMA_BK, WGMMA_BM, WGMMA_BN, WGMMA_BN_CHOICES, WGMMA_FILL_KTILES, WGMMA_INT4_2P_MAX_BN,
    WGMMA_KTILE_OVERHEAD, WGMMA_ROW_BYTES, WGMMA_SPLIT_KTILES, WGMMA_SPLIT_MAX, WGMMA_STAGES, WGMMA_THREADS,
    gemm_int4_gate_up_swiglu, plan_wgmma, wgmma_int4_ktile_bn, wgmma_int4_threads, wgmma_smem_bytes,
    wgmma_stage_bytes, wgmma_stages, xmap)

GEMM_KERNELS = ("wgmma", "mma")
# gemm_int4's kernel when a caller names none: the launcher's own default, which the kernel
# tests rely on. The engine always names one: nanoqwen.yaml engine.prefill_gemm (gpu.projection).
DEFAULT_GEMM_KERNEL = "mma"


def gemm_int4(x, qweight, scales, out, bias=None, residual=None, *, kernel=None, bm=None, split=None,
              warps_m=None, stages=None, bn=None) -> None:
    """out[T, N] = fp16(x W^T [+ bias] [+ residual]), FP32 accumulation. x fp16 [T, K];
    qweight uint32 [N, K/8]; scales fp16 [N, K/128]; residual may be `out` (in place), x may not.
    kernel: "wgmma" (kernels/prefill_wgmma.cu, N a multiple of 8) or "mma" (prefill_gemm.cu's
    mma.sync); None = DEFAULT_GEMM_KERNEL. bm / warps_m (mma), bn (wgmma), split, stages override
    the plans (plan_gemm, plan_wgmma; tests, benchmark). The kernel's launcher checks x, out,
    bias and residual (launch_checks.check_prefill_gemm)."""
    n, k = check_int4_weights("ops_prefill.gemm_int4", qweight, scales)
    kernel = _kernel_choice("gemm_int4", kernel, n, bm=bm, warps_m=warps_m, bn=bn)
    if kernel == "wgmma":
        ops_prefill_wgmma._launch_wgmma("gemm_int4", "nq_prefill_wgmma", x, qweight, scales, out, bias, residual,
                                        n, k, bn, split, stages)
        return
    ops_prefill_mma._launch_gemm("gemm_int4", "nq_prefill_gemm", x, qweight, scales, out, bias, residual, n, k, k,
                                 bm, split, warps_m, stages or GEMM_STAGES)


def _kernel_choice(fn: str, kernel, n: int, *, bm=None, warps_m=None, bn=None) -> str:
    """The GEMM kernel: `kernel` when named; else "mma" where only it applies (an mma option
    given, or N not a multiple of 8), else DEFAULT_GEMM_KERNEL."""
    if kernel is None:
        kernel = "mma" if (bm is not None or warps_m is not None or n % 8) else DEFAULT_GEMM_KERNEL
    where = f"ops_prefill.{fn}"
    if kernel not in GEMM_KERNELS:
        raise NanoqwenError(where, "kernel", f"one of {GEMM_KERNELS}", kernel)
    if kernel == "wgmma" and (bm is not None or warps_m is not None):
        raise NanoqwenError(where, "bm" if bm is not None else "warps_m", "None with kernel='wgmma' (an mma option)",
                            bm if bm is not None else warps_m)
    if kernel == "mma" and bn is not None:
        raise NanoqwenError(where, "bn", "None with kernel='mma' (a wgmma option)", bn)
    return kernel
