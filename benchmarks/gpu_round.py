"""The GPU points of issues 44 and 47 in one device run: ``benchmarks/gpu.py --round issues-44-47``.

    python3 benchmarks/gpu.py --round issues-44-47 --out $OUT --budget 480   # one CUDA GPU, about 8 min
    python3 benchmarks/gpu.py --round issues-44-47 --device cpu --quick --out /tmp/round   # CPU rehearsal

Each part runs in a child process of its own (``benchmarks/gpu_parts.py``),
with a time cap: a part that fails, dies or runs over is a row with its error, never a stop, and
the parts after it still run; the parts not started when ``--budget`` seconds have passed are
listed as not run. Each part writes ``<part>.md`` (where it has a table of its own) and
``<part>.log`` beside ``$OUT`` (``$OUT-parts``), packed after every part into ``$OUT/parts.tgz``
(a device run hands back at most eight files), and its figures to ``$OUT/round.json``, rewritten
after every part, so what a killed run finished comes back; ``$OUT/summary.md``
(``benchmarks/gpu_summary.py``) says per issue point what the figures show against its goal. The parts, most important first (:data:`ROUND`), with the seconds each
is estimated to take on an H200 (child start-up, about 10 s, included):

1. ``rank:llama-3-8b`` (issue 44, point 3; 130 s): one rank of tp 8 on the fake backend
   (``benchmarks/rank_efficiency.py``), Llama-3-8B 4 layers, 2 x 4096, bf16, eager and compiled,
   with the device's busy share and the time per ATen op beside serial/8. The 2026-11-30 round
   measured 0.67 / 0.74, 3.6 ms of it the layout copies the row-by-row gathers now leave out; beside
   it, eager and compiled, the same plan with its sibling products (q, k, v; gate, up) as written
   (``fuse_products=False``; the default joins them).
2. ``host:gpt2-xl`` (issue 44, points 3 and 4; 40 s): where the host's time goes in one training
   step of a gpt2-xl rank (12 layers, 8 x 1024) and of serial (``benchmarks/host_profile.py``): the
   step's wall clock, the calling thread's CPU time and every thread's (the autograd engine runs a
   CUDA backward on a thread of its own), again with the backward on the calling thread and with
   attention kept off cuDNN, and one step under the profiler: the ops by self CPU time, the CUDA
   runtime calls, the CPU time per thread and the longest gaps between kernels with what the host
   did meanwhile. The 2026-11-30 round measured that rank at 67.8 ms wall with about 13 ms of
   kernels. Alone: ``--only host:gpt2``.
3. ``predict:llama-3-8b`` (issue 44, point 1; 30 s): the model captured on the device and on the
   meta device, priced op by op (``benchmarks/predicted_ops.py``): the device's capture priced the
   rank at 0.79 of its eighth where the meta one is priced 0.94.
4. ``rank:mixtral-8x7b``, ``rank:qwen3-30b-a3b`` (issue 47, point 2; 180 s each: 64 s on 2026-11-30, and the probe writes eight ranks' programs for each expert-parallel version): as part 1, 2
   layers, 2 x 4096, eager: the solver's plan, expert-parallel, expert-TP and expert-parallel with
   the all-to-all dispatch, each predicted and measured, each experts layout on the rank whose
   rows are nearest a balanced share (probed) and on the most loaded one (the 2026-11-30 round
   timed rank 0, which a random router gave 3.12x and 2.05x its share of the rows); and the solver's
   plan made at the batch's measured routing load (``expert_load``), held to each version's busiest
   rank, the step this router waits for.
5. ``nccl:collectives`` (15 s: the c10d methods autotp's eager collectives call, the coalesced
   rows of a sequence split, all-to-alls with an empty send, under NCCL in a world of one),
   ``rank:gpt2-xl`` (issue 44, point 3; 35 s: gpt2-xl 12 layers, 8 x 1024, eager), ``host:cuda``
   (50 s: ``benchmarks/rank_host.py``'s host work per step, the models on the GPU; its clock holds
   the backward since 2026-11-30, the forward alone before).
6. Measured on 2026-11-30, again where the budget has room: ``moe:compile`` (issue 47, point 3;
   70 s: ``torch.compile(pm)`` at tp 1 against HF's module compiled, graphs and breaks counted;
   0.94x HF compiled then, no break), ``norm:rms`` (15 s: ``aten.rms_norm`` on CUDA against the
   statistic as HF writes it).
7. ``rank:gpt2-xl+compile`` (issue 44, point 3; 135 s: inductor compiles 12 layers twice): the
   gpt2-xl rank again with both compiled, where the budget has room.

Parts 1 to 4's Mixtral are estimated at 380 s, all at 880 s: with ``--budget 480`` they run, the rest
in a second call (``--only rank:qwen3-30b-a3b nccl rank:gpt2-xl host:cuda --budget 240``).
run. A part starts only while its estimate fits
before a minute past ``--budget`` (default 480 s; the device tool's limit is 600 s a command),
and a part still running then is stopped.

``--quick`` shrinks every part to tiny widths (the published models' families, hidden 64) and a
step or two, and on CPU gloo stands in for NCCL and ``aot_eager`` for inductor, so every code
path of the round runs on a CPU.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


@dataclass(frozen=True)
class Part:
    """One part of a round: what it answers, its estimate on an H200 and its cap (seconds)."""

    name: str
    point: str
    estimate_s: int
    cap_s: int
    child: str
    options: dict = field(default_factory=dict, hash=False)


#: most important first; estimates on an H200 from the 2026-11-28 figures (a Llama-3-8B 4-layer
#: serial step 139 ms, a rank 36 ms; Mixtral and Qwen3 serial 100 and 73 ms; inductor's first
#: call 22-30 s for a 4-layer model there) and this script's CPU rehearsal (planning a
#: real-size model: 2-11 s), child start-up (about 10 s) included
ROUND = [
    # the rank after the sequence's gathers and reduce-scatters went row by row (no layout copy)
    Part("rank:llama-3-8b", "44.3", 130, 220, "rank", dict(model="llama-3-8b", layers=4, batch=2, seq=4096,
                                                             compile=True, products_apart=True)),
    # the rank's step measured 67.8 ms wall with about 13 ms of kernels: where the host's time goes
    Part("host:gpt2-xl", "44.4", 40, 90, "host_profile", dict(model="gpt2-xl", layers=12, batch=8, seq=1024)),
    # the device's capture of Llama priced 0.79 of the eighth where the meta one here is 0.94: which ops
    Part("predict:llama-3-8b", "44.1", 30, 90, "predicted_ops", dict(model="llama-3-8b", layers=4, batch=2,
                                                                     seq=4096)),
    # each experts layout on the rank whose rows are nearest a balanced share (probed: a fake world's
    # routing is not serial's), and on the most loaded one; the default plan at a balanced router and at
    # the batch's measured routing load (expert_load: the busiest rank priced)
    Part("rank:mixtral-8x7b", "47.2", 180, 300, "rank", dict(model="mixtral-8x7b", layers=2, batch=2, seq=4096,
                                                               rank_by="probe", busiest_rank="on", plan_load="both")),
    Part("rank:qwen3-30b-a3b", "47.2", 180, 300, "rank", dict(model="qwen3-30b-a3b", layers=2, batch=2, seq=4096,
                                                                rank_by="probe", busiest_rank="on", plan_load="both")),
    Part("nccl:collectives", "noticed", 15, 60, "collectives"),
    Part("rank:gpt2-xl", "44.3", 35, 90, "rank", dict(model="gpt2-xl", layers=12, batch=8, seq=1024)),
    Part("host:cuda", "noticed", 50, 90, "rank_host"),
    # measured 2026-11-30 (benchmarks/measurements/h200-2026-11-30/): again where the budget has room
    Part("moe:compile", "47.3", 70, 150, "moe_compile"),
    Part("norm:rms", "noticed", 15, 60, "rms_norm"),
    # last: inductor compiles 12 layers twice (serial and the rank); run where the budget has room
    Part("rank:gpt2-xl+compile", "44.3", 135, 200, "rank", dict(model="gpt2-xl", layers=12, batch=8, seq=1024,
                                                                  compile=True)),
]
ROUNDS = {"issues-44-47": ROUND}


# ------------------------------------------------------------------------------------ the driver

def run_round(name: str, out: str, device: str, quick: bool, budget: float, only: list[str] | None = None) -> dict:
    """Every part of round ``name`` in turn, each in its own child process; returns (and keeps
    in ``out/round.json``) what each part gave."""
    import platform

    import torch

    from common import machine

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    parts = parts_folder(folder)
    started = time.perf_counter()
    results = {"round": name, "device": device, "quick": quick, "budget_s": budget, "machine": machine(),
               "python": platform.python_version(), "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name(0) if device != "cpu" else None,
               "command": "python3 benchmarks/gpu.py " + " ".join(sys.argv[1:]), "parts": {}}
    for part in ROUNDS[name]:
        if only and not any(part.name.startswith(o) for o in only):
            continue
        elapsed = time.perf_counter() - started
        row = {"point": part.point, "estimate_s": part.estimate_s}
        if elapsed > budget:
            row["skipped"] = f"not run: the budget of {budget:.0f} s was spent ({elapsed:.0f} s)"
        elif not quick and elapsed + part.estimate_s > budget + 60:
            row["skipped"] = (f"not run: its estimate of {part.estimate_s} s does not fit in the "
                              f"{budget + 60 - elapsed:.0f} s left before the budget's end (plus a minute)")
        else:
            # a part may run past the budget, but not past a minute after it (the device call's
            # own limit is ten minutes)
            row.update(_run_child(part, parts, device, quick, min(part.cap_s, budget + 60 - elapsed)))
        results["parts"][part.name] = row
        results["total_s"] = time.perf_counter() - started
        (folder / "round.json").write_text(json.dumps(results, indent=1, default=str))
        bundle(parts, folder / BUNDLE)
        print(f"[{results['total_s']:6.1f} s] {part.name}: "
              + ("skipped" if "skipped" in row else "failed: " + row["failed"] if "failed" in row
                 else f"done in {row['s']:.0f} s"), flush=True)
    from gpu_summary import summary

    (folder / "summary.md").write_text("\n".join(summary(results)) + "\n")
    bundle(parts, folder / BUNDLE)
    return results


#: the parts' own files (each part's ``.md`` and ``.log``), packed into one file of ``--out``: a
#: device run hands back at most eight files, and a round writes two a part
BUNDLE = "parts.tgz"


def parts_folder(folder: Path) -> Path:
    """Where the parts write their files: beside ``folder`` (``<out>-parts``), so that ``folder``
    holds three files alone (``round.json``, ``summary.md``, :data:`BUNDLE`); a temporary folder
    where the one beside cannot be made."""
    import tempfile

    beside = folder.parent / f"{folder.name}-parts"
    try:
        beside.mkdir(parents=True, exist_ok=True)
        return beside
    except OSError:
        return Path(tempfile.mkdtemp(prefix="round-parts-"))


def bundle(parts: Path, tgz: Path) -> None:
    """Every file in ``parts`` packed into ``tgz`` (rewritten after each part: a killed round's
    bundle holds the parts it finished). Unpack with ``tar xzf parts.tgz``."""
    import tarfile

    partial = tgz.with_name(tgz.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        for f in sorted(parts.iterdir()):
            if f.is_file():
                tar.add(f, arcname=f.name)
    partial.replace(tgz)


def file_stem(name: str) -> str:
    """A part's files' name: letters, digits, ``.``, ``_`` and ``-`` alone (what comes back from a
    device run as it is)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _run_child(part: Part, folder: Path, device: str, quick: bool, timeout: float) -> dict:
    """The part in a child process of its own session (so that a timeout ends inductor's compile
    workers with it); its figures, or why there are none."""
    stem = file_stem(part.name)
    figures, log = folder / f"{stem}.json", folder / f"{stem}.log"
    cmd = [sys.executable, str(Path(__file__).with_name("gpu_parts.py")), "--child", part.child, "--device", device,
           "--options", json.dumps(part.options), "--figures", str(figures), "--md", str(folder / f"{stem}.md")]
    cmd += ["--quick"] if quick else []
    start = time.perf_counter()
    with open(log, "w") as f:
        child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            rc = child.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            rc = None
    row = {"s": time.perf_counter() - start, "log": log.name}
    tail = log.read_text(errors="replace")[-2500:]
    if rc is None:
        row["failed"] = f"ran over its cap of {timeout:.0f} s and was stopped"
    elif rc != 0 or not figures.exists():
        last = [line for line in tail.splitlines() if line.strip()][-1:] or ["(no output)"]
        row["failed"] = f"exit code {rc}: {last[0][:300]}"
    if "failed" in row:
        row["tail"] = tail
    if figures.exists():
        row["figures"] = json.loads(figures.read_text())
        figures.unlink()
    return row
