"""The paged KV cache on the CPU: sizes from the config, page tables, slots, the refusal.

The property test scatters tokens through a page table (slot_mapping, the path the GPU's
rope_append uses) and gathers them back page by page (the path the attention kernel uses),
for random lengths, append chunkings and shuffled physical pages, against a contiguous
cache. `test_property_check_catches_off_by_one` runs the same check on deliberately wrong
slot mappings, so the property is known to fail when it should.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nanoqwen_lib.model import kvcache
from nanoqwen_lib.config import load
from nanoqwen_lib.errors import LimitError
from nanoqwen_lib.model.kvcache import PAGE_TOKENS, PageAllocator, PageTable

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

CFG = load()
D7B = CFG.model("7b")
# Small pool geometry for the property tests: 2 layers, 2 KV heads, head_dim 8.
SMALL = dataclasses.replace(CFG.model("tiny-hd64"), num_layers=2, num_kv_heads=2, head_dim=8)


# ---------------------------------------------------------------- sizes
def test_page_geometry_of_the_7b_from_config():
    kv = CFG.kv_cache
    assert kv.page_tokens == 16 and kv.dtype_bytes == 2
    slice_bytes = kv.page_tokens * D7B.head_dim * kv.dtype_bytes
    assert kvcache.head_slice_bytes(D7B) == slice_bytes == 4096          # one bulk copy
    assert kvcache.page_bytes(D7B) == D7B.num_kv_heads * slice_bytes == 16384
    assert kvcache.pool_shape(D7B, 10) == (28, 2, 10, 4, 16, 128)
    assert kvcache.pool_bytes(D7B, 10) == int(np.prod(kvcache.pool_shape(D7B, 10))) * 2
    assert kvcache.pool_bytes(D7B, 1) == 28 * 2 * 16384


def test_head_dim_64_geometry():
    d = CFG.model("tiny-hd64")
    assert kvcache.head_slice_bytes(d) == 2048
    assert kvcache.head_slice_bytes(d) % CFG.format.alignment == 0


def test_max_tokens_that_fit():
    per_page = kvcache.pool_bytes(D7B, 1)
    assert kvcache.pages_that_fit(D7B, 100 * per_page) == 100
    assert kvcache.max_tokens_that_fit(D7B, 100 * per_page) == 1600
    assert kvcache.max_tokens_that_fit(D7B, 100 * per_page - 1) == 1584      # whole pages only
    assert kvcache.max_tokens_that_fit(D7B, 10**13) == D7B.max_position     # capped
    assert kvcache.pages_for(0) == 0 and kvcache.pages_for(1) == 1
    assert kvcache.pages_for(16) == 1 and kvcache.pages_for(17) == 2


# ---------------------------------------------------------------- tables and slots
def test_slot_mapping_at_page_boundaries():
    alloc = PageAllocator(8, order=[5, 2, 7, 0, 1, 3, 4, 6])
    table = PageTable(alloc, max_pages_per_seq=4)
    slots = table.append_tokens(33)
    assert table.block_table[:3].tolist() == [5, 2, 7] and table.block_table[3] == -1
    assert table.context_len == 33 and table.num_pages == 3
    assert table.slot_mapping(0) == 80 and table.slot_mapping(15) == 95
    assert table.slot_mapping(16) == 32 and table.slot_mapping(31) == 47
    assert table.slot_mapping(32) == 112
    assert slots.dtype == np.int32 and slots.tolist() == [table.slot_mapping(p) for p in range(33)]
    with pytest.raises(AssertionError):
        table.slot_mapping(48)                    # page 3 is not mapped


def test_decode_appends_cross_a_page_at_multiples_of_16():
    table = PageTable(PageAllocator(4, order=[3, 1, 2, 0]), max_pages_per_seq=4)
    table.append_tokens(15)
    assert table.num_pages == 1
    assert table.append_tokens(1).tolist() == [3 * 16 + 15]            # position 15: same page
    assert table.num_pages == 1
    assert table.append_tokens(1).tolist() == [1 * 16 + 0]             # position 16: new page
    assert table.num_pages == 2 and table.context_len == 17


def test_limit_error_names_how_many_tokens_fit_and_takes_nothing():
    alloc = PageAllocator(4)
    table = PageTable(alloc, max_pages_per_seq=10)
    table.append_tokens(20)
    before = (alloc.free_count, table.block_table.copy(), table.context_len)
    with pytest.raises(LimitError) as e:
        table.append_tokens(45)                   # 65 tokens; 4 pages hold 64
    msg = str(e.value)
    assert "at most 64 tokens" in msg and "65 tokens" in msg and "sequence length" in msg
    assert "kv cache" in msg
    assert (alloc.free_count, table.context_len) == (before[0], before[2])
    assert (table.block_table == before[1]).all()

    small = PageTable(PageAllocator(100), max_pages_per_seq=3)      # the table is the limit
    with pytest.raises(LimitError, match="at most 48 tokens"):
        small.reserve(49)
    small.reserve(48)
    assert small.num_pages == 3


def test_release_returns_pages():
    alloc = PageAllocator(6)
    a = PageTable(alloc, 6)
    a.append_tokens(40)
    assert alloc.free_count == 3
    a.release()
    assert alloc.free_count == 6 and (a.block_table == -1).all() and a.context_len == 0


# ---------------------------------------------------------------- the property
def roundtrip_mismatch(length, chunks, order, extra_pages, slot_fn=None):
    """Scatter `length` tokens (appended in `chunks`) through a page table into a NaN-poisoned
    pool, gather them back, compare with the contiguous cache. True when anything differs.
    slot_fn(table, positions) replaces table.slot_mapping (to inject mistakes)."""
    num_pages = kvcache.pages_for(length) + extra_pages
    rng = np.random.default_rng(length * 1009 + extra_pages)
    k_ref = rng.standard_normal((length, SMALL.num_kv_heads, SMALL.head_dim)).astype(np.float16)
    v_ref = rng.standard_normal(k_ref.shape).astype(np.float16)
    pool = np.full(kvcache.pool_shape(SMALL, num_pages), np.nan, dtype=np.float16)
    table = PageTable(PageAllocator(num_pages, order=order[:num_pages]), max_pages_per_seq=num_pages)
    layer = 1
    pos = 0
    for n in chunks:
        slots = table.append_tokens(n)
        if slot_fn is not None:
            slots = slot_fn(table, np.arange(pos, pos + n))
        kvcache.write_kv(pool, layer, slots, k_ref[pos:pos + n], v_ref[pos:pos + n])
        pos += n
    assert table.context_len == length
    k, v = kvcache.gather_kv(pool, layer, table.block_table, table.context_len)
    if k.shape != k_ref.shape or v.shape != v_ref.shape:
        return True
    same = np.array_equal(k, k_ref) and np.array_equal(v, v_ref)       # NaN never equals
    untouched = np.isnan(pool[0]).all()                                # other layer never written
    return not (same and untouched)


def split(length, cuts):
    """Chunk sizes summing to length, from sorted distinct cut points in (0, length)."""
    edges = [0] + sorted(set(c for c in cuts if 0 < c < length)) + [length]
    return [b - a for a, b in zip(edges, edges[1:])]


@settings(max_examples=150, deadline=None)
@given(length=st.one_of(st.integers(1, 200), st.sampled_from([15, 16, 17, 31, 32, 33, 48, 49])),
       cuts=st.lists(st.integers(1, 199), max_size=6),
       extra=st.integers(0, 4), seed=st.integers(0, 2**32 - 1))
def test_scatter_through_page_table_then_gather_equals_contiguous(length, cuts, extra, seed):
    order = np.random.default_rng(seed).permutation(kvcache.pages_for(length) + extra)
    assert not roundtrip_mismatch(length, split(length, cuts), order, extra)


@pytest.mark.parametrize("mistake", ["p-1", "p+1", "no-page-jump", "page-offset-swap"])
def test_property_check_catches_off_by_one(mistake):
    def wrong(table, p):
        p = np.asarray(p)
        if mistake == "p-1":
            return table.slot_mapping(np.maximum(p - 1, 0))
        if mistake == "p+1":                     # last token lands past the table: clip inside
            return table.slot_mapping(np.minimum(p + 1, table.num_pages * PAGE_TOKENS - 1))
        if mistake == "no-page-jump":            # treats the pool as contiguous from page 0
            return (table.block_table[0] * PAGE_TOKENS + p).astype(np.int64) % (table.allocator.num_pages * PAGE_TOKENS)
        return table.block_table[p % PAGE_TOKENS % table.num_pages].astype(np.int64) * PAGE_TOKENS + p // PAGE_TOKENS
    order = np.random.default_rng(7).permutation(kvcache.pages_for(49) + 2)
    assert roundtrip_mismatch(49, [16, 16, 16, 1], order, 2, slot_fn=wrong)
    assert not roundtrip_mismatch(49, [16, 16, 16, 1], order, 2)      # the right mapping passes


@pytest.mark.parametrize("delta", [-1, 1])
def test_gathering_the_wrong_context_len_is_caught(delta):
    """Attending to context_len +/- 1 tokens shows up as a shape or poison mismatch."""
    pool = np.full(kvcache.pool_shape(SMALL, 5), np.nan, dtype=np.float16)
    table = PageTable(PageAllocator(5, order=[4, 0, 3, 1, 2]), 5)
    k = np.ones((49, SMALL.num_kv_heads, SMALL.head_dim), np.float16)
    kvcache.write_kv(pool, 0, table.append_tokens(49), k, k)
    kk, _ = kvcache.gather_kv(pool, 0, table.block_table, 49 + delta)
    assert kk.shape[0] != 49 or np.isnan(kk).any()
    if delta == 1:
        assert np.isnan(kk[-1]).all()            # token 49 was never written: poison
