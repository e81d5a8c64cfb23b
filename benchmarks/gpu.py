"""autotp on a GPU: the checks and the step-time benchmark of one device session, in one run.

    python3 benchmarks/gpu.py --out benchmarks/gpu.md
    python3 benchmarks/gpu.py --round issues-44-47 --out $OUT --budget 480   # issues 44 and 47's GPU points

``--round issues-44-47`` runs ``benchmarks/gpu_round.py``'s parts instead of the ones below (one
rank of tp 8 of the dense and MoE models, compiled MoE at tp 1, and the items noticed on the way:
its docstring lists them with their estimates), each in a child process, and writes their files
and ``summary.md`` into the folder ``--out``; ``benchmarks/gpu.md``'s header says which command
a device session runs and where the returned files go.

On a machine with one CUDA GPU (``--device cpu --quick`` rehearses every part on CPU, gloo in
place of NCCL and small sizes). Each part runs in local rank processes
(``autotp.distributed.launch.LocalCluster``), is timed, and lands in the result file whether it
passed or failed (a failure is a row with its error, never a stop); parts left when
``--budget`` seconds have passed are listed as not run.

1. **Profile**: ``autotp.cost_model.calibrate(device="cuda")``: bf16 matmul rate, memory
   bandwidth and memory of this GPU (the link from ``h100-dgx``: one GPU has no link to time),
   and the bf16 rate of the matrix products of a transformer layer at a few sizes.
2. **NCCL at tp 1**: ``autotp.parallelize`` in a one-rank NCCL world, every family of
   ``autotp.zoo`` against its serial model on the GPU (float64 and float32: loss, logits, every
   gradient), and ``torch.compile(pm, fullgraph=True)`` (inductor) against serial.
3. **tp 2 and 4 over gloo on CUDA tensors** (NCCL refuses two ranks on one GPU): every family at
   tp 2, GPT-2 and Llama with fewer kv heads than tp at tp 4, float64.
4. **The CUDA RNG tracker**: GPT-2 with dropout at tp 2 on the GPU: after three AdamW steps the
   replicated parameters are bitwise equal on both ranks; each random op draws equal masks where
   its output is replicated and different ones where it is sharded; under ``rng="counter"`` a
   compiled call draws the eager call's masks.
5. **Step time** (forward + backward, bf16, one GPU, NCCL world of one): a Llama trained three
   ways — HF eager, autotp's rank program, DTensor ``parallelize_module`` (the Megatron plan) —
   each eager and ``torch.compile``d; then tp 2 over gloo on the one GPU (autotp vs HF eager,
   eager; the collectives go through the host, so this measures that the path works and what
   the host round trips cost, not a multi-GPU speed-up). DTensor at tp 2 runs apart, last.

The parts that gather through torch's functional all-gather over gloo on CUDA tensors (the
compiled ones and DTensor's) run last, each in its own rank processes: under torch 2.11 that
gather kills the processes, and a part that dies takes only itself.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import MEGATRON_LLAMA, dtensor_llama, machine, publish  # noqa: E402

FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "gpt-neox", "gpt-j", "falcon", "falcon-new", "gpt-bigcode",
            "opt", "bert", "t5"]

# ------------------------------------------------------------------------------------ rank tasks

def _families(families: list[str], tp: int, dtype: str, device: str, structure: tuple) -> dict:
    """Every family's worst relative error (loss, logits, every gradient) against serial."""
    import torch.distributed as dist
    from tests.e2e.test_families import FLOAT32_ONLY, check_family_case

    out = {"backend": dist.get_backend()}
    for family in families:
        start = time.perf_counter()
        try:
            errors, *_ = check_family_case({"family": family, "structure": structure, "tp": tp, "dtype": dtype,
                                           "batch": 2, "seq": 7, "seed": 3, "device": device})
            worst = max(errors, key=errors.get)
            out[family] = {"error": errors[worst], "worst": worst, "s": time.perf_counter() - start,
                           "float32_only": dtype == "float64" and family in FLOAT32_ONLY}
        except Exception as e:   # recorded, the next family runs
            out[family] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                           "trace": traceback.format_exc()[-1500:]}
    return out


def _compiled(device: str, backend: str, dtype: str) -> dict:
    """torch.compile(pm, fullgraph=True) against serial: one graph, same loss/logits/gradients."""
    from tests.e2e.test_compile import _compiled_matches_serial

    return _compiled_matches_serial(backend, dtype, device)


