"""Launchers for kernels/rope_append.cu and kernels/paged_attention.cu (GPU only).

Per decode step and layer (the engine calls the module-level functions):
    rope_append_kv(qkv, position, slot, k_cache, v_cache, q_out, dims)
        q_out = rope(q); k_cache[slot] = rope(k); v_cache[slot] = v
    paged_attention(q_out, k_cache, v_cache, block_table, context_len, out, workspace)
        out [num_heads * head_dim] fp16 = softmax(q.K^T / sqrt(d)) V over the pages
Every buffer is checked before a launch (cupy array, dtype, shape, C-contiguous, 128-byte
aligned); nothing is allocated per call: the split partials live in an AttentionWorkspace
made once from the dims and the longest context. position, slot, block_table and
context_len are device arrays, so a captured CUDA graph replays for every token.

The host-side reference (random_paged_case, attention_ref_f64) lives with the paged cache
in nanoqwen_lib.model.kvcache.
"""
from __future__ import annotations

import functools

import numpy as np

from nanoqwen_lib.gpu import cuda_build
from nanoqwen_lib.model import kvcache
from nanoqwen_lib.config import ModelDims, load
from nanoqwen_lib.model.reference import rope_inv_freq  # one table for kernels and reference (same bits)

ALIGN = load().format.alignment
_GEOMETRY = load().geometry["paged_attention"]   # kernels/paged_attention.cu gets the same as -D
ATTN_THREADS = 32 * (1 + _GEOMETRY["NQ_ATTN_CONSUMER_WARPS"])   # a producer warp + the consumer warps
# Grid = kv_heads x max_splits: 4 x 64 = 256 CTAs on the 7B, ~2 per SM of the H200's 132.
# Measured best or within 3% of it at 512, 8192 and 32768 tokens (PERFLOG.md, "paged
# attention"); 96 (3 CTAs per SM, one wave) was no faster, 128 slower (a second wave).
DEFAULT_MAX_SPLITS = 64
MAX_SPLITS_COMBINE = _GEOMETRY["NQ_ATTN_MAX_SPLITS_COMBINE"]   # the combine stages at most this many splits


