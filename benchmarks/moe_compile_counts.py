"""What ``torch.compile(pm)`` at tp 1 runs beside ``torch.compile(model)`` (HF's own module), in
counts that do not depend on the machine's load: the graphs inductor compiles (ATen ops of the
forward and backward graphs, kernels generated and called, extern calls), the guards dynamo
checks before every call (by kind; the Python lambdas among them), what runs outside the
compiled region in backward (autograd nodes, post-accumulate hooks), and the minor page faults
of a step; beside them a few host times measured in isolation (the guard check, one hook).

    python benchmarks/moe_compile_counts.py --out benchmarks/moe_compile_counts.md
    python benchmarks/moe_compile_counts.py --family llama

The model and batch are ``benchmarks/moe_compile.py``'s. Each module is compiled in a process of
its own (the page faults of a step depend on the heap's history, which the other module would
share), with inductor's FX graph cache off so that its code is generated here.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_compile import BATCH, FAMILIES, SEQ, WIDTHS  # noqa: E402

NAMES = {"hf": "HF compiled", "autotp": "autotp tp=1 compiled"}
STEPS = 30


def _aten_ops(gm) -> collections.Counter:
    """The graph's call_function targets, by ATen packet (``aten.mm``) or name."""
    ops = collections.Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            t = node.target
            name = (f"{t.namespace}.{t._opname}" if hasattr(t, "_opname") and hasattr(t, "namespace")
                    else getattr(t, "__name__", str(t)))
            ops[name] += 1
    return ops


def _kernels(source: str) -> dict:
    """Inductor's output code: kernels it generated, the calls of them and of extern kernels in
    the graph's ``call``, the buffers it allocates."""
    body = source.split("def call(", 1)[-1]
    return {"kernels generated": len(re.findall(r"^(cpp_fused_\w+|triton_\w+) = async_compile", source, re.M)),
            "kernel calls": len(re.findall(r"^\s+(cpp_fused_\w+|triton_\w+)(\.run)?\(", body, re.M)),
            "extern calls": len(re.findall(r"^\s+\w+ = (extern_kernels\.\w+|torch\.ops\.\w+\.\w+\.\w+)\(", body, re.M))
            + len(re.findall(r"^\s+extern_kernels\.\w+\(", body, re.M)),
            "buffers allocated": len(re.findall(r"= empty_strided_\w+\(", body))}


def _guards(guard_manager) -> collections.Counter:
    """The guard tree's leaf guards by kind (a relational guard, checked at several places, once)."""
    from torch._C._dynamo.guards import DictGuardManager

    kinds, held = collections.Counter(), {}   # held: the guards seen, alive, so that ids stay theirs
    stack = [guard_manager.root]
    while stack:
        mgr = stack.pop()
        for guard in mgr.get_leaf_guards():
            if id(guard) not in held:
                held[id(guard)] = guard
                kinds[type(guard).__name__] += 1
                if type(guard).__name__ == "LAMBDA_GUARD":   # one Python function, checking each part
                    kinds["Python lambda parts"] += len(guard.verbose_code_parts())
        if isinstance(mgr, DictGuardManager):
            stack.extend(m for pair in mgr.get_key_value_managers().values() for m in pair if m is not None)
        stack.extend(mgr.get_child_managers())
    for guard in getattr(guard_manager.root, "get_epilogue_lambda_guards", lambda: [])():
        kinds[type(guard).__name__] += 1
    return kinds


