"""Device and interconnect profiles.

A profile holds what the cost model prices with: dense compute rate, memory bandwidth, the
TP group's link bandwidth and latency (alpha-beta), and device memory. Figures are per
device, for the datatype a model of that era trains in (fp16/bf16 tensor cores on GPUs).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    flops: float            # dense matmul FLOP/s actually reached
    mem_bw: float           # bytes/s to device memory
    link_bw: float          # bytes/s per device on the TP interconnect (bus bandwidth)
    link_latency: float     # seconds per collective step
    memory: float           # bytes of device memory

    def matmul_time(self, flops: float) -> float:
        return flops / self.flops

    def memory_time(self, nbytes: float) -> float:
        return nbytes / self.mem_bw

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
    # The Megatron-LM paper's machine: V100 32GB in a DGX-2H, NVSwitch 300 GB/s.
    "v100-dgx2h": DeviceProfile("v100-dgx2h", flops=125e12 * 0.5, mem_bw=900e9, link_bw=150e9,
                                link_latency=8e-6, memory=32 * GiB),
    "a100-dgx": DeviceProfile("a100-dgx", flops=312e12 * 0.5, mem_bw=2.0e12, link_bw=240e9,
                              link_latency=6e-6, memory=80 * GiB),
    "h100-dgx": DeviceProfile("h100-dgx", flops=989e12 * 0.5, mem_bw=3.35e12, link_bw=370e9,
                              link_latency=5e-6, memory=80 * GiB),
    # Local CPU ranks over gloo on loopback.
    "cpu-gloo": DeviceProfile("cpu-gloo", flops=50e9, mem_bw=10e9, link_bw=2e9,
                              link_latency=50e-6, memory=16 * GiB),
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
            f"unknown device profile {profile!r}; choose one of {sorted(PROFILES)} or pass a DeviceProfile"
        ) from None