def check_buffer(name: str, a, dtype, shape) -> None:
    """A launcher's precondition on one device buffer; raises AssertionError naming it."""
    import cupy
    if not isinstance(a, cupy.ndarray):
        raise AssertionError(f"{name}: expected a cupy.ndarray, found {type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise AssertionError(f"{name}: dtype expected {np.dtype(dtype)}, found {a.dtype}")
    if tuple(a.shape) != tuple(shape):
        raise AssertionError(f"{name}: shape expected {tuple(shape)}, found {tuple(a.shape)}")
    if not a.flags.c_contiguous:
        raise AssertionError(f"{name}: expected C-contiguous, found strides {a.strides}")
    if a.data.ptr % ALIGN:
        raise AssertionError(f"{name}: expected a {ALIGN}-byte aligned pointer, found {a.data.ptr:#x}")


class AttentionWorkspace:
    """Scratch of the split kernel, sized once: per split and query head the partial max m,
    sum l (float32 [max_splits, num_heads]) and accumulator (float32 [max_splits, num_heads, d]).
    Block tables have max_pages = ceil(max_context / 16) entries."""

    def __init__(self, dims: ModelDims, max_context: int, max_splits: int = DEFAULT_MAX_SPLITS):
        import cupy as cp
        assert 1 <= max_splits <= MAX_SPLITS_COMBINE, f"max_splits in 1..{MAX_SPLITS_COMBINE}, found {max_splits}"
        assert max_context >= 1
        self.dims, self.max_context, self.max_splits = dims, max_context, max_splits
        self.max_pages = kvcache.pages_for(max_context)
        self.m = cp.empty((max_splits, dims.num_heads), cp.float32)
        self.l = cp.empty((max_splits, dims.num_heads), cp.float32)
        self.acc = cp.empty((max_splits, dims.num_heads, dims.head_dim), cp.float32)

    @property
    def nbytes(self) -> int:
        return self.m.nbytes + self.l.nbytes + self.acc.nbytes

    def poison(self) -> None:
        """Fill the partials with NaN (tests: the combine must read only what a split wrote)."""
        for a in (self.m, self.l, self.acc):
            a.fill(np.nan)


class AttentionKernels:
    """The compiled modules for one model's dims, and its RoPE inv_freq table (made once);
    `buggy_sync` takes the split kernel from the lab (kernels/lab/paged_attention_buggy.cu:
    the original tail-page hand-off, a deliberate bug; book chapter 6, tools/sanitize_attention.py)."""

    def __init__(self, dims: ModelDims, buggy_sync: bool = False):
        import cupy as cp
        self.dims = dims
        attn = cuda_build.load_module("paged_attention", dims)
        self._split = (cuda_build.load_module("lab/paged_attention_buggy", dims).get_function("paged_attention_split_buggy")
                       if buggy_sync else attn.get_function("paged_attention_split"))
        self._combine = attn.get_function("paged_attention_combine")
        self._rope = cuda_build.load_module("rope_append", dims).get_function("rope_append_kv")
        self.inv_freq = cp.asarray(rope_inv_freq(dims.head_dim, dims.rope_theta))   # [d/2]

    def _check_cache(self, k_cache, v_cache) -> None:
        d = self.dims
        shape = (k_cache.shape[0], d.num_kv_heads, kvcache.PAGE_TOKENS, d.head_dim)
        check_buffer("k_cache", k_cache, np.float16, shape)
        check_buffer("v_cache", v_cache, np.float16, shape)

    def rope_append_kv(self, qkv, position, slot, k_cache, v_cache, q_out) -> None:
        """qkv fp16 [qkv_dim]; position, slot int32 [1]; k_cache, v_cache one layer's fp16
        [num_pages, kv_heads, 16, d] (pool[layer, 0] and pool[layer, 1]); q_out fp16 [q_dim]."""
        d = self.dims
        check_buffer("qkv", qkv, np.float16, (d.qkv_dim,))
        check_buffer("position", position, np.int32, (1,))
        check_buffer("slot", slot, np.int32, (1,))
        self._check_cache(k_cache, v_cache)
        check_buffer("q_out", q_out, np.float16, (d.q_dim,))
        self._rope((d.num_heads + d.num_kv_heads,), (d.head_dim // 2,),
                   (qkv, position, slot, self.inv_freq, q_out, k_cache, v_cache))

    def paged_attention(self, q, k_cache, v_cache, block_table, context_len, out,
                        ws: AttentionWorkspace) -> None:
        """q fp16 [q_dim] (RoPE applied); block_table int32 [ws.max_pages]; context_len int32 [1]
        (device value in 1 .. 16 * ws.max_pages, not read here); out fp16 [q_dim]."""
        d = self.dims
        assert ws.dims == d, "workspace made for other dims"
        check_buffer("q", q, np.float16, (d.q_dim,))
        self._check_cache(k_cache, v_cache)
        check_buffer("block_table", block_table, np.int32, (ws.max_pages,))
        check_buffer("context_len", context_len, np.int32, (1,))
        check_buffer("out", out, np.float16, (d.q_dim,))
        check_buffer("ws.m", ws.m, np.float32, (ws.max_splits, d.num_heads))
        check_buffer("ws.l", ws.l, np.float32, (ws.max_splits, d.num_heads))
        check_buffer("ws.acc", ws.acc, np.float32, (ws.max_splits, d.num_heads, d.head_dim))
        splits = np.int32(ws.max_splits)
        self._split((d.num_kv_heads, ws.max_splits), (ATTN_THREADS,),
                    (q, k_cache, v_cache, block_table, context_len, ws.m, ws.l, ws.acc, splits))
        self._combine((d.num_heads,), (d.head_dim,), (ws.m, ws.l, ws.acc, context_len, out, splits))


@functools.lru_cache(maxsize=None)
def kernels(dims: ModelDims, buggy_sync: bool = False) -> AttentionKernels:
    """One AttentionKernels per (dims, variant), built on first use."""
    return AttentionKernels(dims, buggy_sync)


def rope_append_kv(qkv, position, slot, k_cache, v_cache, q_out, dims: ModelDims) -> None:
    """The engine's entry point: AttentionKernels.rope_append_kv of the fixed build."""
    kernels(dims).rope_append_kv(qkv, position, slot, k_cache, v_cache, q_out)


def paged_attention(q, k_cache, v_cache, block_table, context_len, out, ws: AttentionWorkspace) -> None:
    """The engine's entry point: AttentionKernels.paged_attention of the fixed build."""
    kernels(ws.dims).paged_attention(q, k_cache, v_cache, block_table, context_len, out, ws)
