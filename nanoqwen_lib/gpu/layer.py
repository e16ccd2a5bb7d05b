"""The decode step and the prefill, region by region: the one description of what a token
runs and reads.

A region is a named part of the step. The engine writes each layer once from these regions
(GpuBackend.layer_launches for decode, prefill_launches for the prompt), the ITL breakdown
times them (measure.breakdown), and each region's floor is what it must read over the read
ceiling (decode_region_bytes). Nothing here needs a GPU: the CPU tests, the benchmark and the
chapters read the same list.

    step     bookkeeping, embed, num_layers x LAYER, HEAD, bookkeeping
    LAYER    norm, qkv, rope + append K/V, attention, o_proj (+residual), norm, gate_up,
             SwiGLU + down (+residual)
    HEAD     final norm, lm_head + argmax (the argmax is fused into lm_head's last CTA)

A projection region reads its matrix in the file's weight encoding
(format.layout.projection_bytes); what the encoding changes is the projection object's
business (gpu.projection), never the layer's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from nanoqwen_lib.config import ModelDims, load
from nanoqwen_lib.format.layout import decode_gemv_shapes, projection_bytes

FP16_BYTES = 2


def _nothing(dims: ModelDims, context_tokens: int) -> int:
    return 0


@dataclass(frozen=True)
class Region:
    """A part of the step: its name in decode (the breakdown's row), its name in the
    prefill (None: decode only), what it does in words, the layer matrix it multiplies (a
    key of layout.decode_gemv_shapes), what else it must read (weights, K/V) and the
    activations it reads and writes, each as bytes(dims, context_tokens)."""
    name: str
    prefill: str | None
    what: str
    matrix: str | None = None
    reads: Callable[[ModelDims, int], int] = _nothing
    activations: Callable[[ModelDims, int], int] = _nothing
    work: Callable[[ModelDims, int, int], int] = lambda dims, tokens, start: 0   # FLOPs besides a matrix

    def bytes(self, dims: ModelDims, context_tokens: int, encoding: str) -> int:
        """What one occurrence must read from device memory at a context of `context_tokens`
        (weights and K/V; activations left out, as in layout.bytes_per_decode_token): the
        region's floor is this over the read ceiling."""
        own = self.reads(dims, context_tokens)
        if self.matrix is not None:
            own += projection_bytes(encoding, *decode_gemv_shapes(dims)[self.matrix])
        return own

    def flops(self, dims: ModelDims, tokens: int, start: int = 0) -> int:
        """Multiply-add work (2 FLOP each) of one occurrence in a prefill of `tokens` rows
        that follow `start` earlier ones: its matrix for every row; causal attention over
        the triangle (QK^T and PV, every head); 0 for the elementwise regions."""
        if self.matrix is not None:
            n, k = decode_gemv_shapes(dims)[self.matrix]
            return 2 * n * k * tokens
        return self.work(dims, tokens, start)

    def traffic(self, dims: ModelDims, context_tokens: int, encoding: str) -> int:
        """Everything one occurrence reads and writes: bytes() plus its activations."""
        return self.bytes(dims, context_tokens, encoding) + self.activations(dims, context_tokens)


def _kv_reads(dims: ModelDims, context_tokens: int) -> int:
    return 2 * dims.kv_dim * load().kv_cache.dtype_bytes * context_tokens


def _attention_flops(dims: ModelDims, tokens: int, start: int) -> int:
    """QK^T and PV for every head over the causal (query, key) pairs of a chunk."""
    pairs = tokens * start + tokens * (tokens + 1) // 2
    return 2 * 2 * dims.num_heads * dims.head_dim * pairs


F = FP16_BYTES
BOOKKEEPING = Region("step bookkeeping", None, "slot, context length, page pop; the token")
EMBED = Region("embed", "embed", "embed", reads=lambda d, c: d.hidden * F,
               activations=lambda d, c: d.hidden * F)
NORM_IN = Region("norms", "norms", "rmsnorm (input)", reads=lambda d, c: d.hidden * F,
                 activations=lambda d, c: 2 * d.hidden * F)                          # x in, y out
QKV = Region("qkv_gemv", "qkv_gemm", "qkv GEMV + bias", "qkv", reads=lambda d, c: d.qkv_dim * F,
             activations=lambda d, c: (d.hidden + d.qkv_dim) * F)                    # y in, qkv out
ROPE = Region("rope_append_kv", "rope_write_kv", "RoPE + append K/V",
              activations=lambda d, c: (d.qkv_dim + d.q_dim + 2 * d.kv_dim) * F)    # qkv in; q, k, v out
ATTENTION = Region("paged_attention", "prefill_attention", "paged attention", reads=_kv_reads, work=_attention_flops,
                   activations=lambda d, c: 2 * d.q_dim * F)                         # q in, attn out
O_PROJ = Region("o_proj", "o_proj_gemm", "o_proj GEMV + residual", "o_proj",
                activations=lambda d, c: (d.q_dim + 2 * d.hidden) * F)               # attn, x in; x out
NORM_MLP = Region("norms", "norms", "rmsnorm (post-attention)", reads=lambda d, c: d.hidden * F,
                  activations=lambda d, c: 2 * d.hidden * F)
GATE_UP = Region("gate_up_gemv", "gate_up_gemm", "gate/up GEMV", "gate_up",
                 activations=lambda d, c: (d.hidden + 2 * d.intermediate) * F)       # y in, gate_up out
DOWN = Region("swiglu_down", "swiglu_down_gemm", "SwiGLU + down GEMV + residual", "down",
              activations=lambda d, c: (2 * d.intermediate + 2 * d.hidden) * F)      # gate_up, x in; x out
NORM_OUT = Region("norms", None, "final rmsnorm", reads=lambda d, c: d.hidden * F,
                  activations=lambda d, c: 2 * d.hidden * F)
LM_HEAD = Region("lm_head+argmax", None, "lm_head + argmax", reads=lambda d, c: d.vocab * d.hidden * F,
                 activations=lambda d, c: d.hidden * F + d.vocab * 4)                # y in, fp32 logits out

LAYER = (NORM_IN, QKV, ROPE, ATTENTION, O_PROJ, NORM_MLP, GATE_UP, DOWN)
HEAD = (NORM_OUT, LM_HEAD)


def step_regions(dims: ModelDims) -> list[Region]:
    """Every region of one decode step, in launch order (GpuBackend.step_launches)."""
    return [BOOKKEEPING, EMBED, *LAYER * dims.num_layers, *HEAD, BOOKKEEPING]


def prefill_regions(dims: ModelDims) -> list[Region]:
    """Every region of one prefill chunk, in launch order (GpuBackend.prefill_launches)."""
    return [EMBED, *LAYER * dims.num_layers]


def prefill_region_flops(dims: ModelDims, tokens: int, start: int = 0) -> dict[str, int]:
    """Prefill region name -> FLOPs of all its occurrences in one chunk of `tokens` rows
    after `start` earlier ones; each region's floor is this over the tensor-core ceiling
    (the prefill breakdown's table). The projections and attention add up to
    layout.prefill_flops' (less the lm_head's last row, which the first decode step runs)."""
    out: dict[str, int] = {}
    for r in prefill_regions(dims):
        out[r.prefill] = out.get(r.prefill, 0) + r.flops(dims, tokens, start)
    return out


def decode_region_bytes(dims: ModelDims, context_tokens: int, encoding: str = "int4") -> dict[str, int]:
    """Region name -> the bytes all its occurrences in one decode token must read. Its total
    is layout.bytes_per_decode_token's; each region's floor is its bytes over the read
    ceiling (the ITL breakdown's table)."""
    out: dict[str, int] = {}
    for r in step_regions(dims):
        out[r.name] = out.get(r.name, 0) + r.bytes(dims, context_tokens, encoding)
    return out
