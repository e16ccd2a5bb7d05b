"""The paged KV cache: pages, page tables, slots (vLLM's vocabulary), xp-generic.

One pool holds every layer's K and V, in pages of `page_tokens` (16) tokens:

    pool [num_layers, 2 (K, V), num_pages, num_kv_heads, page_tokens, head_dim]  fp16

so one KV head's slice of a page (page_tokens x head_dim fp16, 4 KiB on the 7B) is
contiguous: the attention kernel fetches it with one bulk copy. A sequence owns pages in
any order; its `block_table` maps logical page i (tokens 16i .. 16i+15) to a physical page,
and token `pos` lives at slot `block_table[pos // 16] * 16 + pos % 16`.

Everything here is host bookkeeping plus two array helpers (`write_kv`, `gather_kv`) that
run on NumPy or CuPy; nothing allocates on the hot path.
"""
from __future__ import annotations

import numpy as np

from nanoqwen_lib.config import ModelDims, load
from nanoqwen_lib.errors import LimitError

PAGE_TOKENS = load().kv_cache.page_tokens
KV_DTYPE_BYTES = load().kv_cache.dtype_bytes
SOURCE = "kv cache (nanoqwen.yaml kv_cache)"


# ---------------------------------------------------------------- sizes
def pool_shape(dims: ModelDims, num_pages: int) -> tuple[int, ...]:
    """[num_layers, 2, num_pages, num_kv_heads, page_tokens, head_dim]."""
    return (dims.num_layers, 2, num_pages, dims.num_kv_heads, PAGE_TOKENS, dims.head_dim)


def head_slice_bytes(dims: ModelDims) -> int:
    """One KV head's K (or V) for one page: what one bulk copy moves (4 KiB on the 7B)."""
    return load().kv_cache.head_slice_bytes(dims.head_dim)


def page_bytes(dims: ModelDims) -> int:
    """One physical page of K (or V) across all KV heads, one layer (16 KiB on the 7B)."""
    return dims.num_kv_heads * head_slice_bytes(dims)


def pool_bytes(dims: ModelDims, num_pages: int) -> int:
    """Bytes of a pool of `num_pages` pages: every layer, K and V."""
    return dims.num_layers * 2 * num_pages * page_bytes(dims)


def pages_for(tokens: int) -> int:
    """Pages that hold `tokens` tokens (ceil)."""
    return -(-tokens // PAGE_TOKENS)


def pages_that_fit(dims: ModelDims, budget_bytes: int) -> int:
    """Whole pages (all layers, K and V) that a byte budget holds."""
    return budget_bytes // pool_bytes(dims, 1)


def max_tokens_that_fit(dims: ModelDims, budget_bytes: int) -> int:
    """Longest sequence a byte budget holds: whole pages, capped at the model's max_position."""
    return min(pages_that_fit(dims, budget_bytes) * PAGE_TOKENS, dims.max_position)


# ---------------------------------------------------------------- allocation
class PageAllocator:
    """A free list of physical pages. `order` (a permutation) sets which pages come out first:
    tests hand out shuffled pages so nothing can silently rely on page i being at slot 16 i."""

    def __init__(self, num_pages: int, order=None):
        order = np.arange(num_pages) if order is None else np.asarray(order)
        assert sorted(order.tolist()) == list(range(num_pages)), "order must permute range(num_pages)"
        self.num_pages = num_pages
        self._free = [int(p) for p in order[::-1]]      # pop() from the end = order[0] first

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free), "callers check free_count first (PageTable.reserve does)"
        return [self._free.pop() for _ in range(n)]

    def release(self, pages) -> None:
        self._free.extend(int(p) for p in reversed(list(pages)))


