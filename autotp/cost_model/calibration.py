"""Calibration: a :class:`.devices.DeviceProfile` measured on the machine at hand (the CPU and gloo,
or a GPU), every figure the cost model prices with, by :mod:`.measure`'s timings. Above both the
profiles and the op prices (:mod:`.symbolic`): a grouped product's streamed weights are what its
measured time leaves beyond the product model's price of it."""
from __future__ import annotations

import os
from typing import Sequence

from ..errors import ConfigError
from .devices import GiB, DeviceProfile, get_profile
from .work import Product
from .measure import (fit_alpha_beta, fit_product_shape, measure_all_reduce, measure_attention, measure_grouped,
                      measure_host_read, measure_launch, measure_matmul_flops, measure_memory_bandwidth,
                      measure_op_classes, measure_products, measure_sort_pass)
from .symbolic import grouped_stream_bytes, product_seconds


def _all_reduce_task(message_bytes, repeats):
    return measure_all_reduce(message_bytes, repeats)


def _physical_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16.0 * GiB


def calibrate(name: str = "calibrated", *, world: int = 2, matmul_sizes: Sequence[int] = (256, 512),
              message_bytes: Sequence[int] = (1 << 12, 1 << 16, 1 << 20), repeats: int = 3,
              group=None, memory: float | None = None, device: str = "cpu",
              link_from: str | DeviceProfile | None = None) -> DeviceProfile:
    """Measure a CPU + gloo profile on this machine, or (``device="cuda"``) a GPU's: every figure
    the cost model prices with (see :class:`DeviceProfile` and :mod:`.measure`).

    Products: the best rate of square products of ``matmul_sizes`` (the peak), then a small one
    and a shallow one (the shape constants), and one with an unaligned leading dim; a grouped
    product's forward + backward over many small experts beyond the product model's price of it
    (``grouped_bw``). Memory: a
    large copy's bandwidth, then each memory-bound op class's share of it, and a tiny kernel's
    launch. Attention: causal ``scaled_dot_product_attention`` at head dim 128 and 64, with and
    without dropout.

    Inside an initialized process group pass ``group`` (every rank must call); otherwise
    ``world`` local gloo ranks are spawned for the collectives. The fit is alpha-beta over
    ``message_bytes``: use sizes that span latency- and bandwidth-bound messages.

    On a GPU the rates are bf16's (the training datatype: ``dtype_bytes=2``), measured on
    ``matmul_sizes`` (pass sizes a GPU fills, e.g. 4096 and 8192), and the memory is the
    device's. The link is timed over ``group`` when given (one GPU per rank, NCCL); without a
    group the link figures are ``link_from``'s (a profile of the same interconnect), since
    ranks sharing one GPU would time the host, not the GPUs' link.
    """
    import torch

    gpu = device != "cpu"
    if gpu and group is None and link_from is None:   # before any measurement: a minute saved on a bad call
        raise ConfigError("calibrate(device=...) without a group of one GPU per rank cannot time the link: "
                          "pass group= (NCCL) or link_from= (a profile of the same interconnect)")
    import torch.distributed as dist

    in_world = group is not None or (dist.is_available() and dist.is_initialized())
    if not gpu and world < 2 and not in_world:
        raise ConfigError(f"calibrate needs at least 2 ranks to time collectives, got world={world}")
    dtype = torch.bfloat16 if gpu else torch.float32
    flops = measure_matmul_flops(matmul_sizes, repeats, device=device, dtype=dtype)
    mem_bw = measure_memory_bandwidth((1 << 28) if gpu else (1 << 22), repeats, device=device, dtype=dtype)
    shape = _measure_shape(flops, device, dtype, repeats, big=max(matmul_sizes))
    classes = measure_op_classes(device, dtype, numel=(1 << 26) if gpu else (1 << 20), repeats=repeats)
    att128, att64 = measure_attention(device, dtype, seq=4096 if gpu else 256, repeats=repeats)
    dropped, _ = measure_attention(device, dtype, seq=4096 if gpu else 256, repeats=repeats, dropout=0.1)
    launch_s = measure_launch(device)
    common = dict(launch_s=launch_s, sync_s=measure_host_read(device), attention_flops=att128,
                  sort_pass_s=measure_sort_pass(launch_s, classes["sort"] / classes["elementwise"] * mem_bw, device),
                  attention_dropout=min(1.0, dropped / att128),
                  # shares of a plain add's bandwidth measured alike (the large copy sets mem_bw)
                  class_bw=tuple((c, round(bw / classes["elementwise"], 3)) for c, bw in classes.items()),
                  grouped_bw=_grouped_bw(flops, mem_bw, shape, device, dtype, repeats, 2 if gpu else 4),
                  **shape)
    if gpu:
        if memory is None:
            memory = float(torch.cuda.get_device_properties(torch.device(device)).total_memory)
        if group is not None:
            alpha, link_bw = fit_alpha_beta(message_bytes, measure_all_reduce(message_bytes, repeats, group, device),
                                            dist.get_world_size(group))
        else:
            base = get_profile(link_from)
            alpha, link_bw = base.link_latency, base.link_bw
        return DeviceProfile(name, flops=flops, mem_bw=mem_bw, link_bw=link_bw, link_latency=alpha, memory=memory,
                             dtype_bytes=2, **common)
    if in_world:
        n = dist.get_world_size(group)
        seconds = measure_all_reduce(message_bytes, repeats, group)
    else:
        from ..distributed.launch import launch

        n = world
        seconds = launch(_all_reduce_task, world, list(message_bytes), repeats)[0]
    alpha, link_bw = fit_alpha_beta(message_bytes, seconds, n)
    return DeviceProfile(name, flops=flops, mem_bw=mem_bw, link_bw=link_bw, link_latency=alpha,
                         memory=memory if memory is not None else _physical_memory(), dtype_bytes=4,
                         dropout_mask_bytes=0, **common)


