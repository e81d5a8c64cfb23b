"""Where a step's host time goes: one training step under ``torch.profiler`` (CPU and CUDA
activities), read for what keeps the device waiting. The device round's part ``host:gpt2-xl``
(``benchmarks/gpu_parts.py``) runs it on one rank of tp 8 and on serial.

For a step (``step()``: gradients dropped, a forward, a backward) it gives

* :func:`clocks`: the wall clock (the device synchronized), the calling thread's CPU time
  (``time.thread_time``) and the whole process's (``time.process_time``: every thread). On CUDA
  the autograd engine runs a backward pass on a thread of its own per device, not on the calling
  thread: the calling thread's time holds the forward alone, the process's the backward too;
* :func:`one_thread`: the step with its backward on the calling thread, to time beside it;
* :func:`without_cudnn_attention`: the step with attention off cuDNN's kernels, to time beside it
  (cuDNN's attention builds an execution graph per layout, milliseconds of host work where its
  cache misses);
* :func:`stalls`: what can stop the host, counted in one unprofiled step: Python's garbage
  collections, the calls torch reports as synchronizing, the allocator's device allocations;
* :func:`profiled`: under the profiler, the 30 ops with the most self CPU time (their calls
  counted), the CUDA runtime calls (:data:`RUNTIME`: launches, copies, synchronizations (one of
  them the step's end), allocations; count and time), the self CPU time per thread and half of
  the step, what the device was busy with
  (kernels, copies and sets: :func:`busy_intervals`) and the largest gaps between (``largest_gaps``:
  the device idle, with what the host was inside of meanwhile).

On CPU (the rehearsal) the "device" is the calling thread's ATen ops that no other ATen op
called, and the gaps are the host's time between them.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

#: CUDA runtime and driver calls counted whether or not the step makes them: launches, copies,
#: the calls that wait for the device, and the allocator's
RUNTIME = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync",
           "cudaMemsetAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
           "cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaStreamWaitEvent")
#: the record_function ranges the step's halves run under (the thread each ran on is in the profile)
FORWARD, BACKWARD = "host_profile: forward", "host_profile: backward"


def training_step(module, batch: dict) -> Callable[[], None]:
    """Gradients dropped, a forward with labels and a backward, each half under a named range."""
    import torch

    def step() -> None:
        module.zero_grad(set_to_none=True)
        with torch.profiler.record_function(FORWARD):
            loss = module(**batch).loss
        with torch.profiler.record_function(BACKWARD):
            loss.backward()

    return step


def clocks(step: Callable[[], None], sync: Callable[[], None], repeats: int) -> dict:
    """Medians over ``repeats`` steps (after two warm-up steps), ms: ``wall`` (synchronized before
    and after), ``thread`` (the calling thread's CPU time) and ``process`` (every thread's), both
    until the step returns: the synchronization after it spins the calling thread while the
    device drains, which is not the host's work."""
    for _ in range(2):
        step()
    sync()
    wall, thread, process = [], [], []
    for _ in range(repeats):
        sync()
        w, t, p = time.perf_counter(), time.thread_time(), time.process_time()
        step()
        thread.append(time.thread_time() - t)
        process.append(time.process_time() - p)
        sync()
        wall.append(time.perf_counter() - w)
    return {k: statistics.median(v) * 1e3 for k, v in (("wall", wall), ("thread", thread), ("process", process))}