def measure(which: str, family: str) -> dict:
    """Build, compile and step one module; its counts."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    import autotp
    from autotp import zoo

    torch.set_num_threads(1)
    inductor_config.fx_graph_cache = False
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{29400 + os.getpid() % 500}")
    extra = FAMILIES[family]
    config = zoo.tiny_config(family, positions=SEQ, **WIDTHS, **extra)
    if extra:
        config._experts_implementation = "grouped_mm"
    batch = zoo.example_batch(family, config, batch=BATCH, seq=SEQ, seed=1)
    module = zoo.build(family, config, seed=0)
    if which == "autotp":
        module = autotp.parallelize(module, 1, batch=BATCH, seq=SEQ)
    module(**batch).loss.backward()   # eager first, as the benchmark (autotp: the program is built)
    module.zero_grad()

    graphs = []   # AOT's forward and backward graphs, as inductor gets them

    def inner(gm, *args, **kwargs):
        graphs.append(gm)
        return compile_fx_inner(gm, *args, **kwargs)

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=inner)

    torch._dynamo.reset()
    counters.clear()
    PyCodeCache.cache_clear()
    compiled = torch.compile(module, backend=backend)
    for _ in range(3):
        compiled(**batch).loss.backward()
    sources = [Path(m.__file__).read_text() for m in PyCodeCache.modules]
    out = {"dynamo graphs": counters["stats"]["unique_graphs"], "graph breaks": sum(counters["graph_break"].values())}
    ops = [_aten_ops(g) for g in graphs]
    out["ops"] = {"forward": dict(ops[0]), "backward": dict(ops[1]) if len(ops) > 1 else {}}
    for key in ("kernels generated", "kernel calls", "extern calls", "buffers allocated"):
        out[key] = sum(_kernels(s)[key] for s in sources)
    placeholders = [sum(n.op == "placeholder" for n in g.graph.nodes) for g in graphs]
    outputs = [len(next(n for n in g.graph.nodes if n.op == "output").args[0]) for g in graphs]
    out["forward graph inputs / outputs"] = f"{placeholders[0]} / {outputs[0]}"

    # the guards of the one compiled frame, and the time of checking them
    entries = [e for code in (type(module).forward, torch.nn.Module._call_impl)
               for e in _debug_get_cache_entry_list(code)]
    manager = entries[0].guard_manager
    out["guards"] = dict(_guards(manager))
    fn = type(module).forward   # HF's forward is a decorator's wrapper: its closure is in the frame
    closure = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    frames = [{"self": module, "args": (), "kwargs": batch, **closure},   # forward(self, *args, **kwargs)
              {"args": (module,), "kwargs": batch, **closure}]   # a wrapper(*args, **kwargs)
    frame = next((f for f in frames if manager.check(f)), None)
    assert frame is not None, manager.check_verbose(frames[0]).verbose_code_parts
    n = 2000
    start = time.process_time()
    for _ in range(n):
        manager.check(frame)
    out["guard check us"] = (time.process_time() - start) / n * 1e6

    # outside the compiled region in backward: autograd nodes, post-accumulate hooks
    loss = compiled(**batch).loss
    nodes, seen, stack = collections.Counter(), set(), [loss.grad_fn]
    hooks = []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes[type(node).__name__] += 1
        if type(node).__name__ == "AccumulateGrad":
            hooks += list((node.variable._post_accumulate_grad_hooks or {}).values())
        stack.extend(f for f, _ in node.next_functions)
    loss.backward()
    out["autograd nodes outside"] = dict(nodes)
    out["post-accumulate hooks per step"] = len(hooks)
    if hooks:   # one hook's host time, its gradient a few elements (the add it does is HF's too)
        leaf = next(v for v in (n.variable for n in seen if type(n).__name__ == "AccumulateGrad")
                    if v._post_accumulate_grad_hooks and v.numel() < 4096)
        grad = torch.zeros_like(leaf)
        start = time.process_time()
        for _ in range(n):
            leaf.grad = grad.clone()
            for hook in leaf._post_accumulate_grad_hooks.values():
                hook(leaf)
        spent = time.process_time() - start
        start = time.process_time()
        for _ in range(n):
            leaf.grad = grad.clone()
            leaf.grad = None
        out["one hook us"] = (spent - (time.process_time() - start)) / n * 1e6
    module.zero_grad()

    faults, user, system = [], [], []
    for _ in range(STEPS):
        before = resource.getrusage(resource.RUSAGE_SELF)
        compiled(**batch).loss.backward()
        after = resource.getrusage(resource.RUSAGE_SELF)
        faults.append(after.ru_minflt - before.ru_minflt)
        user.append(after.ru_utime - before.ru_utime)
        system.append(after.ru_stime - before.ru_stime)
    out["minor page faults per step (median)"] = statistics.median(faults)
    out["user / system CPU ms per step (median)"] = (f"{statistics.median(user) * 1e3:.1f} / "
                                                     f"{statistics.median(system) * 1e3:.1f}")
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="mixtral", choices=sorted(FAMILIES))
    parser.add_argument("--one", default=None, choices=sorted(NAMES), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.one:   # a child process: one module's counts as JSON on the last line
        print(json.dumps(measure(args.one, args.family)))
        return
    from common import machine, publish

    started, load = time.time(), os.getloadavg()
    found = {}
    for which in NAMES:
        done = subprocess.run([sys.executable, __file__, "--family", args.family, "--one", which],
                              capture_output=True, text=True, check=True)
        found[which] = json.loads(done.stdout.strip().splitlines()[-1])
    hf, ours = found["hf"], found["autotp"]
    flags = "" if args.family == "mixtral" else f" --family {args.family}"
    lines = [f"# Compiled {args.family} at tp 1: what each compiled program runs, in counts", "",
             f"Command: `python benchmarks/moe_compile_counts.py{flags} --out ...`", "",
             machine() + " Load average at the start: {:.1f}, {:.1f}, {:.1f}.".format(*load)
             + f" Wall time {time.time() - started:.0f} s.", "",
             f"The model and batch of `benchmarks/moe_compile.py` ({args.family}); each module compiled with "
             "inductor in a process of its own, three steps, then counted. Times (µs) are measured in "
             "isolation: the guard check over 2000 calls, one post-accumulate hook on a small parameter.", "",
             "| | HF compiled | autotp tp=1 compiled |", "|---|---|---|"]
    for key in hf:
        if key in ("ops", "guards", "autograd nodes outside"):
            continue
        fmt = (lambda v: f"{v:.1f}") if key.endswith("us") else str   # noqa: E731
        lines.append(f"| {key} | {fmt(hf[key])} | {fmt(ours.get(key, '-'))} |")
    for key in ("one hook us",):
        if key not in hf and key in ours:
            lines.append(f"| {key} | - | {ours[key]:.1f} |")
    for part in ("forward", "backward"):
        a, b = hf["ops"][part], ours["ops"][part]
        lines.append(f"| ATen ops, {part} graph | {sum(a.values())} | {sum(b.values())} |")
    def guards(kinds: dict) -> str:
        total = sum(v for k, v in kinds.items() if k != "Python lambda parts")
        return (f"{total} ({kinds.get('LAMBDA_GUARD', 0)} Python lambdas of {kinds.get('Python lambda parts', 0)} "
                f"checks, {kinds.get('TENSOR_MATCH', 0)} tensor matches)")

    lines.append(f"| guards | {guards(hf['guards'])} | {guards(ours['guards'])} |")
    nodes = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items()))   # noqa: E731
    lines.append(f"| autograd nodes outside the compiled region | {nodes(hf['autograd nodes outside'])} | "
                 f"{nodes(ours['autograd nodes outside'])} |")
    lines += ["", "Ops one program's graphs run a different number of times than the other's (HF - autotp):", ""]
    for part in ("forward", "backward"):
        a, b = hf["ops"][part], ours["ops"][part]
        diff = {op: a.get(op, 0) - b.get(op, 0) for op in sorted(set(a) | set(b)) if a.get(op, 0) != b.get(op, 0)}
        lines.append(f"- {part}: " + (", ".join(f"{op} {d:+d}" for op, d in diff.items()) or "none"))
    kinds = sorted((set(hf["guards"]) | set(ours["guards"])) - {"Python lambda parts"})
    lines += ["", "Guards by kind (HF / autotp): " + ", ".join(
        f"{k} {hf['guards'].get(k, 0)} / {ours['guards'].get(k, 0)}" for k in kinds) + "."]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
