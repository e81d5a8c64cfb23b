"""Measurements a profile is made of, on the machine at hand: matrix products of several shapes,
the memory-bound op classes the cost model prices apart, fused attention, a kernel's launch, and
ring all-reduces over a process group. Each returns plain numbers; :func:`.calibration.calibrate`
turns them into a :class:`~.devices.DeviceProfile`.

Every figure is the best of ``repeats`` runs after a warm-up, synchronized on a GPU. A CPU's
compute is timed by the thread's CPU time, not the wall clock: on a machine shared with other
jobs a run's wall time also holds the time it waited for a core, which the profile's rates are
not about (the collectives, which wait on other ranks by nature, keep the wall clock)."""
from __future__ import annotations

import time
from typing import Callable, Sequence

from ..errors import ConfigError

def _best_time(fn, repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    fn()  # warm up (allocations, thread pools)
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return max(best, 1e-9)


def _clock(device: str) -> Callable[[], float]:
    """The thread's CPU time for a CPU's compute (one thread runs it: ``torch.set_num_threads``
    beyond one would need the process's), the wall clock for a device's (synchronized)."""
    import torch

    return time.thread_time if device == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


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

        best = max(best, 2 * n ** 3 / _best_time(run, repeats, _clock(device)))
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

    return 3 * numel * a.element_size() / _best_time(run, repeats, _clock(device))


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




def _sync(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device != "cpu" else (lambda: None)


def _timed(fn: Callable[[], object], device: str, repeats: int) -> float:
    sync = _sync(device)

    def run():
        fn()
        sync()

    return _best_time(run, repeats, _clock(device))


def _tiny_kernels(device: str, repeats: int, read: bool) -> float:
    """Seconds per call of a tiny kernel (an add of 8 numbers), each followed by ``.item()`` of
    its output where ``read``."""
    import torch

    a = torch.ones(8, device=device)
    out = torch.empty_like(a)
    calls = 50

    def run():
        for _ in range(calls):
            torch.add(a, a, out=out)
            if read:
                out[0].item()

    return _timed(run, device, repeats) / calls


def measure_launch(device: str = "cpu", repeats: int = 20) -> float:
    """Seconds one tiny kernel costs end to end (an add of 8 numbers): what every op pays."""
    return _tiny_kernels(device, repeats, read=False)


def measure_sort_pass(launch_s: float, sort_bw: float, device: str = "cpu", repeats: int = 20,
                      n: int = 8192) -> float:
    """Seconds a radix-sort pass costs beyond its launch and its bytes at ``sort_bw``: a stable
    sort of ``n`` int64 ids (a routing's size, where the passes' waits dominate), less what the
    launches and bytes explain, per pass (:func:`.routing.sort_passes`); 0 where nothing is left."""
    import torch

    from .routing import sort_bytes, sort_launches, sort_passes

    ids = torch.randint(0, 64, (n,), device=device)
    seconds = _timed(lambda: torch.sort(ids, stable=True), device, repeats)
    rest = seconds - sort_launches(8) * launch_s - sort_bytes(n, 8) / sort_bw
    return max(0.0, rest / sort_passes(8))


def measure_host_read(device: str = "cpu", repeats: int = 20) -> float:
    """Seconds one read of a device value on the host costs beyond a tiny kernel's launch: a
    kernel, then ``.item()`` of its output (the host waits for it, then copies it back)."""
    return max(0.0, _tiny_kernels(device, repeats, read=True) - measure_launch(device, repeats))


def measure_products(shapes: Sequence[tuple[int, int, int]], device: str = "cpu", dtype=None,
                     repeats: int = 3) -> list[float]:
    """FLOP/s of ``(m x k) @ (k x n)`` for each ``(m, n, k)`` in ``shapes``."""
    import torch

    dtype = dtype or torch.float32
    rates = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out = torch.empty(m, n, device=device, dtype=dtype)
        rates.append(2 * m * n * k / _timed(lambda: torch.mm(a, b, out=out), device, repeats))
    return rates


def measure_grouped(groups: int = 32, rows: int = 32, k: int = 512, n: int = 512, device: str = "cpu", dtype=None,
                    repeats: int = 3) -> float:
    """Seconds of a grouped product's forward and backward: ``groups`` experts of ``rows`` rows
    each, ``(rows x k) @ (k x n)`` per expert. On a GPU ``torch._grouped_mm`` through autograd;
    on the CPU as a captured mixture of experts runs it there (transformers'
    ``grouped_mm_fallback``, the op a float32 model exports with): the output zeroed, one ``mm``
    per expert into its rows; backward the gradients zeroed, then per expert ``dY·Wᵀ`` into its
    rows and ``Xᵀ·dY`` into its matrix."""
    import torch

    dtype = dtype or torch.float32
    x = torch.randn(groups * rows, k, device=device, dtype=dtype)
    w = torch.randn(groups, k, n, device=device, dtype=dtype)
    dy = torch.randn(groups * rows, n, device=device, dtype=dtype)
    offs = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * rows
    if device != "cpu":
        xg, wg = x.requires_grad_(), w.requires_grad_()

        def run():
            torch.autograd.grad(torch._grouped_mm(xg, wg, offs=offs), (xg, wg), dy)
        return _timed(run, device, repeats)

    def run():
        ends = offs.tolist()
        out = torch.zeros(groups * rows, n, dtype=dtype)
        dx, dw = torch.zeros_like(x), torch.zeros_like(w)
        start = 0
        for i, end in enumerate(ends):
            torch.mm(x[start:end], w[i], out=out[start:end])
            start = end
        start = 0
        for i, end in enumerate(ends):
            torch.mm(dy[start:end], w[i].T, out=dx[start:end])
            torch.mm(x[start:end].T, dy[start:end], out=dw[i])
            start = end
    return _timed(run, device, repeats)


def fit_product_shape(peak: float, small: tuple[int, int, int], small_rate: float, shallow: tuple[int, int, int],
                      shallow_rate: float) -> tuple[float, float]:
    """(half work, half k) of the product model ``rate = peak · W/(W + W·k0/k + w0)``
    (:meth:`~.devices.DeviceProfile.product_rate`) from a small product and a shallow one (few
    contracted elements), each measured: ``peak/rate - 1 = k0/k + w0/W`` for each, two linear
    equations in (w0, k0), solved exactly; where that gives a negative constant, it is 0 and
    the other is fitted to the product that shows it (the small one's size, the shallow one's
    depth), kept non-negative."""
    ws, ks = small[0] * small[1] * small[2], small[2]
    wd, kd = shallow[0] * shallow[1] * shallow[2], shallow[2]
    bs, bd = max(peak / small_rate - 1, 0.0), max(peak / shallow_rate - 1, 0.0)
    det = 1 / (ws * kd) - 1 / (wd * ks)
    if det:
        w0 = (bs / kd - bd / ks) / det
        k0 = (bd / ws - bs / wd) / det
        if w0 >= 0 and k0 >= 0:
            return w0, k0
        if w0 < 0:
            return 0.0, kd * bd
    return ws * bs, 0.0


def measure_op_classes(device: str = "cpu", dtype=None, numel: int = 1 << 22, repeats: int = 3) -> dict[str, float]:
    """Bytes/s each memory-bound op class attains on ``numel``-element tensors (the bytes each
    kernel reads and writes, as :mod:`.kernels` counts them): a contiguous add; the same add on
    a transposed operand (strided); a product with a broadcast row and with a broadcast column
    (a norm's weight, a per-token scale: broadcast); a cast to float32; a sum over the rows; a
    log-softmax over rows; a layer norm; dropout; a scatter-add of rows; and a stable sort of
    int64 keys (a router's expert ids: the bytes :func:`.routing.sort_bytes` counts)."""
    import torch

    from .routing import sort_bytes

    dtype = dtype or torch.float32
    eb = torch.empty((), dtype=dtype).element_size()
    rows = 1024
    cols = numel // rows
    x = torch.randn(rows, cols, device=device, dtype=dtype)
    y = torch.randn(rows, cols, device=device, dtype=dtype)
    yt = torch.randn(cols, rows, device=device, dtype=dtype).t()
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    out = torch.empty_like(x)
    n = rows * cols
    index = torch.randint(0, rows, (rows,), device=device)
    table = torch.zeros(rows, cols, device=device, dtype=dtype)
    row, col = torch.randn(cols, device=device, dtype=dtype), torch.randn(rows, 1, device=device, dtype=dtype)
    ln = torch.nn.functional.layer_norm
    ids = torch.randint(0, 64, (max(n // 16, 1),), device=device)
    measured = {
        "elementwise": (3 * n * eb, lambda: torch.add(x, y, out=out)),
        "strided": (3 * n * eb, lambda: torch.add(x, yt, out=out)),
        "broadcast": ((4 * n + rows + cols) * eb, lambda: (torch.mul(x, row, out=out), torch.mul(x, col, out=out))),
        "cast": (n * eb + n * wide.itemsize, lambda: x.to(wide)),
        "reduction": (n * eb, lambda: x.sum(0)),
        "softmax": (2 * n * eb, lambda: torch.log_softmax(x, dim=-1)),
        "norm": (2 * n * eb, lambda: ln(x, (cols,))),
        "random": (2 * n * eb + n, lambda: torch.nn.functional.dropout(x, 0.1, True)),
        "scatter": (2 * n * eb, lambda: table.index_add_(0, index, x)),
        "sort": (sort_bytes(len(ids), 8), lambda: torch.sort(ids, stable=True)),
    }
    return {name: nbytes / _timed(fn, device, repeats) for name, (nbytes, fn) in measured.items()}


def measure_attention(device: str = "cpu", dtype=None, seq: int = 512, heads: int = 8, repeats: int = 3,
                      dropout: float = 0.0) -> tuple[float, float]:
    """FLOP/s of causal ``scaled_dot_product_attention`` at head dim 128 and at 64 (counting the
    half of the score matrix a causal mask leaves), with ``dropout``."""
    import torch

    dtype = dtype or torch.float32
    rates = []
    for d in (128, 64):
        q, k, v = (torch.randn(1, heads, seq, d, device=device, dtype=dtype) for _ in range(3))

        def run():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)

        rates.append(2 * heads * seq * seq * d / _timed(run, device, repeats))
    return rates[0], rates[1]