def _measure_shape(peak: float, device: str, dtype, repeats: int, big: int) -> dict[str, float]:
    """The product model's shape constants and unaligned rate, from three measured products: a
    small square one, a shallow one (contracting 32) and one whose leading dims are odd."""
    small, shallow = (big // 4, big // 4, big // 4), (big, big, 32)
    odd = (big, big + 1, big + 1)
    small_rate, shallow_rate, odd_rate = measure_products((small, shallow, odd), device, dtype, repeats)
    half_work, half_k = fit_product_shape(peak, small, small_rate, shallow, shallow_rate)
    aligned_rate = peak * (lambda w, k: w / (w + w * half_k / k + half_work))(odd[0] * odd[1] * odd[2], odd[2])
    return dict(product_half_work=half_work, product_half_k=half_k,
                unaligned_flops=peak if odd_rate >= 0.9 * aligned_rate else odd_rate)


#: the grouped product ``calibrate`` times (experts, rows each, k, n): a 128-expert top-8 layer's
#: share of a few thousand tokens, each expert's weights read for a few rows
GROUPED_SHAPE = (64, 32, 512, 512)


def _grouped_bw(peak: float, mem_bw: float, shape: dict, device: str, dtype, repeats: int, eb: int) -> float:
    """``grouped_bw``: the weights a grouped product's forward + backward at :data:`GROUPED_SHAPE`
    streams (:func:`.symbolic.grouped_stream_bytes`) over its measured time
    (:func:`.measure.measure_grouped`) beyond the product model's price of its products (this
    calibration's peak, shape constants and memory bandwidth); 0 where it measures no slower."""
    import sympy

    base = DeviceProfile("model", flops=peak, mem_bw=mem_bw, link_bw=1.0, link_latency=0.0, memory=0.0, **shape)
    groups, rows, k, n = GROUPED_SHAPE
    g, m, kk, nn = (sympy.Integer(v) for v in GROUPED_SHAPE)
    passes = (Product(m, nn, kk, g, streamed=kk * nn), Product(m, kk, nn, g, streamed=kk * nn),
              Product(kk, nn, m, g, streamed=kk * nn))
    modelled = sum(product_seconds(p, {}, base, eb)[0] for p in passes)
    beyond = measure_grouped(groups, rows, k, n, device, dtype, repeats) - modelled
    streamed = sum(grouped_stream_bytes(p, {}, eb) for p in passes)
    return streamed / beyond if beyond > 0 else 0.0
