"""What the checks before a save cost: autotp.runtime.dcp.save with and without them.

    .venv/bin/python benchmarks/checkpoint_checks.py      # writes benchmarks/checkpoint_checks.md

Before it writes anything, a save now checks on every rank that it replaces no other model's or
training run's checkpoint (the manifest's run, DCP's .metadata when they differ), that the
optimizer is over the module's parameters, and that the TP ranks' replicated parameters and
buffers are equal (``pm.check_replicas()``: a digest of each replicated tensor, one agreement,
then one exchange over the world). Two local gloo ranks (tp 2) save a GPT-2 (float32) and its
AdamW state to the same folder, in Megatron's layout and with everything replicated (the worst case
for the replica check), alternately with the checks and with the three replaced by
no-ops (everything else the same: staging, DCP's write, manifest, publish); each check is also
timed alone. ``from_pretrained``'s new agreement on the opening of the folder is one exchange,
timed as ``agree_on``.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import machine, publish

TP = 2
REPEATS = 7
CONFIG = dict(n_layer=4, n_head=8, n_embd=512, vocab_size=8192, n_positions=128)
#: Megatron's layout (little replicated: norms, biases, positions) and everything replicated (the
#: worst case for check_replicas, which digests every replicated tensor)
LAYOUTS = {"megatron": {"*.c_attn.weight": "column", "*.mlp.c_fc.weight": "column", "*.attn.c_proj.weight": "row",
                        "*.mlp.c_proj.weight": "row", "lm_head.weight": "vocab"},
           "all replicated": {"*": "replicate"}}


def on_rank(root: str, layout: str) -> dict:
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    import autotp
    from autotp.runtime.checkpoint import dcp, dcp_safety

    torch.manual_seed(0)
    pm = autotp.parallelize(GPT2LMHeadModel(GPT2Config(**CONFIG)), tp=TP, layout=LAYOUTS[layout])
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    pm(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    path = f"{root}/{layout.replace(' ', '-')}"
    dcp.save(pm, path, opt)     # the folder the timed saves replace (this module's own run)

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    checks = (dcp._check_replicas, dcp._optimizer_problem, dcp_safety.replace_problem)

    def without_checks() -> None:
        dcp._check_replicas = lambda pm, path: None
        dcp._optimizer_problem = lambda pm, optimizer: None
        dcp_safety.replace_problem = lambda *args, **kwargs: None
        try:
            dcp.save(pm, path, opt)
        finally:
            dcp._check_replicas, dcp._optimizer_problem, dcp_safety.replace_problem = checks

    saves = {"with": [], "without": []}
    for _ in range(REPEATS):
        saves["with"].append(timed(lambda: dcp.save(pm, path, opt)))
        saves["without"].append(timed(without_checks))
    run = getattr(pm, dcp._RUN)
    shapes = dcp._shapes(pm)
    alone = {
        "pm.check_replicas()": [timed(pm.check_replicas) for _ in range(REPEATS)],
        "replace_problem (own run: the manifest read)": [
            timed(lambda: dcp_safety.replace_problem(path, run, shapes)) for _ in range(REPEATS)],
        "replace_problem (another run: .metadata read too)": [
            timed(lambda: dcp_safety.replace_problem(path, "another", shapes)) for _ in range(REPEATS)],
        "_optimizer_problem": [timed(lambda: dcp._optimizer_problem(pm, opt)) for _ in range(REPEATS)],
        "one exchange (agree_on: from_pretrained's opening)": [
            timed(lambda: dcp_safety.agree_on("a benchmark")) for _ in range(REPEATS)],
    }
    replicated = sum(p.to_local().numel() for n, p in pm.named_parameters()
                     if "Replicate" in repr(p.placements[-1]))
    held = sum(p.to_local().numel() for p in pm.parameters())
    files = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    return {"saves": saves, "alone": alone, "replicated": replicated, "held": held, "bytes": files}


def main() -> int:
    from autotp.testing import launch

    with tempfile.TemporaryDirectory(prefix="autotp-checks-") as root:
        results = {layout: launch(on_rank, TP, root, layout, timeout=1800.0)[0] for layout in LAYOUTS}
    load = os.getloadavg()[0]

    def ms(xs: list[float]) -> str:
        return f"{1e3 * statistics.median(xs):.1f} (min {1e3 * min(xs):.1f})"

    lines = [
        "# The checks before a save: autotp.runtime.dcp.save with and without them",
        "",
        "Command: `.venv/bin/python benchmarks/checkpoint_checks.py` (writes this file).",
        f"{machine()} {TP} local gloo ranks (tp {TP}) on the CPU; load average {load:.1f} when it ended "
        "(the machine is shared with other jobs: the saves' times vary by more than the checks cost, so the "
        "checks are also timed alone).",
        "",
        f"GPT-2 {CONFIG['n_layer']} layers x {CONFIG['n_embd']}, vocab {CONFIG['vocab_size']}, float32, with AdamW "
        f"state, in two layouts. Each save replaces the previous one in the same folder (this module's own run); "
        f"median of {REPEATS} (and the fastest), milliseconds, rank 0, barriers around each.",
    ]
    for layout, r in results.items():
        with_, without = statistics.median(r["saves"]["with"]), statistics.median(r["saves"]["without"])
        lines += [
            "",
            f"## {layout}: {r['held'] / 1e6:.1f}M parameters held per rank, {r['replicated'] / 1e6:.2f}M of them "
            f"replicated (what check_replicas digests); checkpoint {r['bytes'] / 1e6:.0f} MB",
            "",
            "| save | ms |",
            "|---|---|",
            f"| with the checks | {ms(r['saves']['with'])} |",
            f"| without (the three replaced by no-ops) | {ms(r['saves']['without'])} |",
            f"| difference of the medians | {1e3 * (with_ - without):.1f} "
            f"({100 * (with_ - without) / without:+.1f} %) |",
            "",
            "| a check alone | ms |",
            "|---|---|",
            *[f"| {name} | {ms(xs)} |" for name, xs in r["alone"].items()],
        ]
    publish(lines, Path(__file__).with_suffix(".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
