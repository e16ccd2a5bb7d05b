"""A NumPy model of kernels/lab/gemv_stream3.cu's index arithmetic, on the CPU: what each lane
of a warp loads from the layout-3 bytes (chunk lane and 32 + lane, the half2 of scales at
1024 + 4 (lane / 4)), the magic-number / prmt unpack done on the bits in fp16, the staged x
image in shared memory (chunk c at 16-byte slot c + c / 4, lane run t of group j at byte
320 j + 80 t, the fold and magic words in the run's padding at byte 64), and the pairing of
A and B registers in the two m16n8k16 MMAs per word. Exact and FOLD paths against the float64
reference of the layout-1 weights. It checks the kernel's addressing as written in this
model, not the compiled kernel (tests/test_gpu_lab.py does that on a GPU)."""
from __future__ import annotations

import numpy as np
import pytest

from nanoqwen_lib.format import quant, stream_layout as sl

MAGIC_LO, MAGIC_HI = 0x64086408, 0x54805480


def f16x2(u32):
    """uint32 array -> (low half, high half) as float64 (fp16 bits)."""
    u = np.ascontiguousarray(u32, dtype="<u4")
    h = u.view("<f2").reshape(*u.shape, 2).astype(np.float64)
    return h[..., 0], h[..., 1]


def prmt_3311(w):
    b1, b3 = (w >> 8) & 0xFF, (w >> 24) & 0xFF
    return (b1 | (b1 << 8) | (b3 << 16) | (b3 << 24)).astype(np.uint32)


def unpack(w, fold):
    """One ValueShuffle word per element -> 4 pairs (w0,w1) (w2,w3) (w4,w5) (w6,w7) as fp16
    values (exact codes, or offset by 1032 / 72 when folded), each pair (low, high)."""
    w = w.astype(np.uint32)
    w_hi = prmt_3311(w)
    pairs = []
    for src, mask, magic, off in ((w, 0x000F000F, MAGIC_LO, 1032), (w, 0x00F000F0, MAGIC_HI, 72),
                                  (w_hi, 0x000F000F, MAGIC_LO, 1032), (w_hi, 0x00F000F0, MAGIC_HI, 72)):
        lo, hi = f16x2((src & mask) ^ magic)
        pairs.append((lo, hi) if fold else (lo - off, hi - off))
    return pairs


def stage(x, gs, ng):
    """The CTA's shared memory after stage_x and stage_fold: bytes."""
    img = np.zeros(ng * 320, np.uint8)
    chunks = x[gs * 128:(gs + ng) * 128].astype("<f2").view(np.uint8).reshape(-1, 16)
    for c in range(chunks.shape[0]):
        d = (c + c // 4) * 16
        img[d:d + 16] = chunks[c]
    folds = []
    for grp in range(ng):                          # stage_fold: the quad of runs 4 grp .. +3, summed
        h = img[grp * 320:(grp + 1) * 320].reshape(4, 80)[:, :64].reshape(-1).view("<f2").astype(np.float64)
        h = h.reshape(-1, 8)
        lo, hi = h[:, [0, 1, 4, 5]].sum(), h[:, [2, 3, 6, 7]].sum()
        folds.append(np.float32(1032.0 * lo + 72.0 * hi))
        for t in range(4):
            run = grp * 320 + t * 80
            img[run + 64:run + 80] = np.array([np.float32(folds[-1]).view("<u4"), MAGIC_LO, MAGIC_HI, 0],
                                              "<u4").view(np.uint8)
    return img


def warp_tile(w3, x, tile, G, gs, ng, fold):
    """Rows 16 tile .. +15 of one warp's slice [gs, gs + ng): the sums the t == 0 lanes store."""
    img = stage(x, gs, ng)
    out = np.zeros(16)
    for b in range(ng):
        blk = w3[((tile * G) + gs + b) * 1056:((tile * G) + gs + b + 1) * 1056]
        for g in range(8):
            c = np.zeros(2)                       # rows g, g + 8: the MMA's sum over the quad
            sv = blk[1024 + 4 * g:1024 + 4 * g + 4].view("<u4")
            s_row_g, s_row_g8 = f16x2(sv)
            for t in range(4):
                lane = 4 * g + t
                lo = blk[16 * lane:16 * lane + 16].view("<u4")          # row g
                hi = blk[512 + 16 * lane:512 + 16 * lane + 16].view("<u4")   # row g + 8
                xl = img[b * 320 + t * 80:b * 320 + t * 80 + 80]
                for j in range(4):
                    xv = xl[16 * j:16 * j + 16].view("<u4")           # xv[j].x .. .w
                    bx = [f16x2(xv[i:i + 1]) for i in range(4)]
                    for row, wv in ((0, lo), (1, hi)):
                        p = unpack(wv[j:j + 1], fold)
                        # mma 1: a0/a1 = p[0] with b0 = xv.x, a2/a3 = p[1] with b1 = xv.y;
                        # mma 2: p[2] with xv.z, p[3] with xv.w
                        for q in range(4):
                            c[row] += float((p[q][0] * bx[q][0] + p[q][1] * bx[q][1])[0])
            if fold:
                fv = img[b * 320 + 64:b * 320 + 80].view("<f4")[0]
                c -= float(fv)
            out[g] += c[0] * float(s_row_g[0])
            out[g + 8] += c[1] * float(s_row_g8[0])
    return out


@pytest.mark.parametrize("fold", [0, 1])
@pytest.mark.parametrize("n,k,ksplit", [(16, 128, 1), (20, 384, 1), (33, 512, 2), (48, 640, 3)])
def test_model_of_the_kernel_matches_the_reference(rng, n, k, ksplit, fold):
    words = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    scales = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
    x = rng.standard_normal(k).astype(np.float16)
    w3 = sl.to_stream(words, scales)
    G, T = k // 128, -(-n // 16)
    got = np.zeros(T * 16)
    for tile in range(T):
        for s in range(ksplit):                  # slices added in order, as the last CTA does
            gs = s * G // ksplit
            ng = (s + 1) * G // ksplit - gs
            got[tile * 16:(tile + 1) * 16] += warp_tile(w3, x, tile, G, gs, ng, fold)
    w = quant.dequantize_int4(words, scales).astype(np.float64)
    ref = w @ x.astype(np.float64)
    absdot = np.abs(w) @ np.abs(x.astype(np.float64))
    tol = 1e-9 * absdot + (2.0 ** -22 * 300 * absdot if fold else 0)   # the model sums in float64
    np.testing.assert_array_less(np.abs(got[:n] - ref), tol + 1e-12)
    assert not got[n:].any(), "padding rows multiply zero codes and zero scales"