def one_thread(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with its backward on the calling thread (``set_multithreading_enabled(False)``):
    against :func:`clocks` of ``step`` itself, what handing the backward to the engine's device
    thread costs or saves."""
    import torch

    def run() -> None:
        with torch.autograd.set_multithreading_enabled(False):
            step()

    return run


def without_cudnn_attention(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with attention kept off cuDNN's kernels (flash, memory-efficient or math instead).
    cuDNN's attention builds an execution graph per layout and rebuilds it where its cache key
    misses, a host cost of milliseconds a call; its backward copies a gradient whose strides are
    not the output's. Timed beside ``step``, it says whether cuDNN's attention is the step's wait."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run() -> None:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            step()

    return run


def stalls(step: Callable[[], None], device: str) -> dict:
    """What can stop a host in one step, counted without the profiler: Python's garbage
    collections (by generation, and their ms), and on CUDA the calls torch reports as
    synchronizing (``torch.cuda.set_sync_debug_mode``: each warning's first line, counted) and
    the caching allocator's device allocations, frees and retries (``torch.cuda.memory_stats``)."""
    import gc
    import warnings

    import torch

    step()
    collections: dict[str, list] = {}
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            row = collections.setdefault(f"generation {info['generation']}", [0, 0.0])
            row[0] += 1
            row[1] += (time.perf_counter() - started.pop()) * 1e3

    cuda = device != "cpu"
    before = torch.cuda.memory_stats() if cuda else {}
    gc.callbacks.append(on_gc)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
                    torch.cuda.synchronize()   # the step's end, not one of its synchronizations
    finally:
        gc.callbacks.remove(on_gc)
    syncs: dict[str, int] = {}
    others: dict[str, int] = {}
    for w in caught:
        key = str(w.message).splitlines()[0][:160]
        seen = syncs if "synchroniz" in str(w.message) else others
        seen[key] = seen.get(key, 0) + 1
    after = torch.cuda.memory_stats() if cuda else {}
    allocator = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_device_alloc", "num_device_free",
                                                                "num_alloc_retries")}
    return {"gc": collections, "syncs": syncs, "warnings": others, "allocator": allocator}


