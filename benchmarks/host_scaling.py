"""Does a rank's host work grow with the data? One rank of tp 8 (fake backend) against serial, a
narrow GPT-2 at the real batch, sequence and vocabulary and at small ones.

A gpt2-xl rank of tp 8 on an H200 measured 67.8 ms wall a step with about 13 ms of kernels,
where the host's work per step measured at tiny widths was far less: this asks, on CPU, whether
anything the host does grows with batch x seq or the vocabulary. A GPT-2 of hidden 64 (8 heads),
2 layers, its residual dropout kept (0.1: the RNG tracker runs, as in the GPU rank), Megatron's
layout pinned with sequence parallelism (``autotp.testing.host.MEGATRON``), batch 8 x seq 128
and 1024, vocabulary 128 and 50257. Per training step (forward with labels, backward), after a
warm-up:

* **counts** (the same on any machine): ATen calls (a dispatch mode), Python calls
  (``sys.setprofile``), reads of device values on the host and blocking copies to it
  (``tests/runtime/test_host_syncs.py``'s ``HostReads``, ``deferred_checks`` off as on the fake
  backend, and on as under NCCL), and fresh buffers (factory ops: calls and MB);
* **the forward's share** of a training step's host work (``--halves``: ``benchmarks/rank_host.py``'s
  tiny 12-layer GPT-2), which is what a calling thread's clock holds on CUDA;
* **host time outside the ATen calls** (``benchmarks/op_timer.py``: the least whole step's
  thread time less the sum of its calls, each at its least): Python, the autograd engine and the
  dispatcher around the kernels, which a loop over tokens or the vocabulary would grow.

    python benchmarks/host_scaling.py                # writes benchmarks/host_scaling.md
    python benchmarks/host_scaling.py --shapes 128:128 --out -
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "runtime"))
from benchmarks.common import machine, publish  # noqa: E402
from benchmarks.op_timer import ALLOC_OPS, module_step, op_times  # noqa: E402


class Fresh(TorchDispatchMode):
    """Factory ops' calls and the bytes of what they make (a fresh buffer each; a meta tensor, which
    holds no memory, counted as a call of no bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket).replace("aten::", "").removeprefix("aten.")
        if name in ALLOC_OPS and name not in ("fill_", "zero_"):
            self.calls += 1
            self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves(out)
                              if isinstance(t, torch.Tensor) and t.device.type != "meta")
        return out


def build(vocab: int, seq: int, layers: int):
    import autotp
    from autotp import zoo
    from autotp.testing.host import MEGATRON

    config = zoo.tiny_config("gpt2", layers=layers, heads=8, head_dim=8, vocab=vocab, positions=1024)
    config.resid_pdrop = 0.1
    model = zoo.build("gpt2", config, seed=0)
    batch = zoo.example_batch("gpt2", config, batch=8, seq=seq, seed=1)
    pm = autotp.parallelize(model, 8, profile="h200", batch=8, seq=1024, layout=MEGATRON["gpt2"],
                            sequence_parallel=True)
    return model, pm, batch


def reads(module, batch: dict, deferred: bool) -> int:
    import test_host_syncs as T

    if hasattr(module, "deferred_checks"):
        module.deferred_checks = deferred
    step = module_step(module, batch)
    step()
    with T.HostReads(T._device_tensors(module, batch)) as mode:
        step()
    if hasattr(module, "flush_checks"):
        module.flush_checks()
    return len(mode.reads)


def measure(module, batch: dict, repeats: int) -> dict:
    from autotp.testing.host import AtenCalls, PythonCalls

    step = module_step(module, batch)
    step()
    with AtenCalls() as aten:
        step()
    with PythonCalls() as python:
        step()
    with Fresh() as fresh:
        step()
    ops = op_times(step, repeats)
    module.zero_grad(set_to_none=True)
    return {"aten": aten.total, "python": python.total, "fresh": fresh.calls, "fresh_mb": fresh.bytes / 1e6,
            "reads": reads(module, batch, False), "reads_deferred": reads(module, batch, True),
            "step_ms": ops.step * 1e3, "outside_ms": (ops.step - ops.total) * 1e3}


