"""The cost model's forward + backward seconds per ATen op, of one capture against another.

On the H200 (2026-11-30, torch 2.11) the round's rank benchmark predicted Llama-3-8B's tp-8 rank
at 22.9 ms against serial/8 at 18.1 (0.79), where the same model captured on the meta device
here (torch 2.13) is predicted at 18.7 against 17.6 (0.94): the two captures are priced apart by
4 ms, and which ops differ says why (a device-specific attention op, a decomposition that torch
version makes, a copy the capture keeps). ``part`` prices the model as the device captures it
beside the same model on the meta device, op by op, rank 0 of tp 8 and serial/8, in one table.

    python benchmarks/predicted_ops.py --model llama-3-8b:4 --batch 2 --seq 4096   # meta alone, here
"""
from __future__ import annotations

import argparse
from collections import Counter

import torch

#: ops listed: the largest differences between the two captures (rank or serial/N)
TOP = 25


def by_op(model, tp: int, batch: int, seq: int, profile: str) -> tuple[Counter, Counter]:
    """Seconds per op name (forward + backward: products, attention, bytes, launches), rank 0 of
    tp as planned by cost, and serial (as it runs: activations and norms written out) / tp."""
    from autotp.capture import capture
    from autotp.cost_model import get_profile
    from autotp.planner import build_plan
    from rank_gap import per_node

    prof = get_profile(profile)
    cap = capture(model)
    out = []
    for n, extra in ((tp, {}), (1, dict(fuse_activations=False, fuse_norms=False, fuse_products=False))):
        _, index, prop = build_plan(cap, n, batch=batch, seq=seq, profile=prof, **extra)
        seconds: Counter = Counter()
        for name, _weight, parts, _launches in per_node(index, prop, prof, 0).values():
            seconds[name] += sum(float(v) for v in parts.values()) / (tp if n == 1 else 1)
        out.append(seconds)
    return out[0], out[1]


def table(captures: dict[str, tuple[Counter, Counter]]) -> list[str]:
    """Per op, ms: each capture's rank and serial/N, the ops whose prices differ most first."""
    labels = list(captures)
    ops = set().union(*(set(r) | set(s) for r, s in captures.values()))

    def spread(op):
        values = [side[op] for r, s in captures.values() for side in (r, s)]
        return max(values) - min(values)

    head = " | ".join(f"{label}: rank | {label}: serial/N" for label in labels)
    lines = [f"| op | {head} |", "|---|" + "---|" * (2 * len(labels))]
    totals = " | ".join(f"**{sum(r.values()) * 1e3:.2f}** | **{sum(s.values()) * 1e3:.2f}**"
                        for r, s in captures.values())
    lines.append(f"| all | {totals} |")
    for op in sorted(ops, key=spread, reverse=True)[:TOP]:
        cells = " | ".join(f"{r[op] * 1e3:.3f} | {s[op] * 1e3:.3f}" for r, s in captures.values())
        lines.append(f"| `{op}` | {cells} |")
    return lines


def part(device: str, quick: bool, md: str, model: str, layers: int, batch: int, seq: int) -> dict:
    """The device round's part ``predict:<model>``: the model built on ``device`` (bf16 there,
    float32 on a CPU) and on the meta device (bf16), each captured and priced on ``h200``."""
    import rank_efficiency
    from autotp import zoo
    from common import machine, publish
    from gpu_parts import _tiny_model_for

    if quick:
        rank_efficiency.model_for = _tiny_model_for
        layers, batch, seq = min(layers, 2), 1, 16
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    _, on_device = rank_efficiency.model_for(model, layers, dtype, device)
    family = zoo.family_of(model)
    meta = zoo.build(family.name, on_device.config, device="meta", dtype=torch.bfloat16)
    captures = {device: by_op(on_device, 8, batch, seq, "h200"), "meta": by_op(meta, 8, batch, seq, "h200")}
    lines = [f"# Predicted per op: {model} ({layers} layers, {batch} x {seq}), captured on {device} and on meta, "
             "tp 8 rank 0 and serial/8, h200, ms (benchmarks/predicted_ops.py)", "",
             machine() + (f" GPU: {torch.cuda.get_device_name()}." if device != "cpu" else ""), ""]
    publish(lines + table(captures), md)
    return {label: {"rank": dict(r), "serial_share": dict(s)} for label, (r, s) in captures.items()}


def main() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from autotp import zoo
    from common import machine, publish

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3-8b:4")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    name, layers = args.model.split(":")
    model = zoo.build(zoo.family_of(name).name, zoo.published_config(name, layers=int(layers)), device="meta",
                      dtype=torch.bfloat16)
    lines = [f"# Predicted per op: {args.model}, {args.batch} x {args.seq}, meta, h200", "", machine(), ""]
    publish(lines + table({"meta": by_op(model, 8, args.batch, args.seq, "h200")}), args.out)


if __name__ == "__main__":
    main()
