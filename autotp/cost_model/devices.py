"""Device and interconnect profiles, and calibration on the machine at hand.

A profile holds what the cost model prices with: dense compute rate, memory bandwidth, the
TP group's link bandwidth and latency (alpha-beta), device memory, and the datatype the
figures are for, and how fast each kind of kernel runs (products by their shape, memory-bound
op classes, attention, a launch). GPU figures are per device for the datatype a model of that
era trains in (fp16/bf16 tensor cores: ``dtype_bytes=2``); the CPU profile is float32. The cost
model prices a floating-point tensor in the model's training dtype at ``dtype_bytes``, so bytes
and FLOP rates agree.

``calibrate()`` (:mod:`.calibration`) measures a profile instead (:mod:`.measure`): the best rate of a few square
matrix products and the shape constants of smaller ones, the bandwidth of a large elementwise
add and each memory-bound op class's share of it, a kernel's launch, fused attention's rate, and
a least-squares alpha-beta fit of ring all-reduce times over a few message sizes on a local
process group (gloo on CPU).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..cached_hash import cached_hash, state_without_hash
from ..errors import ConfigError
from .measure import fit_alpha_beta  # noqa: F401


@dataclass(frozen=True)
class DeviceProfile:
    """What the cost model prices with (see :mod:`.symbolic` and :mod:`.kernels`).

    Products: ``flops`` is the rate of a large aligned matrix product; a product of ``W`` =
    m·n·k multiply-adds reaches ``W/(W + W·product_half_k/k + product_half_work)`` of it
    (small and skinny products run below peak), and a product whose leading dims are not
    16-byte multiples runs at ``unaligned_flops`` (cuBLAS's ``align1`` kernels). Fused attention
    runs at ``attention_flops`` with a head dim of 128, ``sqrt(d/128)`` of it for a smaller one,
    and ``attention_dropout`` of that where it draws dropout. Memory-bound kernels move their
    bytes at ``mem_bw`` times their class's share (``class_bw``: elementwise, cast, reduction,
    softmax, norm, random, scatter, sort; ``strided`` and ``broadcast``: elementwise kernels on a
    strided operand or on one broadcast against the output, PyTorch's non-vectorized path on a
    GPU; a profile without a ``broadcast`` share prices those at its ``strided`` one), and every
    kernel costs ``launch_s`` more.

    A grouped product (a mixture of experts' experts, each over its own rows) costs its
    products at the product model's rate plus its experts' weights (read forward and for the
    input's gradient, their gradient written) streamed at ``grouped_bw``: each expert's matrix
    is read for its few rows and left, where one product of the same shape keeps its operands
    in cache, and where no fused kernel takes the dtype each expert is a call of its own. ``calibrate`` measures it from a grouped product of
    many small experts (:data:`GROUPED_SHAPE`): its time beyond the product model's price, per
    byte of weights; 0 prices no stream (a profile without the measurement).

    A sort is a radix sort (CUB's onesweep, what ``torch.sort`` runs on a GPU): its passes move
    their bytes at the ``sort`` class's share, and each pass costs ``sort_pass_s`` more than its
    launch (the pass waits on every earlier tile's digit counts, the decoupled look-back): the
    routing's sorts, thousands to a few hundred thousand ids, are mostly that wait.

    A read of a device value on the host (a rank counting its own experts' rows) costs
    :meth:`host_read_time`: the host stops queueing until the device has run everything queued
    before the read, then ``sync_s`` (the device-to-host round trip of a few bytes and the host
    waking), then the device waits for the host to issue the next kernel (a launch). The queue it
    drains was work the device had to do anyway; what the step loses is the overlap of host and
    device over that gap.
    """

    name: str
    flops: float            # dense matmul FLOP/s of a large aligned product
    mem_bw: float           # bytes/s to device memory (a large copy, reads and writes counted)
    link_bw: float          # bytes/s per device on the TP interconnect (bus bandwidth)
    link_latency: float     # seconds per collective step
    memory: float           # bytes of device memory
    dtype_bytes: int = 2    # bytes per element of the training datatype the rates are for
    #: bytes per parameter a training step keeps: mixed-precision Adam holds the weight and
    #: its gradient in the training dtype plus an fp32 master copy and two fp32 moments
    #: (2 + 2 + 4 + 4 + 4 = 16; in float32, 4 + 4 + 4 + 4 = 16 as well)
    state_bytes_per_param: int = 16
    launch_s: float = 0.0                 # seconds each kernel costs beyond its work
    unaligned_flops: float = 0.0          # FLOP/s of a product with an unaligned leading dim (0: flops)
    product_half_work: float = 0.0        # multiply-adds at which a product reaches half the rate
    product_half_k: float = 0.0           # contracted length at which a product reaches half the rate
    attention_flops: float = 0.0          # FLOP/s of fused attention, head dim 128 (0: flops)
    attention_dropout: float = 1.0        # ... the share of it left when attention draws dropout
    class_bw: tuple = ()                  # ((class, share of mem_bw), ...) for memory-bound kernels
    sync_s: float = 0.0                   # seconds a read to the host takes once the device is idle
    grouped_bw: float = 0.0               # bytes/s a grouped product streams its experts' weights at (0: free)
    sort_pass_s: float = 0.0              # seconds a radix-sort pass costs beyond its launch and bytes
    #: bytes per element of the mask dropout keeps for backward: 1 on CUDA (``native_dropout``'s
    #: bool mask); 0 on CPU, whose ``dropout`` keeps a float noise tensor of the input's size
    dropout_mask_bytes: int = 1

    __hash__ = cached_hash   # a profile keys the index's cost caches, one lookup per strategy
    __getstate__ = state_without_hash

    def matmul_time(self, flops: float) -> float:
        return flops / self.flops

    def memory_time(self, nbytes: float) -> float:
        return nbytes / self.mem_bw

    def bandwidth(self, op_class: str) -> float:
        """Bytes/s a memory-bound kernel of ``op_class`` attains."""
        shares = dict(self.class_bw)
        if op_class == "broadcast" and op_class not in shares:   # a profile from before the two were told apart
            op_class = "strided"
        return shares.get(op_class, 1.0) * self.mem_bw

    def product_rate(self, work: float, k: float, aligned: bool = True) -> float:
        """FLOP/s of a product of ``work`` multiply-adds contracting ``k``: at peak, its time is
        ``work + work·product_half_k/k + product_half_work`` multiply-adds' (each output element
        costs ``product_half_k`` more, the product ``product_half_work`` more), so a product's time
        never falls as any of its dims grows. (The factors' product, ``(W + w0)(k + k0)/k``, fell
        with ``k`` where ``W·k < w0·k0``: a tiny product contracting more cost less.)"""
        peak = self.flops if aligned or not self.unaligned_flops else min(self.flops, self.unaligned_flops)
        if work <= 0:
            return peak
        depth = work * self.product_half_k / k if self.product_half_k else 0.0
        return peak * work / (work + depth + self.product_half_work)

    def attention_rate(self, head_dim: int, dropout: bool) -> float:
        rate = (self.attention_flops or self.flops) * min(1.0, max(head_dim, 1) / 128) ** 0.5
        return rate * (self.attention_dropout if dropout else 1.0)

    def host_read_time(self) -> float:
        """Seconds a step loses to one read of a device value on the host (see the class docs):
        the round trip once the queue is drained, and the device idle while the host issues the
        next kernel. Nothing where the host is the device (``sync_s`` 0: a CPU profile)."""
        return self.sync_s + self.launch_s if self.sync_s else 0.0

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

    def all_to_all_time(self, full_bytes: float, n: int) -> float:
        """All-to-all of a tensor of ``full_bytes`` dealt evenly over the ranks (an expert
        dispatch): each rank keeps 1/n of its share and sends the rest, (n-1)/n² of the whole."""
        if n <= 1:
            return 0.0
        return (n - 1) * self.link_latency + (n - 1) / n ** 2 * full_bytes / self.link_bw

    def all_gather_time(self, full_bytes: float, n: int) -> float:
        """Ring all-gather (or reduce-scatter) of a tensor of ``full_bytes``: (n-1)/n of it."""
        if n <= 1:
            return 0.0
        return (n - 1) * self.link_latency + (n - 1) / n * full_bytes / self.link_bw


GiB = 1024 ** 3

#: Measured on one H200 (``../shared/measurements/h200-2026-11-28/``, bf16): the share of the
#: copy bandwidth each class of memory-bound kernel attains (elementwise ``mul``/``add`` 4.1 TB/s
#: of 4.07 in the vectorized kernels, 1.9 in the non-vectorized ones PyTorch runs where an operand
#: is strided or broadcast (Llama's norms and rotary); casts' ``direct_copy`` 3.1; the loss's float32 log-softmax 2.1 forward and 3.0
#: backward; reductions (the biases' gradients over the tokens 1.7, a norm's mean over the width
#: 3.4); ``native_layer_norm`` and its backward 1.1-1.8; ``native_dropout`` 2.7;
#: ``embedding_dense_backward``'s sorted scatter 0.2-0.35), and the shape of its products
#: (``benchmarks/gpu.md``: 284 TFLOP/s at 2048 x 1024 x 1024 up to 792 at 2048 x 4096 x 16384;
#: GPT-2's unaligned vocabulary: 97-142 TFLOP/s in ``align1`` kernels) and attention (cuDNN's
#: flash kernels at head dim 128 ~355 TFLOP/s of the FLOPs a causal mask leaves, 0.74 of that at
#: head dim 64, and 0.74 again with attention dropout).
H200_CLASS_BW = (("elementwise", 1.0), ("strided", 0.5), ("cast", 0.77), ("reduction", 0.6), ("softmax", 0.6), ("norm", 0.35),
                 ("random", 0.66), ("scatter", 0.07), ("sort", 0.9))
#: A radix sort's pass beyond its launch and bytes: embedding backward's sort of 8192 int64 indices
#: with their positions on the H200 (``ops-and-sequence-parallel.json``): 8 onesweep passes of
#: 6.1 and 7.6 us, against 2 us of launch and 0.07 us of bytes each; the bytes of a large sort
#: move near the copy rate (memory-bound passes: ``sort``'s 0.9, a published onesweep benchmark's
#: 67M int32 pairs at about 0.9 of an RTX 5090's bandwidth; not measured on the H200)
H200_SORT_PASS_S = 4.8e-6
#: A read to the host once the device is idle: a copy of a few bytes device to host and the
#: host's wait on it, about 10 us on PCIe-attached GPUs of these generations (CUDA's
#: small-transfer latency); not measured on the H200 here: ``calibrate(device="cuda")`` does
GPU_SYNC_S = 10e-6
#: the H200's measured best large bf16 product and copy bandwidth against its datasheet peak
#: (754 of 989 TFLOP/s, 4.07 of 4.8 TB/s): the devices autotp has no measurement of take their
#: datasheet figures times these, and the H200's shares and shape constants
GEMM_OF_PEAK = 754 / 989
COPY_OF_PEAK = 4.07 / 4.8


def datasheet_profile(name: str, peak_flops: float, peak_bw: float, link_bw: float, link_latency: float,
                      memory: float) -> DeviceProfile:
    """A GPU profile from its datasheet, with the H200's measured ratios (see :data:`GEMM_OF_PEAK`)."""
    flops = peak_flops * GEMM_OF_PEAK
    return DeviceProfile(name, flops=flops, mem_bw=peak_bw * COPY_OF_PEAK, link_bw=link_bw,
                         link_latency=link_latency, memory=memory, dtype_bytes=2, launch_s=2e-6,
                         unaligned_flops=flops * 120 / 754, product_half_work=2.5e9, product_half_k=100.0,
                         attention_flops=flops * 355 / 754, attention_dropout=0.74, class_bw=H200_CLASS_BW,
                         sync_s=GPU_SYNC_S, sort_pass_s=H200_SORT_PASS_S)


PROFILES: dict[str, DeviceProfile] = {
    # The Megatron-LM paper's machine: V100 32GB in a DGX-2H, NVSwitch 300 GB/s (fp16 tensor
    # cores: 125 TFLOP/s peak, 900 GB/s). The link figure is the NCCL bus bandwidth a ring
    # reaches; the latency is per ring step (NCCL's small-message all-reduce over 8 GPUs takes
    # tens of microseconds in all).
    "v100-dgx2h": datasheet_profile("v100-dgx2h", 125e12, 900e9, link_bw=150e9, link_latency=2e-6, memory=32 * GiB),
    "a100-dgx": datasheet_profile("a100-dgx", 312e12, 2.039e12, link_bw=240e9, link_latency=1.5e-6, memory=80 * GiB),
    "h100-dgx": datasheet_profile("h100-dgx", 989e12, 3.35e12, link_bw=370e9, link_latency=1e-6, memory=80 * GiB),
    # Measured on one H200 (bf16), the rates above; the link as H100's (NVLink 4, 900 GB/s).
    "h200": DeviceProfile("h200", flops=754e12, mem_bw=4.07e12, link_bw=370e9, link_latency=1e-6,
                          memory=140 * GiB, dtype_bytes=2, launch_s=2e-6, unaligned_flops=120e12,
                          product_half_work=2.5e9, product_half_k=100.0, attention_flops=355e12,
                          attention_dropout=0.74, class_bw=H200_CLASS_BW, sync_s=GPU_SYNC_S,
                          sort_pass_s=H200_SORT_PASS_S),
    # Local CPU ranks over gloo on loopback, float32: eager ops pay a few microseconds each.
    "cpu-gloo": DeviceProfile("cpu-gloo", flops=50e9, mem_bw=10e9, link_bw=2e9, link_latency=50e-6,
                              memory=16 * GiB, dtype_bytes=4, launch_s=5e-6, product_half_work=1e5,
                              product_half_k=16.0, attention_flops=25e9, dropout_mask_bytes=0),
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


def with_memory(profile: DeviceProfile, memory: float) -> DeviceProfile:
    """The same profile with another device memory (for planning under a tighter budget)."""
    return replace(profile, memory=float(memory))
