"""Launchers for kernels/prefill_attention.cu: a prompt's RoPE, with K and V written to the paged
cache, and its causal attention over those pages.

    prefill_rope_write_kv(qkv, k_pool, v_pool, block_table, q_out, dims, start_pos=0)
                                  q_out [T, heads, d] = rope(q); rope(k) and v -> the pages
    prefill_attention(q, k_pool, v_pool, block_table, out, dims, start_pos=0)
                                  out [T, heads * d] = causal softmax(q K^T / sqrt(d)) V
    attention_kernels(dims)       the compiled module and RoPE inv_freq table of one model's dims (cached)

K and V live where decode reads them (k_pool / v_pool: one layer's pool[layer, 0] / pool[layer, 1],
[num_pages, kv_heads, 16, d]; block_table int32 maps the sequence's logical pages). Errors name the
public launcher (ops_prefill.<fn>), whose module re-exports these names.
"""
from __future__ import annotations

import functools

import numpy as np

from nanoqwen_lib.config import ModelDims, load
from nanoqwen_lib.errors import NanoqwenError
from nanoqwen_lib.gpu import cuda_build
from nanoqwen_lib.gpu.launch_checks import check_device_buffer, check_tokens

PAGE_TOKENS = load().kv_cache.page_tokens
_PA = load().geometry["prefill_attention"]
ATTN_BQ, ATTN_THREADS, ROPE_THREADS = _PA["NQ_PA_BQ"], 32 * _PA["NQ_PA_WARPS"], _PA["NQ_PA_ROPE_THREADS"]


class PrefillAttentionKernels:
    """The compiled attention module for one model's dims and its RoPE inv_freq table
    (ops_attention.rope_inv_freq: the decode kernel's bits, so both write the same K)."""

    def __init__(self, dims: ModelDims):
        import cupy as cp
        from nanoqwen_lib.gpu.ops_attention import rope_inv_freq
        mod = cuda_build.load_module("prefill_attention", dims)
        self.dims = dims
        self.attn = mod.get_function("nq_prefill_attention")
        self.smem = 5 * ATTN_BQ * dims.head_dim * 2          # Q tile + 2 x (K tile, V tile)
        self.attn.max_dynamic_shared_size_bytes = self.smem
        self.rope = mod.get_function("nq_prefill_rope_write_kv")
        self.inv_freq = cp.asarray(rope_inv_freq(dims.head_dim, dims.rope_theta))   # [d/2]


@functools.lru_cache(maxsize=None)
def attention_kernels(dims: ModelDims) -> PrefillAttentionKernels:
    return PrefillAttentionKernels(dims)


def _check_pages(where: str, dims: ModelDims, k_pool, v_pool, block_table, context: int) -> None:
    shape = (getattr(k_pool, "shape", (0,))[0], dims.num_kv_heads, PAGE_TOKENS, dims.head_dim)
    check_device_buffer(where, "k_pool", k_pool, np.float16, shape)
    check_device_buffer(where, "v_pool", v_pool, np.float16, shape)
    pages = -(-context // PAGE_TOKENS)
    if getattr(block_table, "ndim", 0) != 1 or block_table.shape[0] < pages:
        raise NanoqwenError(where, "block_table.shape", f"({pages} or more,) for {context} tokens",
                            getattr(block_table, "shape", None))
    check_device_buffer(where, "block_table", block_table, np.int32, block_table.shape)


def prefill_rope_write_kv(qkv, k_pool, v_pool, block_table, q_out, dims: ModelDims, start_pos: int = 0) -> None:
    """qkv fp16 [T, qkv_dim] (bias added) -> q_out fp16 [T, heads, d] = rope(q); rope(k) and v
    to the page slots of positions start_pos .. start_pos+T-1 (block_table int32, device)."""
    where = "ops_prefill.prefill_rope_write_kv"
    t = check_tokens(where, "qkv", qkv)
    check_device_buffer(where, "qkv", qkv, np.float16, (t, dims.qkv_dim))
    check_device_buffer(where, "q_out", q_out, np.float16, (t, dims.num_heads, dims.head_dim))
    _check_pages(where, dims, k_pool, v_pool, block_table, start_pos + t)
    ks = attention_kernels(dims)
    ks.rope((t,), (ROPE_THREADS,), (qkv, ks.inv_freq, block_table, q_out, k_pool, v_pool, np.int32(t),
                                    np.int32(start_pos), np.int32(dims.num_heads), np.int32(dims.num_kv_heads)))


def prefill_attention(q, k_pool, v_pool, block_table, out, dims: ModelDims, start_pos: int = 0) -> None:
    """out fp16 [T, heads * d] = causal softmax(q K^T / sqrt(d)) V, FP32 softmax; q fp16
    [T, heads, d] at positions start_pos ..; K, V of positions 0 .. start_pos+T-1 in the pages."""
    where = "ops_prefill.prefill_attention"
    t = check_tokens(where, "out", out)
    check_device_buffer(where, "q", q, np.float16, (t, dims.num_heads, dims.head_dim))
    check_device_buffer(where, "out", out, np.float16, (t, dims.q_dim))
    _check_pages(where, dims, k_pool, v_pool, block_table, start_pos + t)
    ks = attention_kernels(dims)
    grid = (-(-t // ATTN_BQ), dims.num_heads)
    ks.attn(grid, (ATTN_THREADS,), (q, k_pool, v_pool, block_table, out, np.int32(t), np.int32(start_pos),
                                    np.int32(dims.num_heads), np.int32(dims.num_kv_heads)),
            shared_mem=ks.smem)