def _dropout(device: str) -> dict:
    """The RNG tracker on ``device``, eager: replicated parameters stay bitwise equal through
    dropout training; masks equal where replicated, different where sharded."""
    from tests.e2e.test_dropout import _train_with_dropout

    drifted, same = _train_with_dropout(2, device)
    return {"drifted": drifted, "replicated equal": all(v for n, v in same.items() if "_replicated_" in n),
            "sharded differ": not any(v for n, v in same.items() if "_sharded_" in n),
            "random ops": len(same)}


def _dropout_compiled(device: str, compile_backend: str) -> dict:
    """Counter-based dropout compiled: the compiled call draws the eager call's masks."""
    from tests.e2e.test_compile import _dropout_compiled_as_in_eager

    return _dropout_compiled_as_in_eager(compile_backend, True, device)


def _llama(args, dtype, device):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max(2048, args.seq),
                         tie_word_embeddings=False, attention_dropout=0.0)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).train()


def _autotp_llama(args, dtype, device, tp: int):
    """autotp's rank program of the benchmark's Llama, pinned to Megatron's layout (the DTensor plan's)."""
    import autotp

    return autotp.parallelize(_llama(args, dtype, device), tp, batch=args.batch, seq=args.seq,
                              layout=MEGATRON_LLAMA, device=device)


def _dtensor(model, tp: int, device: str):
    from torch.distributed.device_mesh import init_device_mesh

    return dtensor_llama(model, init_device_mesh(torch.device(device).type, (tp,)))