class PageTable:
    """One sequence's pages. block_table int32 [max_pages_per_seq]: logical page -> physical
    page, -1 where none is mapped yet; context_len: tokens written so far."""

    def __init__(self, allocator: PageAllocator, max_pages_per_seq: int):
        self.allocator = allocator
        self.max_pages_per_seq = max_pages_per_seq
        self.block_table = np.full(max_pages_per_seq, -1, dtype=np.int32)
        self.num_pages = 0
        self.context_len = 0

    def tokens_that_fit(self) -> int:
        """The longest this sequence can grow: its own pages plus the free ones, within its table."""
        pages = min(self.max_pages_per_seq, self.num_pages + self.allocator.free_count)
        return pages * PAGE_TOKENS

    def reserve(self, total_tokens: int) -> None:
        """Map enough pages for `total_tokens` tokens, or refuse before taking any page."""
        fit = self.tokens_that_fit()
        if total_tokens > fit:
            raise LimitError(SOURCE, "sequence length", f"at most {fit} tokens "
                             f"({fit // PAGE_TOKENS} pages of {PAGE_TOKENS} fit)",
                             f"{total_tokens} tokens",
                             "a shorter prompt or --max-tokens, or a larger KV pool")
        need = pages_for(total_tokens) - self.num_pages
        if need > 0:
            new = self.allocator.allocate(need)
            self.block_table[self.num_pages:self.num_pages + need] = new
            self.num_pages += need

    def append_tokens(self, n: int) -> np.ndarray:
        """Grow by n tokens (positions context_len .. context_len+n-1) -> their slots int32 [n]."""
        start = self.context_len
        self.reserve(start + n)
        self.context_len = start + n
        return self.slot_mapping(np.arange(start, start + n))

    def slot_mapping(self, positions):
        """Slot of token `pos`: block_table[pos // 16] * 16 + pos % 16 (int, or int32 array)."""
        pos = np.asarray(positions, dtype=np.int64)
        assert (pos >= 0).all() and (pos < self.num_pages * PAGE_TOKENS).all(), \
            f"positions must lie in the mapped pages [0, {self.num_pages * PAGE_TOKENS})"
        slots = self.block_table[pos // PAGE_TOKENS].astype(np.int64) * PAGE_TOKENS + pos % PAGE_TOKENS
        return int(slots) if slots.ndim == 0 else slots.astype(np.int32)

    def release(self) -> None:
        self.allocator.release(self.block_table[:self.num_pages])
        self.block_table[:] = -1
        self.num_pages = self.context_len = 0


# ---------------------------------------------------------------- data movement (xp-generic)
def write_kv(pool, layer: int, slots, k, v) -> None:
    """Scatter tokens into their slots. pool as pool_shape; slots int [n]; k, v [n, kv_heads, d]."""
    slots = slots.astype("int64") if hasattr(slots, "astype") else slots
    page, off = slots // PAGE_TOKENS, slots % PAGE_TOKENS
    # pool[layer, 0][page, :, off] is [n, kv_heads, d]: advanced indices first, then the sliced head axis.
    pool[layer, 0][page, :, off] = k
    pool[layer, 1][page, :, off] = v


def gather_kv(pool, layer: int, block_table, context_len: int):
    """The contiguous cache of a sequence, read page by page (independently of slot_mapping):
    -> k, v [context_len, kv_heads, d]."""
    pages = block_table[:pages_for(context_len)]
    out = []
    for kv in (0, 1):
        tiles = pool[layer, kv][pages]                      # [n_pages, kv_heads, 16, d]
        n_pages, kv_heads, _, d = tiles.shape
        tokens = tiles.transpose(0, 2, 1, 3).reshape(n_pages * PAGE_TOKENS, kv_heads, d)
        out.append(tokens[:context_len])                    # [ctx, kv_heads, d]
    return out[0], out[1]


# ---------------------------------------------------------------- attention over the pages
def random_paged_case(dims: ModelDims, ctx: int, rng, max_pages: int, extra_pages: int = 3,
                      q_scale: float = 1.5):
    """A decode step's attention inputs on the host: q fp16 [q_dim]; K, V fp16 [ctx, kv_heads, d];
    a NaN-poisoned one-layer pool [1, 2, P, kv_heads, 16, d] holding them at shuffled physical
    pages; the PageTable (block_table int32 [max_pages])."""
    num_pages = pages_for(ctx) + extra_pages
    table = PageTable(PageAllocator(num_pages, order=rng.permutation(num_pages)), max_pages)
    slots = table.append_tokens(ctx)
    k = rng.standard_normal((ctx, dims.num_kv_heads, dims.head_dim)).astype(np.float16)
    v = rng.standard_normal((ctx, dims.num_kv_heads, dims.head_dim)).astype(np.float16)
    q = (q_scale * rng.standard_normal(dims.q_dim)).astype(np.float16)
    pool = np.full((1, 2, num_pages, dims.num_kv_heads, PAGE_TOKENS, dims.head_dim),
                   np.nan, dtype=np.float16)
    write_kv(pool, 0, slots, k, v)
    return q, k, v, pool, table


def attention_ref_f64(q, k, v, dims: ModelDims) -> np.ndarray:
    """softmax(q.k / sqrt(d)) v per query head in float64; head h reads KV head h // gqa.
    q [q_dim]; k, v [ctx, kv_heads, d] -> [q_dim] float64."""
    d, gqa = dims.head_dim, dims.gqa_ratio
    qh = q.astype(np.float64).reshape(dims.num_kv_heads, gqa, d)          # [kv, gqa, d]
    kf, vf = k.astype(np.float64), v.astype(np.float64)
    s = np.einsum("cgd,tcd->cgt", qh, kf) / np.sqrt(d)                   # [kv, gqa, ctx]
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("cgt,tcd->cgd", p, vf).reshape(-1)


ATTENTION_FP32_WINDOW = 2.0 ** -16   # per sum_j p_j |v_j|: exp2f / __expf, the online rescaling, P.V in FP32


def attention_abs_pv(q, k, v, dims: ModelDims) -> np.ndarray:
    """sum_j p_j |v_j| per output, float64 [q_dim] (the softmax weights of attention_ref_f64
    applied to |v|): the scale of the attention's FP32 error, for attention_tolerance."""
    return attention_ref_f64(q, k, np.abs(np.asarray(v, np.float64)), dims)


def attention_tolerance(ref: np.ndarray, abs_pv: np.ndarray | None = None) -> np.ndarray:
    """|out - ref| allowed for a decode attention's fp16 output against attention_ref_f64.

    Without abs_pv: llm.c style atol + |ref| eps, 1e-5 + 2^-10 |ref|: one fp16 rounding of the
    output (2^-11 relative) doubled, plus room for FP32 accumulation over long contexts. That
    is a whole ulp: an output rounded toward zero passes it (tests/test_emulate.py).
    With abs_pv (attention_abs_pv): half an ulp of the FP32 value plus its FP32 window,
    2^-11 (|ref| + w) + w + 2^-25 with w = ATTENTION_FP32_WINDOW * abs_pv: the FP32 error of a
    weighted mean scales with sum p |v|, not with |ref|, which cancels. Round-toward-zero fails
    it on about a sixth of the outputs of a short context (the old bound on none)."""
    if abs_pv is None:
        return 1e-5 + np.abs(ref) * 2.0 ** -10
    w = ATTENTION_FP32_WINDOW * np.abs(abs_pv)
    return 2.0 ** -11 * (np.abs(ref) + w) + w + 2.0 ** -25
