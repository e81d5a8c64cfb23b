"""One rank of tp=N against serial/N for two MoE shapes: expert-parallel and expert-TP, the plan's
predicted compute beside the measured step, and the work counted (FLOPs of products, bytes
written by the rest) against serial/N.

    python benchmarks/moe_rank.py --out benchmarks/moe_rank.md

The rank runs on torch's ``fake`` process-group backend (rank 0 of tp=N in this one process: its
collectives return at once and move nothing), so its step is its own compute at the model's
size. The shapes are Mixtral-8x7B's and Qwen3-30B-A3B's expert counts, top-k and
heads-to-width ratios with the widths cut to fit a shared 2-core CPU (see SHAPES), 2 layers.
Predicted: the plan's compute (``plan.cost["compute_s"]``, forward + backward + the optimizer
step on the largest rank) under the cpu-gloo profile, which is not calibrated on this machine:
the ratios between rows are what to read, not the absolute times.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import machine, publish, timed_step

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: (family, tiny_config arguments): the published models' experts, top-k and heads, narrower
SHAPES = {
    # 4096 wide, 32 heads of 128 (8 kv), 8 experts of 14336, top-2: widths / 8, heads / 4
    "Mixtral-8x7B / 8": ("mixtral", dict(heads=8, kv_heads=2, head_dim=64, experts=8, top_k=2,
                                         intermediate_size=1792, vocab=4096)),
    # 2048 wide, 32 heads of 128 (4 kv), 128 experts of 768, top-8: widths / 4, heads / 4
    "Qwen3-30B-A3B / 4": ("qwen3-moe", dict(heads=8, kv_heads=1, head_dim=64, experts=128, top_k=8,
                                            moe_intermediate_size=192, vocab=4096)),
}
LAYERS, BATCH, SEQ, WARMUP, STEPS = 2, 2, 128, 1, 7
IMPL = "grouped_mm"
LAYOUTS = {
    "expert-parallel": {"*.experts.*": "expert"},
    "expert-TP": {"*.experts.gate_up_proj": "expert_column", "*.experts.down_proj": "expert_row"},
}


def _model(family: str, extra: dict, device: str = "cpu"):
    from autotp import zoo

    config = zoo.tiny_config(family, layers=LAYERS, positions=SEQ, **extra)
    config._experts_implementation = IMPL
    return zoo.build(family, config, seed=0, device=device), config


def _counted(model, batch) -> tuple[int, int]:
    from autotp.testing.work import WorkCounter

    with WorkCounter() as work:
        model(**batch).loss.backward()
    model.zero_grad()
    return work.flops, work.bytes


def measure(family: str, extra: dict, tp: int) -> dict:
    import autotp
    from autotp import zoo
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    model, config = _model(family, extra)
    batch = zoo.example_batch(family, config, batch=BATCH, seq=SEQ, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    serial = {"times": [], "work": _counted(model, batch),
              "predicted": autotp.plan(_model(family, extra, "meta")[0], 1, batch=BATCH, seq=SEQ,
                                       profile="cpu-gloo").cost["compute_s"]}
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    runs = {}
    for name, layout in LAYOUTS.items():
        pm = autotp.parallelize(_model(family, extra)[0], tp, layout=layout, batch=BATCH, seq=SEQ, profile="cpu-gloo")
        runs[name] = {"pm": pm, "opt": torch.optim.AdamW(pm.parameters(), lr=1e-4), "times": [],
                      "work": _counted(pm, batch), "predicted": pm.plan.cost["compute_s"]}
    chosen = autotp.plan(_model(family, extra, "meta")[0], tp, batch=BATCH, seq=SEQ, profile="cpu-gloo")
    for step in range(WARMUP + STEPS):   # alternating, so that load on the machine hits all alike
        elapsed = timed_step(model, opt, batch)
        if step >= WARMUP:
            serial["times"].append(elapsed)
        for run in runs.values():
            elapsed = timed_step(run["pm"], run["opt"], batch)
            if step >= WARMUP:
                run["times"].append(elapsed)
    dist.destroy_process_group()
    out = {"serial": {k: v for k, v in serial.items()}}
    for name, run in runs.items():
        out[name] = {k: run[k] for k in ("times", "work", "predicted")}
    out["notes"] = [n for n in chosen.notes if n.startswith("experts ")]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--tp", type=int, default=8)
    args = parser.parse_args()
    started = time.time()
    tp = args.tp
    lines = [
        f"# One rank of tp={tp} against serial/{tp}: MoE experts, predicted and measured",
        "",
        "Command: `python benchmarks/moe_rank.py --out benchmarks/moe_rank.md`",
        "",
        machine() + " Load average at the end: {:.1f}, {:.1f}, {:.1f}.",
        "",
        f"{LAYERS} layers, batch {BATCH} x seq {SEQ}, float32, experts implementation `{IMPL}`; one thread. A step is "
        f"forward, backward and AdamW; {WARMUP} warm-up step, {STEPS} timed, serial and the layouts "
        f"alternating. The rank is rank 0 of tp={tp} on the `fake` backend (its collectives move nothing: its own "
        "compute). Efficiency: (serial step / tp) / rank step, 1.0 being a rank doing exactly its share. Work: one "
        "counted forward + backward (`autotp/testing/work.py`), the rank's over serial's / tp.",
        "",
        "| shape | plan | predicted compute ms | measured step ms (median) | best ms | efficiency predicted | "
        "efficiency measured (median) | (best) | FLOPs / (serial/tp) | bytes written / (serial/tp) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for label, (family, extra) in SHAPES.items():
        result = measure(family, extra, tp)
        serial = result["serial"]
        s_med, s_best, s_pred = statistics.median(serial["times"]), min(serial["times"]), serial["predicted"]
        s_flops, s_bytes = serial["work"]
        lines.append(f"| {label} | serial / {tp} | {s_pred / tp * 1e3:.1f} | {s_med / tp * 1e3:.1f} | "
                     f"{s_best / tp * 1e3:.1f} | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 |")
        for name in LAYOUTS:
            run = result[name]
            med, best = statistics.median(run["times"]), min(run["times"])
            flops, written = run["work"]
            lines.append(f"| {label} | {name} | {run['predicted'] * 1e3:.1f} | {med * 1e3:.1f} | {best * 1e3:.1f} | "
                         f"{s_pred / tp / run['predicted']:.2f} | {s_med / tp / med:.2f} | {s_best / tp / best:.2f} | "
                         f"{flops / (s_flops / tp):.2f} | {written / (s_bytes / tp):.2f} |")
        notes += [f"- {label}: {n}" for n in result["notes"]]
    lines[4] = lines[4].format(*os.getloadavg()) + f" Wall time {time.time() - started:.0f} s."
    lines += ["", "## The solver's own choice (nothing pinned)", ""] + notes
    publish(lines, args.out)


if __name__ == "__main__":
    main()