def _step_times(args, device: str, versions: list[str], compile_backend: str, dtype: str | None = None) -> dict:
    """Forward + backward of one batch, each version in turn; medians over ``args.steps``."""
    import torch.distributed as dist

    tp = dist.get_world_size()
    dtype = getattr(torch, dtype or args.dtype)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    models, setup = {}, {}
    for v in versions:
        start = time.perf_counter()
        base = v.removesuffix("+compile")
        try:
            if base == "hf":
                m = _llama(args, dtype, device)
            elif base == "dtensor":
                m = _dtensor(_llama(args, dtype, device), tp, device)
            else:
                m = _autotp_llama(args, dtype, device, tp)
                m(input_ids=ids, labels=ids).loss.backward()    # eager first: the call's program is built
                m.zero_grad(set_to_none=True)
            if v.endswith("+compile"):
                m = torch.compile(m, backend=compile_backend)
            models[v] = m
        except Exception as e:
            models[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        setup[v] = time.perf_counter() - start

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    times, losses, first = {v: [] for v in versions}, {}, {}
    for v, m in list(models.items()):    # the first call compiles: timed apart, and a failure is recorded
        if isinstance(m, str):
            continue
        try:
            sync()
            start = time.perf_counter()
            loss = step(m)
            sync()
            first[v] = time.perf_counter() - start
            losses[v] = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        except Exception as e:
            models[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
        for v, m in models.items():
            if isinstance(m, str):
                continue
            dist.barrier()
            sync()
            start = time.perf_counter()
            step(m)
            sync()
            if i >= args.warmup:
                times[v].append(1e3 * (time.perf_counter() - start))
    return {"median_ms": {v: statistics.median(t) for v, t in times.items() if t},
            "best_ms": {v: min(t) for v, t in times.items() if t},
            "loss": losses, "first_call_s": first, "setup_s": setup,
            "failed": {v: m for v, m in models.items() if isinstance(m, str)},
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device != "cpu" else None}


def _where_time_goes(args, device: str, steps: int = 3) -> dict:
    """HF eager and autotp's rank program at tp 1 under ``torch.profiler``: per step, the wall
    time, the time the device was busy (kernels and copies), the kernels launched, and the ops
    with the most host time of their own (aten ops and autotp's Functions)."""
    from torch.profiler import ProfilerActivity, profile

    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(device)
    out = {}
    for v in ("hf", "autotp"):
        m = _autotp_llama(args, dtype, device, 1) if v == "autotp" else _llama(args, dtype, device)

        def step(m=m):
            m.zero_grad(set_to_none=True)
            m(input_ids=ids, labels=ids).loss.backward()

        for _ in range(3):
            step()
        sync()
        if device != "cpu":
            torch.cuda.reset_peak_memory_stats()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            wall = (time.perf_counter() - start) / steps
        events = prof.key_averages()
        dev = [e for e in prof.events() if e.device_type != torch.autograd.DeviceType.CPU]
        rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
        out[v] = {"wall_ms": 1e3 * wall,
                  "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device != "cpu" else None,
                  "device_busy_ms": sum(e.device_time_total for e in dev) / 1e3 / steps if dev else None,
                  "kernels": len(dev) / steps,
                  "host_ops": sum(e.count for e in events) / steps,
                  "top_self_cpu": [(e.key, e.count // steps, e.self_cpu_time_total / 1e3 / steps) for e in rows],
                  "top_device": [(e.key, e.count // steps, e.self_device_time_total / 1e3 / steps)
                                 for e in sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:15]]}
        del m
        if device != "cpu":
            torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------ main-process parts

def _profile(args) -> dict:
    from autotp.cost_model import calibrate

    if args.device == "cpu":
        prof = calibrate("cpu-rehearsal", world=2)
        sizes = [(256, 256, 256)]
    else:
        prof = calibrate("calibrated-cuda", device=args.device, matmul_sizes=(4096, 8192), repeats=5,
                         link_from="h100-dgx")
        # a transformer layer's products at hidden h, 4h MLP, b*s tokens (tokens x in x out)
        sizes = [(t, h, o) for h in (1024, 4096, 8192) for t in (2048, 16384) for o in (h, 4 * h)]
    from autotp.cost_model.measure import _best_time

    dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
    sync = torch.cuda.synchronize if args.device != "cpu" else (lambda: None)
    curve = []
    for t, h, o in sizes:
        a = torch.randn(t, h, device=args.device, dtype=dtype)
        w = torch.randn(h, o, device=args.device, dtype=dtype)

        def run(a=a, w=w):
            for _ in range(5):
                a @ w
            sync()

        curve.append({"tokens": t, "in": h, "out": o, "tflops": 5 * 2 * t * h * o / _best_time(run, 3) / 1e12})
    return {"profile": {k: getattr(prof, k) for k in ("name", "flops", "mem_bw", "link_bw", "link_latency",
                                                      "memory", "dtype_bytes")}, "gemm": curve}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small sizes (a CPU rehearsal)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds; parts not started by then are skipped")
    ap.add_argument("--only", nargs="*", default=None,
                    help="run only the parts whose names start with one of these (profile, nccl, gloo, rng, bench, ...)")
    ap.add_argument("--merge", default=None,
                    help="the .json of an earlier run: its parts that this run does not run are reported too, "
                         "marked as the earlier run's")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--families", nargs="*", default=FAMILIES, help="the families the equivalence parts run")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default: inductor on a GPU)")
    ap.add_argument("--note", default="", help="a sentence about this run, kept in its .json (for --merge)")
    ap.add_argument("--round", default=None, choices=["issues-44-47"],
                    help="run a round's parts instead (benchmarks/gpu_round.py): --out names a folder, --only, "
                         "--budget, --device and --quick apply")
    args = ap.parse_args()
    if args.round:
        from gpu_round import run_round

        run_round(args.round, args.out or "gpu_round_out", args.device, args.quick, args.budget, args.only)
        return
    if args.quick:
        args.layers, args.hidden, args.ffn, args.heads, args.kv_heads, args.vocab = 2, 64, 128, 4, 2, 256
        args.batch, args.seq, args.warmup, args.steps = 2, 32, 1, 2
    from autotp.distributed.launch import LocalCluster

    gpu = args.device != "cpu"
    first_backend = "nccl" if gpu else "gloo"
    compile_backend = args.compile_backend or ("inductor" if gpu else "aot_eager")
    started = time.perf_counter()
    results: dict = {"args": vars(args), "parts": {}, "note": args.note}
    json_path = (os.path.splitext(args.out)[0] + ".json") if args.out else None

    def chosen(name: str) -> bool:
        return args.only is None or any(name.startswith(o) for o in args.only)

    def cluster(world: int, backend: str, timeout: int, *names: str):
        """Rank processes for the parts ``names``; none (a do-nothing context) where --only
        leaves them all out: spawning them costs seconds of device time."""
        return LocalCluster(world, backend=backend, timeout=timeout) if any(map(chosen, names)) \
            else contextlib.nullcontext()

    def part(name: str, fn, *a) -> None:
        if not chosen(name):
            return
        if time.perf_counter() - started > args.budget:
            results["parts"][name] = {"skipped": f"budget of {args.budget:.0f} s spent"}
            return
        start = time.perf_counter()
        try:
            value = fn(*a)
            results["parts"][name] = {"value": value}
        except Exception as e:
            results["parts"][name] = {"failed": f"{type(e).__name__}: {str(e)[:2000]}",
                                      "trace": traceback.format_exc()[-3000:]}
        results["parts"][name]["s"] = time.perf_counter() - start
        print(f"[{time.perf_counter() - started:6.1f} s] {name}: "
              f"{json.dumps(results['parts'][name], default=str)[:3000]}", flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(results, f, indent=1, default=str)

    results["machine"] = machine()
    if gpu:
        results["gpu"] = torch.cuda.get_device_name(0)
    import transformers

    results["transformers"] = transformers.__version__
    part("profile", _profile, args)
    one = (2, 4, 2, 8, 48, 1.0)
    with cluster(1, first_backend, 600, "nccl:", "bench:tp1", "prof:tp1") as c:
        part("nccl:families float64", lambda: c.run(_families, args.families, 1, "float64", args.device, one)[0])
        part("nccl:families float32", lambda: c.run(_families, ["gpt2", "llama", "bert", "t5"], 1, "float32",
                                                    args.device, one)[0])
        part("nccl:compile", lambda: c.run(_compiled, args.device, compile_backend, "float32")[0])
        part("bench:tp1", lambda: c.run(_step_times, args, args.device,
                                        ["hf", "autotp", "dtensor", "hf+compile", "autotp+compile",
                                         "dtensor+compile"], compile_backend)[0])
        part("prof:tp1", lambda: c.run(_where_time_goes, args, args.device)[0])
    with cluster(2, "gloo", 300, "gloo:families tp2", "rng:dropout") as c:
        part("gloo:families tp2 float64", lambda: c.run(_families, args.families, 2, "float64", args.device, one))
        part("rng:dropout tp2", lambda: c.run(_dropout, args.device))
    with cluster(3, "gloo", 300, "gloo:families tp3") as c:   # uneven heads: 4 over 3 ranks
        part("gloo:families tp3 float64", lambda: c.run(_families, ["gpt2", "llama", "falcon-new", "gpt-bigcode"], 3,
                                                        "float64", args.device, (2, 4, 2, 8, 50, 1.0)))
    with cluster(4, "gloo", 300, "gloo:families tp4") as c:
        part("gloo:families tp4 float64", lambda: c.run(_families, ["gpt2", "llama", "falcon-new"], 4, "float64",
                                                        args.device, (2, 6, 2, 4, 53, 1.0)))
    for dtype in (args.dtype, "float32"):   # a cluster each: a crash in one leaves the other's result
        with cluster(2, "gloo", 300, f"bench2:tp2 gloo {dtype}") as c:
            part(f"bench2:tp2 gloo {dtype}", lambda: c.run(_step_times, args, args.device, ["hf", "autotp"],
                                                           compile_backend, dtype))
    # Last, a cluster each: compiled programs and DTensor gather through torch's functional
    # all-gather, which kills both processes under torch 2.11 when gloo carries CUDA tensors
    # (benchmarks/gloo_cuda_probe.py); autotp's eager path above goes through c10d's.
    with cluster(2, "gloo", 300, "rng:compiled tp2") as c:
        part("rng:compiled tp2", lambda: c.run(_dropout_compiled, args.device, compile_backend))
    with cluster(2, "gloo", 300, "gloo:compile tp2") as c:
        part("gloo:compile tp2", lambda: c.run(_compiled, args.device, compile_backend, "float64"))
    with cluster(2, "gloo", 300, f"bench2:tp2 gloo {args.dtype} dtensor") as c:
        part(f"bench2:tp2 gloo {args.dtype} dtensor", lambda: c.run(_step_times, args, args.device, ["dtensor"],
                                                                    compile_backend, args.dtype))
    results["total_s"] = time.perf_counter() - started
    if args.merge:
        with open(args.merge) as f:
            earlier = json.load(f)
        results["earlier"] = {"machine": earlier.get("machine"), "gpu": earlier.get("gpu"),
                              "note": earlier.get("note", "")}
        for name, value in earlier["parts"].items():
            if name not in results["parts"] and "skipped" not in value:
                results["parts"][name] = dict(value, earlier=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1, default=str)
    publish(report(results, " ".join(sys.argv[1:])), args.out)


# ------------------------------------------------------------------------------------ the result file

ROUND_NOTE = [
    "**Next device session (issues 44 and 47):** `PYTHONUNBUFFERED=1 python3 benchmarks/gpu.py --round "
    "issues-44-47 --out $OUT --budget 480`, the device call's `timeout_s` 600 (parts 1-4 of "
    "`benchmarks/gpu_round.py`, about 6 minutes), then, if the session's device time allows, `--only "
    "rank:qwen3-30b-a3b nccl rank:gpt2-xl host:cuda --budget 240`. What comes back under `$OUT` (three files): `summary.md` "
    "(per issue point, the figures against the goal; where a stopped run left none, `python3 "
    "benchmarks/gpu_summary.py round.json` writes it) goes to `benchmarks/gpu_round.md`; `round.json` and the "
    "parts' `.md` files (unpacked from `parts.tgz`: `tar xzf parts.tgz`) to "
    "`benchmarks/measurements/<gpu>-<date>/`, the `.log` of a part only where it failed "
    "(`benchmarks/measurements/h200-2026-11-30/` shows the layout). Parts not run at the budget: rerun them "
    "alone with `--only <part> ...`.", ""]


def report(results: dict, argv: str) -> list[str]:
    parts = results["parts"]
    lines = ["# autotp on a GPU: NCCL, CUDA tensors over gloo, the CUDA RNG tracker, a calibrated profile, "
             "step times", "",
             f"Command: `python3 benchmarks/gpu.py {argv}`", "",
             results["machine"] + (f" GPU: {results['gpu']}." if "gpu" in results else "")
             + f" transformers {results['transformers']}. Whole run {results.get('total_s', 0):.0f} s.", ""] + ROUND_NOTE

    def status(name: str) -> str | None:
        p = parts.get(name)
        if p is None:
            return "not run (--only)"
        if p.get("earlier") and "failed" in p:
            return "FAILED in the earlier run: " + p["failed"].splitlines()[0]
        if "skipped" in p:
            return "not run: " + p["skipped"]
        if "failed" in p:
            return "FAILED: " + p["failed"].splitlines()[0]
        return None

    def tag(name: str) -> str:
        return " (earlier run)" if parts.get(name, {}).get("earlier") else ""

    if "earlier" in results:
        lines += ["Parts marked \"earlier run\" come from an earlier run of this script (`--merge`): "
                  f"{results['earlier']['machine']} GPU: {results['earlier']['gpu']}. "
                  + results["earlier"]["note"], ""]
    lines += [f"## Calibrated profile{tag('profile')}", ""]
    s = status("profile")
    if s:
        lines += [s, ""]
    else:
        prof = parts["profile"]["value"]["profile"]
        lines += [f"`calibrate(device=...)`: {prof['flops'] / 1e12:.0f} TFLOP/s (best square bf16 matmul), "
                  f"{prof['mem_bw'] / 1e9:.0f} GB/s memory bandwidth (a + b, counting two reads and a write), "
                  f"{prof['memory'] / 2**30:.0f} GiB; link taken from h100-dgx "
                  f"({prof['link_bw'] / 1e9:.0f} GB/s, {prof['link_latency'] * 1e6:.1f} us per step: one GPU has "
                  "no link to time).", "",
                  "Matrix products of a layer (tokens x in) @ (in x out), five in a row, best of three:", "",
                  "| tokens | in | out | TFLOP/s |", "|---|---|---|---|"]
        lines += [f"| {g['tokens']} | {g['in']} | {g['out']} | {g['tflops']:.0f} |"
                  for g in parts["profile"]["value"]["gemm"]]
        lines.append("")

    lines += ["## Equivalence with the serial model on the device", "",
              "Worst relative error over loss, logits and every gradient (the families test's own check, "
              "`tests/e2e/test_families.py::check_family_case`, on the device's tensors). Bounds: float64 1e-9, "
              "float32 1e-4 (GPT-J float32-only: its attention upcasts to float32).", ""]
    for name in ("nccl:families float64", "nccl:families float32", "gloo:families tp2 float64",
                 "gloo:families tp3 float64", "gloo:families tp4 float64"):
        s = status(name)
        if s:
            lines += [f"- {name}: {s}"]
            continue
        value = parts[name]["value"]
        per_rank = value if isinstance(value, list) else [value]
        fams = [k for k in per_rank[0] if k != "backend"]
        cells = []
        for fam in fams:
            rs = [r[fam] for r in per_rank]
            if any("failed" in r for r in rs):
                cells.append(f"{fam} FAILED ({next(r['failed'] for r in rs if 'failed' in r)})")
            else:
                cells.append(f"{fam} {max(r['error'] for r in rs):.1e}")
        lines += [f"- {name}{tag(name)} (backend {per_rank[0]['backend']}, {len(per_rank)} rank(s)): " + "; ".join(cells)]
    lines.append("")

    lines += ["## torch.compile and the RNG tracker", ""]
    for name in ("nccl:compile", "gloo:compile tp2"):
        s = status(name)
        if s:
            lines.append(f"- {name}: {s}")
        else:
            v = parts[name]["value"]
            rs = v if isinstance(v, list) else [v]
            lines.append(f"- {name}{tag(name)}: worst error {max(r['worst'] for r in rs):.1e}, one graph "
                         "(compiled with fullgraph=True)")
    rng_rows = {   # each rank's row of the two RNG parts
        "rng:dropout tp2": lambda r: (f"replicated parameters drifted after three AdamW steps: {r['drifted'] or 'none'}; "
                                      f"{r['random ops']} random ops: replicated masks equal {r['replicated equal']}, "
                                      f"sharded masks differ {r['sharded differ']}"),
        "rng:compiled tp2": lambda c: (f"counter-based dropout compiled vs eager: loss {c['loss']:.1e}, gradients "
                                       f"{c['grads']:.1e}, one graph (fullgraph=True), ranks agree "
                                       f"{c['ranks agree']}"),
    }
    for name, row in rng_rows.items():
        s = status(name)
        if s:
            lines.append(f"- {name}: {s}")
            continue
        for i, r in enumerate(parts[name]["value"]):
            lines.append(f"- {name}{tag(name)} rank {i}: {row(r)}")
    lines.append("")

    a = results["args"]
    lines += ["## Step time", "",
              f"`LlamaForCausalLM`, {a['layers']} layers, hidden {a['hidden']}, intermediate {a['ffn']}, "
              f"{a['heads']} heads ({a['kv_heads']} kv), vocab {a['vocab']}, {a['dtype']}, batch {a['batch']} x "
              f"seq {a['seq']}, labels = inputs. Step = zero_grad + forward + backward, synchronized; "
              f"{a['warmup']} warm-up steps, {a['steps']} timed, the versions taking turns. autotp is pinned to "
              "Megatron's layout (the DTensor plan's); at tp 1 every collective is a no-op, so the table compares "
              "the runtimes' own overhead.", ""]
    for name in ["bench:tp1"] + [k for k in parts if k.startswith("bench2:")]:
        s = status(name)
        if s:
            lines += [f"{name}: {s}", ""]
            continue
        v = parts[name]["value"]
        rs = v if isinstance(v, list) else [v]
        r0 = rs[0]
        med = {k: max(r["median_ms"][k] for r in rs) for k in r0["median_ms"]}
        best = {k: max(r["best_ms"][k] for r in rs) for k in r0["best_ms"]}
        base = med.get("hf")
        lines += [f"### {name}{tag(name)}", "", "| version | ms median | ms best | vs HF eager | loss | first call s |",
                  "|---|---|---|---|---|---|"]
        for k in med:
            ratio = f"{med[k] / base:.2f}x" if base else "-"
            lines.append(f"| {k} | {med[k]:.2f} | {best[k]:.2f} | {ratio} | {r0['loss'].get(k, float('nan')):.4f} "
                         f"| {r0['first_call_s'].get(k, 0):.1f} |")
        for k, why in r0["failed"].items():
            lines.append(f"| {k} | FAILED: {why} | | | | |")
        if r0.get("peak_gib") is not None:
            lines.append(f"\nPeak memory allocated on rank 0 during the timed steps: {r0['peak_gib']:.1f} GiB.")
        lines.append("")
    s = status("prof:tp1")
    if s != "not run (--only)":
        lines += [f"## Where the time goes at tp 1{tag('prof:tp1')}", ""]
        if s:
            lines += [s, ""]
        else:
            v = parts["prof:tp1"]["value"]
            lines += ["`torch.profiler` over three steps of each (the same Llama), per step:", "",
                      "| version | wall ms | device busy ms | device kernels | host ops | peak GiB |",
                      "|---|---|---|---|---|---|"]
            for k, r in v.items():
                busy = f"{r['device_busy_ms']:.2f}" if r["device_busy_ms"] is not None else "-"
                peak = f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "-"
                lines.append(f"| {k} | {r['wall_ms']:.2f} | {busy} | {r['kernels']:.0f} | {r['host_ops']:.0f} | {peak} |")
            for k, r in v.items():
                lines += ["", f"{k}: the ops with the most host time of their own (calls and ms per step): "
                          + "; ".join(f"`{n}` {c} {ms:.2f}" for n, c, ms in r["top_self_cpu"][:12])]
            lines.append("")
    return lines


if __name__ == "__main__":
    main()
