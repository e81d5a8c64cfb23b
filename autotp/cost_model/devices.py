"""Device and interconnect profiles, and calibration on the machine at hand.

A profile holds what the cost model prices with: dense compute rate, memory bandwidth, the
TP group's link bandwidth and latency (alpha-beta), device memory, and the datatype the
figures are for. GPU figures are per device for the datatype a model of that era trains in
(fp16/bf16 tensor cores: ``dtype_bytes=2``); the CPU profile is float32. The cost model
prices every floating-point tensor at ``dtype_bytes``, so bytes and FLOP rates agree.

``calibrate()`` measures a profile instead: the best rate of a few square matrix products,
the bandwidth of a large elementwise add, and a least-squares alpha-beta fit of ring
all-reduce times over a few message sizes on a local process group (gloo on CPU).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Sequence

from ..cached_hash import cached_hash, state_without_hash
from ..errors import ConfigError


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    flops: float            # dense matmul FLOP/s actually reached
    mem_bw: float           # bytes/s to device memory
    link_bw: float          # bytes/s per device on the TP interconnect (bus bandwidth)
    link_latency: float     # seconds per collective step
    memory: float           # bytes of device memory
    dtype_bytes: int = 2    # bytes per element of the training datatype the rates are for
    #: bytes per parameter a training step keeps: mixed-precision Adam holds the weight and
    #: its gradient in the training dtype plus an fp32 master copy and two fp32 moments
    #: (2 + 2 + 4 + 4 + 4 = 16; in float32, 4 + 4 + 4 + 4 = 16 as well)
    state_bytes_per_param: int = 16

    __hash__ = cached_hash   # a profile keys the index's cost caches, one lookup per strategy
    __getstate__ = state_without_hash

    def matmul_time(self, flops: float) -> float:
        return flops / self.flops

    def memory_time(self, nbytes: float) -> float:
        return nbytes / self.mem_bw

    def update_time(self, numel: float) -> float:
        """Seconds an optimizer step spends on ``numel`` parameters held on a rank: AdamW is
        memory-bound, reading and writing each parameter's whole training state once (weight,
        gradient, master copy, two moments: ``state_bytes_per_param`` each way). This is what a
        replicated table costs every step beyond its memory, and what a split saves."""
        return 2 * self.state_bytes_per_param * numel / self.mem_bw

    def all_reduce_time(self, nbytes: float, n: int) -> float:
        """Ring all-reduce: 2(n-1)/n of the bytes cross each link, in 2(n-1) steps."""
        if n <= 1:
            return 0.0
        return 2 * (n - 1) * self.link_latency + 2 * (n - 1) / n * nbytes / self.link_bw

    def all_gather_time(self, full_bytes: float, n: int) -> float:
        """Ring all-gather (or reduce-scatter) of a tensor of ``full_bytes``: (n-1)/n of it."""
        if n <= 1:
            return 0.0
        return (n - 1) * self.link_latency + (n - 1) / n * full_bytes / self.link_bw


GiB = 1024 ** 3

PROFILES: dict[str, DeviceProfile] = {
    # The Megatron-LM paper's machine: V100 32GB in a DGX-2H, NVSwitch 300 GB/s. FLOP rates
    # are half the fp16 tensor-core peak: what large GEMMs sustain in a training step. The
    # link figure is the NCCL bus bandwidth a ring reaches; the latency is per ring step
    # (NCCL's small-message all-reduce over 8 GPUs takes tens of microseconds in all).
    "v100-dgx2h": DeviceProfile("v100-dgx2h", flops=125e12 * 0.5, mem_bw=900e9, link_bw=150e9,
                                link_latency=2e-6, memory=32 * GiB, dtype_bytes=2),
    "a100-dgx": DeviceProfile("a100-dgx", flops=312e12 * 0.5, mem_bw=2.0e12, link_bw=240e9,
                              link_latency=1.5e-6, memory=80 * GiB, dtype_bytes=2),
    "h100-dgx": DeviceProfile("h100-dgx", flops=989e12 * 0.5, mem_bw=3.35e12, link_bw=370e9,
                              link_latency=1e-6, memory=80 * GiB, dtype_bytes=2),
    # Local CPU ranks over gloo on loopback, float32.
    "cpu-gloo": DeviceProfile("cpu-gloo", flops=50e9, mem_bw=10e9, link_bw=2e9,
                              link_latency=50e-6, memory=16 * GiB, dtype_bytes=4),
}


def get_profile(profile: str | DeviceProfile | None) -> DeviceProfile:
    if isinstance(profile, DeviceProfile):
        return profile
    if profile is None:
        return PROFILES["h100-dgx"]
    try:
        return PROFILES[profile]
    except KeyError:
        raise ConfigError(
            f"unknown device profile {profile!r}; choose one of {sorted(PROFILES)}, pass a DeviceProfile, "
            "or measure one with autotp.cost_model.calibrate()"
        ) from None


# ---- calibration ------------------------------------------------------------------------------
def _best_time(fn, repeats: int) -> float:
    fn()  # warm up (allocations, thread pools)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def measure_matmul_flops(sizes: Sequence[int] = (256, 512), repeats: int = 3, device: str = "cpu",
                         dtype=None) -> float:
    """Best FLOP/s of square ``mm`` over ``sizes``."""
    import torch

    dtype = dtype or torch.float32
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)

        def run():
            torch.mm(a, b, out=out)
            sync()

        best = max(best, 2 * n ** 3 / _best_time(run, repeats))
    return best


def measure_memory_bandwidth(numel: int = 1 << 22, repeats: int = 3, device: str = "cpu", dtype=None) -> float:
    """Bytes/s of ``c = a + b`` on ``numel`` elements (two reads and a write)."""
    import torch

    dtype = dtype or torch.float32
    a, b = torch.randn(numel, device=device, dtype=dtype), torch.randn(numel, device=device, dtype=dtype)
    c = torch.empty_like(a)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)

    def run():
        torch.add(a, b, out=c)
        sync()

    return 3 * numel * a.element_size() / _best_time(run, repeats)


def measure_all_reduce(message_bytes: Sequence[int], repeats: int = 3, group=None,
                       device: str = "cpu") -> list[float]:
    """Best seconds of an all-reduce of each message size on ``group`` (every rank must call)."""
    import torch
    import torch.distributed as dist

    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    times = []
    for nbytes in message_bytes:
        x = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        dist.barrier(group=group)

        def run():
            dist.all_reduce(x, group=group)
            sync()

        times.append(_best_time(run, repeats))
    # the slowest rank sets the pace of a collective
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def fit_alpha_beta(message_bytes: Sequence[float], seconds: Sequence[float], n: int) -> tuple[float, float]:
    """(latency per step, link bytes/s) of ring all-reduce, least squares on
    ``t = 2(n-1)·alpha + 2(n-1)/n·B / bw``; both kept positive."""
    # normal equations of the 2-parameter fit, by hand (no numpy dependency)
    steps = 2 * (n - 1)
    xs = [steps / n * b for b in message_bytes]
    m, sx, sy = len(xs), sum(xs), sum(seconds)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, seconds))
    det = m * sxx - sx * sx
    if det == 0:
        raise ConfigError("calibrate needs at least two different message sizes")
    inv_bw = (m * sxy - sx * sy) / det
    alpha = (sy - inv_bw * sx) / m / steps
    alpha = max(float(alpha), 1e-9)
    if inv_bw <= 0:   # all sizes cost the same: the link is faster than we can measure
        inv_bw = 1e-15
    return alpha, 1.0 / float(inv_bw)


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
    """Measure a CPU + gloo profile on this machine, or (``device="cuda"``) a GPU's.

    Inside an initialized process group pass ``group`` (every rank must call); otherwise
    ``world`` local gloo ranks are spawned for the collectives. The fit is alpha-beta over
    ``message_bytes``: use sizes that span latency- and bandwidth-bound messages.

    On a GPU the rates are bf16's (the training datatype: ``dtype_bytes=2``), measured on
    ``matmul_sizes`` (pass sizes a GPU fills, e.g. 4096 and 8192), and the memory is the
    device's. The link is timed over ``group`` when given (one GPU per rank, NCCL); without a
    group the link figures are ``link_from``'s (a profile of the same interconnect), since
    ranks sharing one GPU would time the host, not the GPUs' link.
    """
    if device != "cpu":
        return _calibrate_gpu(name, device, matmul_sizes, message_bytes, repeats, group, memory, link_from)
    import torch.distributed as dist

    if world < 2 and group is None:
        raise ConfigError(f"calibrate needs at least 2 ranks to time collectives, got world={world}")
    flops = measure_matmul_flops(matmul_sizes, repeats)
    mem_bw = measure_memory_bandwidth(repeats=repeats)
    if group is not None or (dist.is_available() and dist.is_initialized()):
        n = dist.get_world_size(group)
        seconds = measure_all_reduce(message_bytes, repeats, group)
    else:
        from ..testing.ranks import launch

        n = world
        seconds = launch(_all_reduce_task, world, list(message_bytes), repeats)[0]
    alpha, link_bw = fit_alpha_beta(message_bytes, seconds, n)
    return DeviceProfile(name, flops=flops, mem_bw=mem_bw, link_bw=link_bw, link_latency=alpha,
                         memory=memory if memory is not None else _physical_memory(), dtype_bytes=4)


def _calibrate_gpu(name, device, matmul_sizes, message_bytes, repeats, group, memory, link_from) -> DeviceProfile:
    import torch

    if group is None and link_from is None:   # before any measurement: a minute saved on a bad call
        raise ConfigError("calibrate(device=...) without a group of one GPU per rank cannot time the link: "
                          "pass group= (NCCL) or link_from= (a profile of the same interconnect)")
    dtype = torch.bfloat16
    flops = measure_matmul_flops(matmul_sizes, repeats, device=device, dtype=dtype)
    mem_bw = measure_memory_bandwidth(1 << 28, repeats, device=device, dtype=dtype)
    if memory is None:
        memory = float(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    if group is not None:
        import torch.distributed as dist

        alpha, link_bw = fit_alpha_beta(message_bytes, measure_all_reduce(message_bytes, repeats, group, device),
                                        dist.get_world_size(group))
    else:
        base = get_profile(link_from)
        alpha, link_bw = base.link_latency, base.link_bw
    return DeviceProfile(name, flops=flops, mem_bw=mem_bw, link_bw=link_bw, link_latency=alpha, memory=memory,
                         dtype_bytes=2)


def with_memory(profile: DeviceProfile, memory: float) -> DeviceProfile:
    """The same profile with another device memory (for planning under a tighter budget)."""
    return replace(profile, memory=float(memory))
