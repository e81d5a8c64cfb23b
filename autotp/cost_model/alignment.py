"""Aligned products: which matrix widths the GPU's fast kernels take, and when the rewrite pads one.

Tensor-core GEMM kernels (cuBLAS, CUTLASS) load their operands in 16-byte vectors. A row-major
operand whose rows are not a whole number of 16-byte vectors long (its leading dimension, in
elements, off a multiple of 8 for bf16/fp16) gets an ``align1`` kernel that loads element by
element: on an H200, GPT-2's 50257-word head ran three ``cutlass_..._align1`` kernels that took 33
of the 64 ms of a 6-layer gpt2-xl step (``../shared/measurements/h200-2026-11-28/``). Megatron pads
the vocabulary to a multiple of 128 x tp for this reason.

For ``y[M, N] = x[M, K] @ W`` (``W`` stored ``[K, N]``, or ``[N, K]`` for ``linear``) the leading
dims of every operand of the forward and of both backward products (``dx = dy @ W^T``,
``dW = x^T @ dy``) are N and K, never M: a product runs aligned when its *local* N and K are
both aligned (:func:`product_aligned`). A split makes the local widths: GPT-2's vocabulary split
8 ways leaves 6282 or 6283 rows per rank.

Where the local N is off (and K is on), the rewrite can run the product padded
(:func:`pads`): the weight's shard gets zero output features up to :func:`aligned_width` of the
widest rank's, the product runs aligned, and its output is sliced back to the real width (a view;
its stride stays aligned, so the backward products are aligned too). The pad never reaches
anything but that product: not the parameter (whose gradient is the slice of the padded one),
not the loss, not the user. What it costs: a copy of the weight shard forward, and the output's
gradient written into a zero-padded buffer backward (the slice's backward). Both are memory
traffic of the size of what the product reads and writes; they pay where the product is bound by
its arithmetic, not by reading its weight (a decode step's few rows): :func:`padding_pays`.

The cost model reads the same functions: a product that runs unaligned (``product_aligned`` is
False and the rewrite does not pad it) runs at its unaligned rate; a padded one at
``aligned_width`` of its N, plus the two copies.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Any

#: the vector width, in bytes, that tensor-core GEMM kernels load operands in
ALIGN_BYTES = 16
#: the element size products are aligned for by default: bf16/fp16, what they train in (under
#: autocast too, whatever the parameters' dtype); aligned for 2 bytes is aligned for any wider dtype
PRODUCT_DTYPE_BYTES = 2


def alignment(dtype_bytes: int = PRODUCT_DTYPE_BYTES) -> int:
    """Elements per aligned vector: 8 for bf16/fp16, 4 for float32, 2 for float64."""
    return ALIGN_BYTES // gcd(ALIGN_BYTES, dtype_bytes)


def aligned(n: int, dtype_bytes: int = PRODUCT_DTYPE_BYTES) -> bool:
    """Whether a row of ``n`` elements is a whole number of 16-byte vectors."""
    return n % alignment(dtype_bytes) == 0


def aligned_width(n: int, dtype_bytes: int = PRODUCT_DTYPE_BYTES) -> int:
    """The smallest aligned width of at least ``n`` elements."""
    unit = alignment(dtype_bytes)
    return -(-n // unit) * unit


def product_aligned(n: int, k: int, dtype_bytes: int = PRODUCT_DTYPE_BYTES) -> bool:
    """Whether ``x[M, K] @ W -> [M, N]`` (local widths ``n`` and ``k``) runs on aligned kernels,
    forward and backward: N and K are every operand's leading dim, M none."""
    return aligned(n, dtype_bytes) and aligned(k, dtype_bytes)


def padding_rows(profile: Any) -> float:
    """The rows (M) from which padding a product pays on ``profile``: its roofline's ridge,
    ``flops * dtype_bytes / mem_bw``. Below it the product is bound by reading its weight, which
    the pad would copy once more (a decode step's lm_head: M is the batch); above it by its
    arithmetic, which the aligned kernel runs several times faster, against copies of the size of
    what the product reads. ``h100-dgx``: 295 rows."""
    return profile.flops * profile.dtype_bytes / profile.mem_bw


def padding_pays(rows: float, profile: Any) -> bool:
    return rows >= padding_rows(profile)


@dataclass(frozen=True)
class Align:
    """The rewrite's choice of which products to pad: those with an unaligned local N and an
    aligned local K, over at least ``min_rows`` rows at the planning workload (0: every one)."""

    min_rows: float = 0.0

    @classmethod
    def for_profile(cls, profile: Any) -> "Align":
        return cls(padding_rows(profile))


def pads(widths: list[int], k_widths: list[int], rows: float, align: Align | None) -> int | None:
    """The width every rank runs a product at, given each rank's local N (``widths``) and K
    (``k_widths``), or None where it runs as it is: padded where ``align`` asks, some rank's N is
    unaligned and every rank's K aligned (padding N does not mend an unaligned K). One width on
    every rank (the widest rank's, aligned), so that the ranks run the same ops."""
    if align is None or rows < align.min_rows:
        return None
    if all(aligned(n) for n in widths) or not all(aligned(k) for k in k_widths):
        return None
    return aligned_width(max(widths))
