"""The parts of a device round (``benchmarks/gpu_round.py``), each run as a child process:

    python3 benchmarks/gpu_parts.py --child rank --device cuda --options '{"model": "llama-3-8b", ...}' \
        --figures FIGURES.json --md PART.md

A part takes the device, ``quick`` (tiny widths: the CPU rehearsal) and the path of its result
file, and returns its figures (a dict, written to ``--figures`` as JSON for the round's driver).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _fake_world(tp: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())


def _world_of_one(device: str, timeout_s: float = 120) -> None:
    """A one-rank NCCL world on a GPU (gloo on CPU), through a file store (no port to collide on);
    a collective that hangs fails after ``timeout_s``."""
    import datetime
    import tempfile

    import torch.distributed as dist

    path = tempfile.mktemp(prefix="autotp-round-")
    dist.init_process_group("nccl" if device != "cpu" else "gloo", init_method=f"file://{path}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=timeout_s))


def _tiny_model_for(name: str, layers: int, dtype, device: str):
    """``rank_efficiency.model_for`` at tiny widths (``--quick``): the published model's family,
    hidden 64 in 8 heads, experts 8 (top-2) where it has them."""
    from autotp import zoo

    family = zoo.family_of(name)
    extra = dict(experts=8, top_k=2) if family.name in zoo.EXPERT_FAMILIES else {}
    config = zoo.tiny_config(family.name, layers=layers, heads=8, head_dim=8, vocab=128, positions=64, **extra)
    return family, zoo.build(family.name, config, device=device, dtype=dtype)


def rank(device: str, quick: bool, md: str, model: str, layers: int, batch: int, seq: int,
         compile: bool = False, rank_by: str = "count", busiest_rank: str = "off", plan_load: str = "balanced",
         products_apart: bool = False) -> dict:
    """One rank of tp 8 against serial/8 (``benchmarks/rank_efficiency.py``): its table in ``md``.
    ``rank_by`` and ``busiest_rank``: which rank of the fake world times an experts layout
    (rank_efficiency's ``--rank-by``, ``--busiest-rank``); ``plan_load``: the default plan made at
    a balanced router, at the batch's measured routing load, or both (``--plan-load``);
    ``products_apart``: the default plan with its sibling products as written too (``--products-apart``)."""
    import torch

    import rank_efficiency
    from common import machine, publish

    if quick:
        rank_efficiency.model_for = _tiny_model_for
        layers, batch, seq = min(layers, 2), 1, 16
    if device == "cpu":
        torch.set_num_threads(1)
    args = argparse.Namespace(tp=8, device=device, dtype="bfloat16" if device != "cpu" else "float32", batch=batch,
                              seq=seq, plan_batch=batch, plan_seq=seq, profile="h200",
                              layouts=list(rank_efficiency.EXPERTS), repeats=2 if quick else 5, threads=1,
                              compile=compile, sequence_parallel="cost", rank_by=rank_by,
                              busiest_rank=busiest_rank, plan_load=plan_load,
                              products_apart=products_apart)
    torch.manual_seed(0)
    _fake_world(8)
    figures: dict = {}
    lines = rank_efficiency.run_model(f"{model}:{layers}", args, figures)
    publish(["# One rank of tp=8 against serial/8 (benchmarks/gpu_round.py)", "", machine()
             + (f" GPU: {torch.cuda.get_device_name()}." if device != "cpu" else ""), ""] + lines, md)
    return {"model": model, "layers": layers, "batch": batch, "seq": seq, "dtype": args.dtype, "versions": figures}


def moe_compile(device: str, quick: bool, md: str) -> dict:
    """Compiled MoE at tp 1: ``torch.compile(pm)`` against ``torch.compile`` of HF's module, with
    each compiled arm's dynamo graphs and graph breaks, and both eager beside: the four step in
    turn, their order reversed every other step."""
    import statistics

    import torch
    from torch._dynamo.utils import counters

    import autotp
    from autotp import zoo

    _world_of_one(device)
    gpu = device != "cpu"
    if quick:
        widths = dict(layers=2, heads=4, kv_heads=2, head_dim=16, vocab=256, experts=4, top_k=2,
                      intermediate_size=64, positions=32)
        batch_size, seq, warmup, steps = 2, 16, 1, 2
    else:
        widths = dict(layers=4, heads=16, kv_heads=4, head_dim=64, vocab=32000, experts=8, top_k=2,
                      intermediate_size=2816, positions=1024)
        batch_size, seq, warmup, steps = 4, 1024, 3, 10
    config = zoo.tiny_config("mixtral", **widths)
    config._experts_implementation = "grouped_mm"
    dtype = torch.bfloat16 if gpu else torch.float32
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    def build():
        return zoo.build("mixtral", config, seed=0, device=device, dtype=dtype)

    batch = {k: v.to(device) for k, v in zoo.example_batch("mixtral", config, batch=batch_size, seq=seq,
                                                           seed=1).items()}
    hf, pm = build(), autotp.parallelize(build(), 1, batch=batch_size, seq=seq, device=device)
    pm(**batch)   # eager first: the call's program is built

    def step(module) -> tuple[float, float]:
        module.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        loss = module(**batch).loss
        loss.backward()
        sync()
        return time.perf_counter() - start, float(loss)

    arms = {"HF eager": hf, "autotp eager": pm}
    # dynamo's graphs and breaks per compiled arm over every one of its steps (a recompile on a
    # later step counts as a graph); one reset before both, as benchmarks/moe_compile.py counts
    torch._dynamo.reset()
    counters.clear()
    graphs, breaks, first = {}, {}, {}

    def counted(name: str) -> tuple[float, float]:
        if name not in graphs:
            return step(arms[name])
        before, broken = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
        timed = step(arms[name])
        graphs[name] += counters["stats"]["unique_graphs"] - before
        for reason, n in counters["graph_break"].items():
            if n > broken.get(reason, 0):
                breaks[name][reason] = breaks[name].get(reason, 0) + n - broken.get(reason, 0)
        return timed

    for name, module in (("HF compiled", hf), ("autotp compiled", pm)):
        arms[name] = torch.compile(module, backend="inductor" if gpu else "aot_eager")
        graphs[name], breaks[name] = 0, {}
        first[name] = counted(name)[0]
    times, losses = {n: [] for n in arms}, {}
    names = list(arms)
    for i in range(warmup + steps):
        for name in (names if i % 2 == 0 else names[::-1]):   # either order in turn
            t, losses[name] = counted(name)
            if i >= warmup:
                times[name].append(t)
    med = {n: statistics.median(t) for n, t in times.items()}
    best = {n: min(t) for n, t in times.items()}
    from common import machine, publish

    lines = ["# Compiled MoE at tp 1: autotp's program against HF's module (benchmarks/gpu_round.py)", "",
             machine() + (f" GPU: {torch.cuda.get_device_name()}." if gpu else ""), "",
             f"Mixtral (autotp.zoo), {widths['layers']} layers, hidden {widths['heads'] * widths['head_dim']}, "
             f"{widths['experts']} experts of {widths['intermediate_size']}, top-{widths['top_k']}, "
             f"{widths['heads']} heads ({widths['kv_heads']} kv), vocab {widths['vocab']}, `grouped_mm`, {dtype}; "
             f"batch {batch_size} x seq {seq}; a step is zero_grad + forward + backward, synchronized; {warmup} "
             f"warm-up steps, {steps} timed, the four taking turns; compiled with "
             f"{'inductor' if gpu else 'aot_eager'}, fullgraph=False (a break is counted, not raised).", "",
             "| version | ms median | ms best | vs HF compiled | loss | first call s | graphs | graph breaks |",
             "|---|---|---|---|---|---|---|---|"]
    for n in names:
        lines.append(f"| {n} | {med[n] * 1e3:.2f} | {best[n] * 1e3:.2f} | {med[n] / med['HF compiled']:.3f}x | "
                     f"{losses[n]:.4f} | {first.get(n, 0):.1f} | {graphs.get(n, '-')} | "
                     f"{sum(breaks[n].values()) if n in breaks else '-'} |")
    for n, found in breaks.items():
        lines += [f"\n{n}'s graph breaks: " + "; ".join(f"{k} ({v})" for k, v in found.items())] if found else []
    publish(lines, md)
    return {"median_s": med, "best_s": best, "loss": losses, "first_call_s": first, "graphs": graphs,
            "breaks": breaks, "widths": widths, "batch": batch_size, "seq": seq, "dtype": str(dtype)}


def rms_norm(device: str, quick: bool, md: str) -> dict:
    """``aten.rms_norm`` as autotp's rank runs a Llama norm (``autotp/passes/norms.py``: the
    upcast and the weight's multiply kept as written) against the statistic as HF writes it:
    the ATen ops each dispatches, forward + backward ms, and bf16 / float32 results (output and
    both gradients) against each other and against float64."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    tokens, h = (64, 32) if quick else (2 * 4096, 4096)
    eps = 1e-5
    gpu = device != "cpu"
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    def written(x, w):   # LlamaRMSNorm.forward
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * xf.to(x.dtype)

    def fused(x, w):   # the rank's graph after fuse_norms
        y = torch.ops.aten.rms_norm(x.to(torch.float32), [h], None, eps)
        return w * y.to(x.dtype)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    x64 = torch.randn(tokens, h, generator=gen, dtype=torch.float64)
    w64 = 1 + 0.1 * torch.randn(h, generator=gen, dtype=torch.float64)
    dy64 = torch.randn(tokens, h, generator=gen, dtype=torch.float64)

    def run(fn, dtype, record=False):
        x = _leaf(x64, device, dtype)
        w = _leaf(w64, device, dtype)
        mode = Ops() if record else None
        with mode if mode else _nothing():
            y = fn(x, w)
            y.backward(dy64.to(device, dtype))
        return y.detach(), x.grad, w.grad, (mode.seen if mode else None)

    ref = run(written, torch.float64)
    out: dict = {"tokens": tokens, "hidden": h, "dispatched": {}, "exactness": {}, "ms": {}}
    for name, fn in (("written", written), ("aten.rms_norm", fused)):
        out["dispatched"][name] = run(fn, torch.bfloat16 if gpu else torch.float32, record=True)[3]
    for dtype in (torch.bfloat16, torch.float32):
        a, b = run(written, dtype), run(fused, dtype)
        cells = {}
        for i, what in enumerate(("output", "grad x", "grad weight")):
            diff = (a[i].float() - b[i].float()).abs()
            cells[what] = {"differing": int((diff > 0).sum()), "of": diff.numel(),
                           "max_abs_diff": float(diff.max()),
                           "written_vs_f64": _rel(a[i], ref[i]), "fused_vs_f64": _rel(b[i], ref[i])}
        out["exactness"][str(dtype)] = cells
        for name, fn in (("written", written), ("aten.rms_norm", fused)):
            x = _leaf(x64, device, dtype)
            w = _leaf(w64, device, dtype)
            dy = dy64.to(device, dtype)
            best = float("inf")
            for _ in range(3 if quick else 20):
                x.grad = w.grad = None
                sync()
                start = time.perf_counter()
                fn(x, w).backward(dy)
                sync()
                best = min(best, time.perf_counter() - start)
            out["ms"][f"{name} {dtype}"] = best * 1e3
    if gpu:
        out["kernels"] = {name: _kernels(lambda fn=fn: _fwd_bwd(fn, x64, w64, dy64, device)) for name, fn in
                          (("written", written), ("aten.rms_norm", fused))}
    from common import publish

    lines = [f"# aten.rms_norm against the written RMSNorm statistic, {device}, [{tokens}, {h}] "
             "(benchmarks/gpu_round.py)", "",
             "ATen ops dispatched (forward + backward, the first dtype): "
             + "; ".join(f"{k}: {' '.join(v)}" for k, v in out["dispatched"].items()), "",
             "| dtype | tensor | elements differing (written vs fused) | max abs diff | written vs f64 | "
             "fused vs f64 |", "|---|---|---|---|---|---|"]
    for dtype, cells in out["exactness"].items():
        for what, c in cells.items():
            lines.append(f"| {dtype} | {what} | {c['differing']} of {c['of']} | {c['max_abs_diff']:.2e} | "
                         f"{c['written_vs_f64']:.2e} | {c['fused_vs_f64']:.2e} |")
    lines += ["", "Forward + backward, best of the repeats, ms: "
              + "; ".join(f"{k} {v:.3f}" for k, v in out["ms"].items())]
    if gpu:
        lines += ["", "Device kernels per forward + backward (bf16): "
                  + "; ".join(f"{k} {v}" for k, v in out["kernels"].items())]
    publish(lines, md)
    return out


def _leaf(t, device, dtype):
    """A fresh leaf of ``t``'s values (``to`` returns ``t`` itself where nothing changes)."""
    return t.to(device, dtype, copy=True).requires_grad_()


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def _rel(a, b) -> float:
    import torch

    a, b = a.to("cpu", torch.float64), b.to("cpu", torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _fwd_bwd(fn, x64, w64, dy64, device):
    import torch

    x = _leaf(x64, device, torch.bfloat16)
    w = _leaf(w64, device, torch.bfloat16)
    fn(x, w).backward(dy64.to(device, torch.bfloat16))


def _kernels(step) -> int:
    """Device kernels one call of ``step`` launches (the profiler's device events)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "Memcpy" not in e.name and "Memset" not in e.name)


def collectives(device: str, quick: bool, md: str) -> dict:
    """The collectives autotp's eager path calls, under NCCL (gloo on CPU) in a world of one, on
    the device's tensors: the group's own c10d methods as ``autotp/distributed/`` calls them
    (``comm.py``, ``gather_scatter.py``, ``exchange.py``), dist's and the functional ones, and
    all-to-alls with an empty send (a rank holding none of an uneven split, or no row routed to
    another rank's experts). Each a row: passed, or its error."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    _world_of_one(device, timeout_s=20)
    group = dist.group.WORLD
    x = torch.arange(12, dtype=torch.float32, device=device).view(4, 3)
    empty = x.new_empty(0, 3)

    def opts(cls):
        o = cls()
        o.asyncOp = False
        return o

    def allreduce():
        y = x.clone()
        work = group.allreduce([y], opts(c10d.AllreduceOptions))
        if work is not None:   # a blocking collective returns no work under NCCL in torch 2.11
            work.wait()
        return y

    def gather_single():
        y = torch.empty_like(x)
        if hasattr(group, "all_gather_single"):   # torch 2.13's method; 2.11 has dist's older name
            group.all_gather_single(y, x, opts(c10d.AllgatherOptions)).wait()
        else:
            dist.all_gather_into_tensor(y, x, group=group)
        return y

    def reduce_scatter_single():
        y = torch.empty_like(x)
        if hasattr(group, "reduce_scatter_single"):
            group.reduce_scatter_single(y, x, opts(c10d.ReduceScatterOptions)).wait()
        else:
            dist.reduce_scatter_tensor(y, x, group=group)
        return y

    def all_to_all(send, sizes):
        y = send.new_empty(send.shape)
        dist.all_to_all_single(y, send, sizes, sizes, group=group)
        return y

    checks = {   # the empty sends last: a hang there leaves the others' rows in the log
        "group.allreduce (c10d method)": (allreduce, x),
        "funcol.all_reduce": (lambda: funcol.wait_tensor(funcol.all_reduce(x, "sum", group)), x),
        "all_gather_single (c10d method where torch has it)": (gather_single, x),
        "reduce_scatter_single (c10d method where torch has it)": (reduce_scatter_single, x),
        "dist.all_to_all_single": (lambda: all_to_all(x, [4]), x),
        "dist.all_to_all_single, empty send": (lambda: all_to_all(empty, [0]), empty),
        "funcol.all_to_all_single, empty send": (
            lambda: funcol.wait_tensor(funcol.all_to_all_single(empty, [0], [0], group)), empty),
    }
    try:
        from autotp.distributed import comm, exchange, gather_scatter

        checks["autotp _c10d_all_reduce"] = (lambda: (lambda y: (comm._c10d_all_reduce(y, group), y)[1])(x.clone()), x)
        checks["autotp _gather_into"] = (lambda: gather_scatter._gather_into(x, group, "probe").reshape(x.shape), x)
        for kind in ("all_gather", "reduce_scatter"):   # the rows of a sequence split, one coalesced call
            checks[f"autotp _rows_collective {kind} (coalesced where the backend has it)"] = (
                lambda kind=kind: (lambda y: (gather_scatter._rows_collective(kind, y, x, group, "probe"), y)[1])(
                    torch.empty_like(x)), x)
        checks["autotp _exchange, empty send"] = (
            lambda: exchange._exchange(empty.reshape(-1), [0], [0], group, "probe"), empty.reshape(-1))
    except (ImportError, AttributeError) as e:
        checks[f"autotp collectives helpers: {type(e).__name__}"] = (lambda e=e: (_ for _ in ()).throw(e), x)
    rows = {}
    for name, (fn, want) in checks.items():
        try:
            got = fn()
            if device != "cpu":
                torch.cuda.synchronize()
            rows[name] = "passed" if torch.equal(got.cpu(), want.cpu()) else f"wrong result {got.cpu().tolist()}"
        except Exception as e:   # a row, the next check runs
            rows[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        print(f"{name}: {rows[name]}", flush=True)   # where a check hangs and the part is stopped, the log says which
    from common import publish

    publish([f"# Collectives under {dist.get_backend()} in a world of one, {device} tensors (benchmarks/gpu_round.py)",
             "", "| collective | result |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows.items()], md)
    return {"backend": dist.get_backend(), "checks": rows}


def rank_host(device: str, quick: bool, md: str) -> dict:
    """``benchmarks/rank_host.py``'s host work per step (one rank of tp 8 on the fake backend
    against serial, tiny widths), the models and batches on ``device``: on a GPU the host time
    holds the kernels' launches, which the GPU runs in the shadow of the host."""
    import torch

    import rank_host
    from common import machine, publish

    cpu_tiny = rank_host.tiny

    def on_device(family: str, layers: int, seq: int, *moe):
        model, batch = cpu_tiny(family, layers, seq, *moe)
        return model.to(device), {k: v.to(device) for k, v in batch.items()}

    rank_host.tiny = on_device
    torch.manual_seed(0)
    torch.set_num_threads(1)
    _fake_world(8)
    args = argparse.Namespace(tp=8, seq=16, repeats=3 if quick else 20, top=10)
    lines, figures = [f"# The host's work per step on {device}: one rank of tp 8 against serial "
                      "(benchmarks/rank_host.py's, from benchmarks/gpu_round.py)", "", machine(), ""], {}
    for spec in (("gpt2:2",) if quick else ("gpt2:12", "llama:12")):
        more, rows = rank_host.run_model(spec, args)
        lines += more
        for (kind, label), row in rows[spec].items():
            figures[f"{spec} | {kind} | {label}"] = {k: row[k] for k in ("thread", "aten", "python", "nodes")}
    publish(lines, md)
    return figures


def host_profile(device: str, quick: bool, md: str, model: str, layers: int, batch: int, seq: int) -> dict:
    """Where the host's time goes in one training step of one rank of tp 8 (the fake backend,
    sequence parallelism by cost, as ``rank`` runs it) and of serial: the step's clocks (wall,
    the calling thread's CPU, every thread's; again with the backward on the calling thread, and
    with attention kept off cuDNN's kernels), the
    garbage collections, synchronizing calls and device allocations of one step, and one step
    under the profiler
    (``benchmarks/host_profile.py``): its ops by self CPU time, the CUDA runtime calls, the
    self CPU time per thread and the longest gaps between the device's work."""
    import torch

    import autotp
    import host_profile as H
    import rank_efficiency
    from autotp import zoo
    from common import machine, publish

    if quick:
        rank_efficiency.model_for = _tiny_model_for
        layers, batch, seq = min(layers, 2), 1, 16
    if device == "cpu":
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    started = time.perf_counter()
    torch.manual_seed(0)
    _fake_world(8)
    family, serial = rank_efficiency.model_for(model, layers, dtype, device)
    inputs = {k: v.to(device) for k, v in zoo.example_batch(family.name, serial.config, batch=batch, seq=seq,
                                                            seed=0).items()}
    pm = autotp.parallelize(serial, 8, profile="h200", batch=batch, seq=seq, device=device)
    print(f"planned and built: {time.perf_counter() - started:.0f} s", flush=True)
    kinds = {type(m).__name__ for program in pm.programs for m in program.graph_module.modules()}
    sp = bool(kinds & {"ReduceScatterToTP", "GatherIntoTP"})
    figures: dict = {"model": model, "layers": layers, "batch": batch, "seq": seq, "dtype": str(dtype),
                     "sequence_parallel": sp}
    lines = [f"# Where the host's time goes: one training step of {model} ({layers} layers, {batch} x {seq}, "
             f"{str(dtype).removeprefix('torch.')}), one rank of tp 8 (fake backend) and serial, {device} "
             "(benchmarks/gpu_round.py, part host:gpt2-xl)", "",
             machine() + (f" GPU: {torch.cuda.get_device_name()}." if device != "cpu" else ""), "",
             f"The rank's plan: sequence parallelism by cost ({'chosen' if sp else 'not chosen'}). "
             "Process CPU is every thread's: on CUDA the autograd engine runs the backward pass on a thread of its "
             "own, which the calling thread's CPU time does not hold.", ""]
    for label, module in (("rank", pm), ("serial", serial)):
        step = H.training_step(module, inputs)
        clock = H.clocks(step, sync, 2 if quick else 5)
        single = H.clocks(H.one_thread(step), sync, 2 if quick else 5)
        no_cudnn = H.clocks(H.without_cudnn_attention(step), sync, 2 if quick else 5)
        stall = H.stalls(step, device)
        prof = H.profiled(step, sync, device)
        module.zero_grad(set_to_none=True)
        figures[label] = {"clock": clock, "one_thread": single, "no_cudnn_attention": no_cudnn, "stalls": stall,
                          "profile": prof}
        lines += H.lines(label, clock, prof, single, stall, no_cudnn)
        print("\n".join(H.lines(label, clock, prof, single, stall, no_cudnn)), flush=True)   # kept in the log if stopped
    figures["verdict"] = H.verdict(figures)
    publish(lines + ["Verdict: " + figures["verdict"]], md)
    return figures


def predicted_ops(device: str, quick: bool, md: str, model: str, layers: int, batch: int, seq: int) -> dict:
    """The model captured on the device and on meta, priced op by op (``benchmarks/predicted_ops.py``)."""
    import predicted_ops as P

    return P.part(device, quick, md, model, layers, batch, seq)


CHILDREN = {"rank": rank, "moe_compile": moe_compile, "rms_norm": rms_norm, "collectives": collectives,
            "rank_host": rank_host, "host_profile": host_profile, "predicted_ops": predicted_ops}


def child_main() -> None:
    ap = argparse.ArgumentParser(description="one part of a round (run by run_round)")
    ap.add_argument("--child", required=True, choices=sorted(CHILDREN))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--options", default="{}")
    ap.add_argument("--figures", required=True)
    ap.add_argument("--md", required=True)
    args = ap.parse_args()
    value = CHILDREN[args.child](args.device, args.quick, args.md, **json.loads(args.options))
    Path(args.figures).write_text(json.dumps(value, indent=1, default=str))


if __name__ == "__main__":
    child_main()