def halves(layers: int, repeats: int) -> list[str]:
    """The forward's share of a training step's host work, ``benchmarks/rank_host.py``'s tiny GPT-2
    (batch 1 x seq 16, vocabulary 128, no dropout) and its sequence-parallel rank: thread ms of the
    forward and of the whole step (the least of ``repeats``), ATen calls of each half. On CUDA the
    autograd engine runs the backward on a thread of its own: a calling thread's clock holds the
    forward alone."""
    import autotp
    from autotp.testing.host import MEGATRON, AtenCalls
    from benchmarks.rank_host import tiny

    model, batch = tiny("gpt2", layers, 16)
    pm = autotp.parallelize(model, 8, profile="h200", batch=8, seq=1024, layout=MEGATRON["gpt2"],
                            sequence_parallel=True)
    out = ["", f"The forward's share of a training step's host work: GPT-2 of {layers} layers, hidden 64, batch 1 x "
           "seq 16, vocabulary 128 (`benchmarks/rank_host.py`'s), thread ms the least of the repeats:", "",
           "| program | forward ms | step ms | forward's share | ATen calls: forward / backward |", "|---|---|---|---|---|"]
    for label, module in (("serial", model), ("rank, sequence-parallel", pm)):
        forward, whole = float("inf"), float("inf")
        for i in range(repeats + 3):
            module.zero_grad(set_to_none=True)
            start = time.thread_time()
            loss = module(**batch).loss
            mid = time.thread_time()
            loss.backward()
            if i >= 3:   # after a warm-up
                forward, whole = min(forward, mid - start), min(whole, time.thread_time() - start)
        module.zero_grad(set_to_none=True)
        with AtenCalls() as fwd:
            loss = module(**batch).loss
        with AtenCalls() as bwd:
            loss.backward()
        out.append(f"| {label} | {forward * 1e3:.2f} | {whole * 1e3:.2f} | {forward / whole:.0%} | "
                   f"{fwd.total} / {bwd.total} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["128:128", "128:1024", "50257:128", "50257:1024"],
                   help="vocab:seq (batch 8)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--halves", type=int, default=12, help="layers of the forward/backward table (0: none)")
    p.add_argument("--note", default=None, help="a line on the machine's state")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    started = time.time()
    lines = ["# Does a rank's host work grow with the data? (one rank of tp 8 against serial)", "",
             "Command: `python benchmarks/host_scaling.py " + shlex.join(sys.argv[1:]) + "`", "", machine(),
             f"1 torch thread; load average at the start {os.getloadavg()[0]:.1f}." + (f" {args.note}" if args.note else ""),
             "", f"GPT-2, hidden 64 (8 heads), {args.layers} layers, residual dropout 0.1, batch 8; the rank: Megatron's "
             "layout with sequence parallelism, tp 8 rank 0 on the fake backend. Counts per training step: ATen calls, "
             "Python calls, fresh buffers (factory ops: calls, MB), host reads of device values or blocking copies to "
             "the host (with the checks read at once, as on the fake backend, and deferred, as under NCCL). 'Outside "
             "ATen' is the least step's thread time less its ATen calls' (each at its least over the repeats): the "
             "host's work around the kernels. The step's ms on CPU holds the kernels, which grow with the data.", "",
             "| vocab | seq | program | ATen calls | Python calls | fresh buffers (MB) | host reads: at once / deferred | "
             "step ms | outside ATen ms |", "|---|---|---|---|---|---|---|---|---|"]
    for shape in args.shapes:
        vocab, seq = (int(x) for x in shape.split(":"))
        model, pm, batch = build(vocab, seq, args.layers)
        for label, module in (("serial", model), ("rank", pm)):
            r = measure(module, batch, args.repeats)
            lines.append(f"| {vocab} | {seq} | {label} | {r['aten']} | {r['python']} | {r['fresh']} "
                         f"({r['fresh_mb']:.1f}) | {r['reads']} / {r['reads_deferred']} | {r['step_ms']:.1f} | "
                         f"{r['outside_ms']:.1f} |")
            print(lines[-1], flush=True)
        del model, pm
    if args.halves:
        lines += halves(args.halves, 20)
    lines += ["", f"Whole run {time.time() - started:.0f} s; load average at the end {os.getloadavg()[0]:.1f}."]
    publish(lines, None if args.out == "-" else (args.out or Path(__file__).with_suffix(".md")))


if __name__ == "__main__":
    main()