def profiled(step: Callable[[], None], sync: Callable[[], None], device: str, top: int = 30) -> dict:
    """One step under the profiler (after a warm-up step): see the module docs. Times in ms."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - start
    events = list(prof.events())
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    ops = sorted(((a.key, a.self_cpu_time_total / 1e3, a.count) for a in prof.key_averages()
                  if a.key not in (FORWARD, BACKWARD)), key=lambda r: -r[1])
    calls = {name: [0, 0.0] for name in RUNTIME}
    for e in cpu:
        if e.name.startswith("cu") and e.name[2:3].isupper() or e.name.startswith("cuda"):
            row = calls.setdefault(e.name, [0, 0.0])
            row[0] += 1
            row[1] += (e.time_range.end - e.time_range.start) / 1e3
    # each thread's self CPU time by the half of the step it fell in: on CUDA the backward's ops run
    # on the autograd engine's device thread, while the calling thread waits inside backward()
    windows = {e.name.split(": ")[1]: (e.time_range.start, e.time_range.end) for e in cpu
               if e.name in (FORWARD, BACKWARD)}
    caller = next((e.thread for e in cpu if e.name == FORWARD), None)
    threads: dict[str, dict[str, float]] = {}
    for e in cpu:
        if e.name in (FORWARD, BACKWARD):
            continue
        half = next((h for h, (s, t) in windows.items() if s <= e.time_range.start < t), "outside")
        row = threads.setdefault(f"thread {e.thread}" + (" (calling)" if e.thread == caller else ""), {})
        row[half] = row.get(half, 0.0) + e.self_cpu_time_total / 1e3
    busy = busy_intervals(events, device)
    host = [(e.time_range.start, e.time_range.end, e.name, _depth(e), e.thread) for e in cpu
            if e.name not in (FORWARD, BACKWARD)]
    merged = _merged(busy)
    begun = windows.get("forward", (None,))[0]
    ended = windows.get("backward", (None, None))[1]
    edges = {"before the first": (merged[0][0] - begun) / 1e3 if merged and begun is not None else float("nan"),
             "after the last": (ended - merged[-1][1]) / 1e3 if merged and ended is not None else float("nan"),
             "between": sum(b[0] - a[1] for a, b in zip(merged, merged[1:])) / 1e3}
    return {"wall": wall * 1e3, "busy": sum(e - s for s, e in merged) / 1e3, "idle": edges,
            "top_ops": [list(r) for r in ops[:top]], "runtime": {k: v for k, v in calls.items()},
            "threads": threads, "gaps": largest_gaps(busy, host)}


def _depth(event) -> int:
    depth, parent = 0, event.cpu_parent
    while parent is not None:
        depth, parent = depth + 1, parent.cpu_parent
    return depth


def busy_intervals(events, device: str) -> list[tuple[float, float, str]]:
    """(start, end, name) in µs of what the device ran: on CUDA every device event (kernels,
    copies, sets); on CPU the ATen ops no other ATen op called."""
    import torch

    if device != "cpu":
        return [(e.time_range.start, e.time_range.end, e.name) for e in events
                if e.device_type != torch.autograd.DeviceType.CPU]

    def outermost(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    return [(e.time_range.start, e.time_range.end, e.name) for e in events
            if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::") and outermost(e)]


def _merged(intervals: list[tuple]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e, *_ in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def largest_gaps(busy: list[tuple[float, float, str]], host: list[tuple[float, float, str, int, int]],
                 top: int = 10) -> list[dict]:
    """The ``top`` longest stretches (µs in, ms out) between the device's busy intervals (several
    streams merged), each with the device's last work before it and first after, and what the
    host was inside of meanwhile: the deepest host event (``host``: start, end, name, depth,
    thread) covering at least half the gap, else the outermost host events begun in it, by name."""
    ordered = sorted(busy)
    gaps, end, before = [], None, None
    for s, e, name in ordered:
        if end is not None and s > end:
            gaps.append((s - end, end, s, before, name))
        if end is None or e >= end:
            end, before = e, name
    out = []
    for length, s, e, before, after in sorted(gaps, key=lambda g: -g[0])[:top]:
        covering = [h for h in host if min(h[1], e) - max(h[0], s) >= 0.5 * (e - s)]
        if covering:
            inner = max(covering, key=lambda h: h[3])
            inside = f"{inner[2]} (thread {inner[4]})"
        else:
            begun: dict[str, int] = {}
            inside_gap = [h for h in host if s <= h[0] < e]
            shallowest = min((h[3] for h in inside_gap), default=0)
            for h in inside_gap:
                if h[3] == shallowest:
                    begun[h[2]] = begun.get(h[2], 0) + 1
            inside = ("begun: " + ", ".join(f"{n} x{c}" for n, c in sorted(begun.items(), key=lambda kv: -kv[1])[:3])
                      if begun else "no host event")
        out.append({"ms": length / 1e3, "before": before, "after": after, "host": inside})
    return out


def lines(label: str, clock: dict, prof: dict, single: dict | None = None, stall: dict | None = None,
          no_cudnn: dict | None = None) -> list[str]:
    """A result file's section for one program's step."""
    out = [f"### {label}", "",
           f"Unprofiled step, median: wall **{clock['wall']:.1f} ms**, calling thread's CPU {clock['thread']:.1f} ms, "
           f"process CPU (every thread) **{clock['process']:.1f} ms**. Profiled step: wall {prof['wall']:.1f} ms, "
           f"device busy {prof['busy']:.1f} ms ({prof['busy'] / prof['wall']:.0%}).", ""]
    if single:
        out += [f"The backward on the calling thread (`set_multithreading_enabled(False)`): wall {single['wall']:.1f} ms, "
                f"calling thread's CPU {single['thread']:.1f} ms, process CPU {single['process']:.1f} ms.", ""]
    if no_cudnn:
        out += [f"Attention kept off cuDNN (`sdpa_kernel`: flash, memory-efficient, math): wall "
                f"**{no_cudnn['wall']:.1f} ms**, calling thread's CPU {no_cudnn['thread']:.1f} ms, process CPU "
                f"{no_cudnn['process']:.1f} ms.", ""]
    if stall:
        gcs = "; ".join(f"{k}: {n} ({ms:.1f} ms)" for k, (n, ms) in stall["gc"].items()) or "none"
        syncs = "; ".join(f"{k} x{n}" for k, n in stall["syncs"].items()) or "none"
        others = "; ".join(f"{k} x{n}" for k, n in stall.get("warnings", {}).items()) or "none"
        out += [f"One step, counted: Python's garbage collections {gcs}; synchronizing calls {syncs}; the allocator's "
                + ", ".join(f"{k} {v}" for k, v in stall["allocator"].items()) + f"; other warnings {others}.", ""]
    out += ["Self CPU time per thread by the half of the step it fell in, ms: " + "; ".join(
                f"{k}: " + ", ".join(f"{h} {ms:.1f}" for h, ms in v.items()) for k, v in prof["threads"].items()), "",
           "| CUDA runtime call | count | ms |", "|---|---|---|"]
    for name, (n, ms) in sorted(prof["runtime"].items(), key=lambda kv: (-kv[1][1], kv[0])):
        out.append(f"| `{name}` | {n} | {ms:.2f} |")
    out += ["", f"The {len(prof['top_ops'])} ops with the most self CPU time:", "",
            "| op | self CPU ms | calls |", "|---|---|---|"]
    out += [f"| `{name[:90]}` | {ms:.2f} | {n} |" for name, ms, n in prof["top_ops"]]
    idle = prof.get("idle")
    out += ["", "The device idle, ms: " + ("; ".join(f"{k} {v:.2f}" for k, v in (
        ("from the forward's start to its first work", idle["before the first"]),
        ("between its stretches of work", idle["between"]),
        ("from its last work to the backward's end", idle["after the last"]))) if idle else "-")
            + ". The longest gaps between its work:", "",
            "| gap ms | device before | device after | host meanwhile |", "|---|---|---|---|"]
    out += [f"| {g['ms']:.3f} | `{g['before'][:60]}` | `{g['after'][:60]}` | {g['host'][:120]} |" for g in prof["gaps"]]
    return out + [""]


def verdict(figures: dict) -> str:
    """One line on where a step's time goes, from a part's figures (``rank`` and ``serial``)."""
    cells = []
    for label in ("rank", "serial"):
        f = figures.get(label)
        if not f:
            continue
        clock, prof = f["clock"], f["profile"]
        runtime = prof["runtime"]
        # less the benchmark's own synchronization at the step's end
        waits = sum(runtime.get(k, (0, 0))[0] for k in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                         "cudaEventSynchronize"))
        waits -= min(1, runtime.get("cudaDeviceSynchronize", (0, 0))[0])
        allocs = runtime.get("cudaMalloc", (0, 0))[0] + runtime.get("cudaFree", (0, 0))[0]
        launches = sum(runtime.get(k, (0, 0))[0] for k in RUNTIME if "Launch" in k)
        biggest = prof["gaps"][0] if prof["gaps"] else None
        single, stall, no_cudnn = f.get("one_thread"), f.get("stalls"), f.get("no_cudnn_attention")
        cells.append(f"{label}: wall {clock['wall']:.1f} ms, calling thread {clock['thread']:.1f} ms, process CPU "
                     f"{clock['process']:.1f} ms, device busy {prof['busy'] / prof['wall']:.0%} (profiled); "
                     f"{launches} launches, {waits} synchronizations besides the step's end, {allocs} cudaMalloc/cudaFree"
                     + (f"; longest gap {biggest['ms']:.2f} ms ({biggest['host'][:80]})" if biggest else "")
                     + (f"; backward on the calling thread: wall {single['wall']:.1f} ms, that thread "
                        f"{single['thread']:.1f} ms" if single else "")
                     + (f"; attention off cuDNN: wall **{no_cudnn['wall']:.1f} ms**" if no_cudnn else "")
                     + (f"; unprofiled, {sum(n for n, _ in stall['gc'].values())} garbage collections "
                        f"({sum(ms for _, ms in stall['gc'].values()):.1f} ms), {sum(stall['syncs'].values())} "
                        f"synchronizing calls, {stall['allocator'].get('num_device_alloc', 0)} device allocations"
                        if stall else ""))
    rank = figures.get("rank")
    if rank:
        clock = rank["clock"]
        host_bound = clock["process"] >= 0.7 * clock["wall"]
        cells.append("the rank is " + ("**host-bound**: its threads are busy for most of the step" if host_bound
                                       else "not host-bound by CPU time: look at the gaps and the waits"))
    return "; ".join(cells)
