"""Where a rank's predicted step exceeds its share: the cost model's gap, op by op.

``benchmarks/rank_efficiency.py`` predicts serial/N ÷ rank at the H200 workloads (the busiest rank
of tp=N against the serial step / N, forward + backward, compute only). This script splits the
busiest rank's excess over that share into parts that each name a cause, exactly (every figure is
the cost model's own, ``autotp.cost_model.symbolic``; no device is run):

* **launches**: every kernel costs ``launch_s``; a rank runs as many kernels as serial does,
  each 1/N as large, so serial/N pays 1/N of them and the rank all of them;
* **products' rate**: each product at the rank's mean share (over the ranks) against serial's
  whole product / N: a product 1/N the size runs below the rate of the whole one
  (``DeviceProfile.product_rate``: ``product_half_work`` multiply-adds more a product and
  ``product_half_k`` more an output element);
* **bytes above the share**: memory-bound bytes a rank moves beyond serial's / N (an op a split
  leaves whole on every rank: the masked vocabulary-parallel lookup's partial output and gradient;
  the copies that lay out an op's own collectives, a table read by columns);
* **unevenness**: the busiest rank's ops against the mean over the ranks (heads tp does not deal
  evenly; the rotation of the larger part from layer to layer is already in it);
* **activations, norms and products fused**: the work serial does / N beyond that of serial fused
  as the rank is (``autotp/passes/activations.py``: GPT-2's tanh-GELU as one ``gelu``;
  ``autotp/passes/norms.py``: Llama's RMSNorm statistic as one ``rms_norm``;
  ``autotp/passes/products.py``: Llama's q, k, v and gate, up products each run as one product of
  their weights joined): the chains' own bytes, x's gradient summed from each of their reads, the
  written products against the joined one (and the join's and split's copies); their kernels are
  in the launches. The other causes compare the rank with that fused serial, op for op.

Serial is the model as it runs (``fuse_activations=False, fuse_norms=False, fuse_products=False``:
HF's GPT-2 runs its GELU as eight pointwise ops, Llama its RMSNorm statistic as five and its q, k, v
as three products); the rank as autotp runs it (fused; ``--no-fuse-products``: its products as
written, the figures before they were fused). The ratio against a serial fused the same way is given beside it: how much of the gain is
the rank running fewer kernels than serial.

and prices the candidates that would rebalance the heads (what the most even dealing could save)
and an even column split of the fused q/k/v product moved into the head layout by an all-to-all.

    python benchmarks/rank_gap.py --models gpt2-xl:12:8:1024 llama-3-8b:4:2:4096 --out benchmarks/gpt2xl_rank.md

``--out`` rewrites the file's run and keeps what is written by hand in it: every line from the
first that is ``common.KEPT`` on (its reading, its re-run notes) stays as it is, after the new run
(``benchmarks/common.publish``, as every script's ``--out``).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import kept_lines, publish  # noqa: E402


def per_node(index, prop, profile, rank):
    """node -> (op name, weight shape or None, {products, attention, bytes, launches} seconds, launches)."""
    from autotp.capture.program import op_name
    from autotp.cost_model.symbolic import PRODUCTS, evaluate, nbytes, numel, op_work, split_seconds

    from autotp.passes.propagate import internal_copy_seconds

    out = {}
    for node, strat in prop.chosen.items():
        info = index.infos[node]
        parts = split_seconds(info, strat, index.env, profile, index.tp, index.align, rank)
        work = op_work(info, strat, profile, index.tp, rank)
        moved = sum(evaluate(b, index.env) / profile.bandwidth(c) for c, b in work.moved)
        # the copies that lay out an op's own collectives' tensors (the rows an expert product
        # gathers, a table read by columns), as the planner prices them
        moved += sum(internal_copy_seconds(kind, nbytes(meta, index.env, profile.dtype_bytes, index.train_dtype),
                                           profile, numel(meta.shape[:1], index.env), index.tp)
                     for kind, meta in strat.internal)
        weight = tuple(info.inputs[1].shape) if info.target in PRODUCTS and len(info.inputs) > 1 else None
        out[node] = (op_name(info.target), weight, {"products": parts["products"], "attention": parts["attention"],
                                                   "bytes": moved, "launches": work.launches * profile.launch_s},
                     work.launches)
    return out


def gap(name: str, layers: int, batch: int, seq: int, tp: int, profile_name: str,
        fuse_products: bool = True) -> list[str]:
    from autotp import zoo
    from autotp.capture import capture
    from autotp.cost_model import get_profile
    from autotp.cost_model.symbolic import collective_time, nbytes, split_seconds
    from autotp.passes.rules.contract import Strategy
    from autotp.placements import Shard
    from autotp.planner import build_plan

    prof = get_profile(profile_name)
    model = zoo.build(zoo.family_of(name).name, zoo.published_config(name, layers=layers), device="meta",
                      dtype=torch.bfloat16)
    cap = capture(model)
    _, i1, p1 = build_plan(cap, 1, batch=batch, seq=seq, profile=prof, fuse_activations=False, fuse_norms=False,
                           fuse_products=False)
    _, i8, p8 = build_plan(cap, tp, batch=batch, seq=seq, profile=prof, memory_limit=float("inf"),
                           fuse_products=fuse_products)
    # serial fused as the rank is: the rank's own capture (its activations, norms and the sibling
    # products it joins fused already; at tp 1 the planner would keep the products apart, the
    # join's copy of the whole weights costing more than it saves there)
    _, i1f, p1f = build_plan(i8.capture, 1, batch=batch, seq=seq, profile=prof, fuse_products=False)
    as_run = per_node(i1, p1, prof, None)      # serial as the model runs it: its activations written out
    serial = per_node(i1f, p1f, prof, None)    # fused as the rank's: the same ops, node for node
    ranks = [per_node(i8, p8, prof, r) for r in range(tp)]
    work = lambda d: sum(v[2]["products"] + v[2]["attention"] + v[2]["bytes"] for v in d.values())  # noqa: E731
    total = lambda d: work(d) + sum(v[2]["launches"] for v in d.values())  # noqa: E731
    busy = max(range(tp), key=lambda r: total(ranks[r]))
    share, rank_s = total(as_run) / tp, total(ranks[busy])
    fused_share = total(serial) / tp

    def serial_of(node):
        return serial.get(next((m for m in serial if m.name == node.name), None))

    # rows: (cause, what, ms)
    rows = []
    launches_rank = sum(v[3] for v in ranks[busy].values())
    launches_serial = sum(v[3] for v in as_run.values())
    rows.append(("launches", f"{launches_rank} kernels on the rank, {launches_serial} in serial "
                 f"(x {prof.launch_s * 1e6:.0f} µs; serial/N pays 1/{tp} of them)",
                 (launches_rank - launches_serial / tp) * prof.launch_s))
    groups = defaultdict(lambda: [0.0, 0.0, 0.0, 0])   # (kind, label) -> [serial/N, mean rank, busiest, count]
    # what serial moves in its written-out activations (and in what feeds them: x's gradient summed
    # from each of the chain's reads) beyond the fused ops the rank runs; their kernels are in the launches
    written = {node.name for node in as_run} - {node.name for node in serial}
    fused_ops = {node.name for node in serial} - {node.name for node in as_run}
    if written:
        rows.append(("activations, norms and products fused", f"serial's {len(written)} written-out activation, "
                     f"norm and product ops run as {len(fused_ops)} "
                     "fused ones: its work / N less (their kernels: in the launches)",
                     -(work(as_run) - work(serial)) / tp))
    for node in ranks[busy]:
        s = serial_of(node)
        op, weight, parts, _ = ranks[busy][node]
        for kind in ("products", "attention", "bytes"):
            mean = sum(ranks[r][node][2][kind] for r in range(tp)) / tp
            if not (mean or parts[kind]):
                continue
            label = f"`{op}` {'x'.join(map(str, weight))}" if kind == "products" and weight else f"`{op}`"
            g = groups[(kind, label)]
            g[0] += (s[2][kind] if s else 0.0) / tp
            g[1] += mean
            g[2] += parts[kind]
            g[3] += 1
    for (kind, label), (sv, mean, busiest, count) in groups.items():
        cause = {"products": "products' rate", "attention": "attention", "bytes": "bytes above the share"}[kind]
        if abs(mean - sv) > 5e-7:
            rows.append((cause, f"{label} ({count} ops)", mean - sv))
        if abs(busiest - mean) > 5e-7:
            rows.append(("unevenness", f"{label} ({count} ops; {kind})", busiest - mean))
    rows.sort(key=lambda r: -r[2])
    by_cause = defaultdict(float)
    for cause, _, ms in rows:
        by_cause[cause] += ms
    excess = rank_s - share
    lines = [f"## {name} ({layers} layers, {batch} x {seq}), tp={tp}, profile {profile_name}", "",
             f"serial/N {share * 1e3:.3f} ms, busiest rank (rank {busy}) {rank_s * 1e3:.3f} ms: "
             f"**{share / rank_s:.3f}** of the eighth; the excess {excess * 1e3:.3f} ms. "
             f"Against a serial fused the same way (serial/N {fused_share * 1e3:.3f} ms): "
             f"{fused_share / rank_s:.3f}. " +
             (f"0.85 would need the rank at {share / 0.85 * 1e3:.3f} ms ({(rank_s - share / 0.85) * 1e3:.3f} ms less)."
              if share / rank_s < 0.85 else ""),
             "", "| cause | ms | share of the excess |", "|---|---|---|"]
    for cause, ms in sorted(by_cause.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {cause} | {ms * 1e3:+.3f} | {ms / excess:.0%} |")
    lines += [f"| **all** | **{sum(by_cause.values()) * 1e3:+.3f}** | |", "",
              "Op by op (each line at least 0.5 µs; products grouped by their weight's shape):", "",
              "| cause | what | ms |", "|---|---|---|"]
    lines += [f"| {c} | {w} | {ms * 1e3:+.3f} |" for c, w, ms in rows if abs(ms) >= 5e-7]
    lines.append("")

    # Candidates. The most any dealing of the heads could save on the busiest rank: its unevenness.
    uneven = by_cause.get("unevenness", 0.0)
    lines += ["Candidates, priced before building:", "",
              f"- **Heads dealt to balance the busiest rank** (uneven heads against an MLP split unevenly the "
              f"other way, or any other dealing): at most the unevenness, {uneven * 1e3:.3f} ms: "
              f"{share / rank_s:.3f} -> at most {share / (rank_s - uneven):.3f}."]
    # An even column split of a fused product whose split is by heads (a hint's chunks/unit): 1/N of
    # its columns plain, its output moved into the head layout by one all-to-all each way.
    saved, moved, count = 0.0, 0.0, 0
    for node, (op, weight, parts, _) in ranks[busy].items():
        strat = p8.chosen[node]
        w = strat.inputs[1] if len(strat.inputs) > 1 else None
        info = i8.infos[node]
        column = isinstance(strat.output, Shard) and strat.output.dim == info.output.ndim - 1
        if parts["products"] == 0 or not column or not isinstance(w, Shard) or w.unit == 1:
            continue
        even = Strategy((strat.inputs[0], Shard(w.dim)), Shard(info.output.ndim - 1))
        even_s = split_seconds(info, even, i8.env, prof, tp, i8.align, busy)["products"]
        saved += parts["products"] - even_s
        moved += sum(collective_time("all_to_all", nbytes(info.output, i8.env, prof.dtype_bytes), prof, tp))
        count += 1
    if count:
        lines.append(f"- **An even column split of the {count} products split by heads**, moved into the head "
                     f"layout by one all-to-all each way: saves the busiest rank {saved * 1e3:.3f} ms of products "
                     f"(on a rank of uneven heads: its layers with the extra head faster, the others slower, 1/N "
                     f"of the columns being more than the smaller ranks' heads), attention unchanged (still by "
                     f"heads), and "
                     f"{moved * 1e3:.3f} ms of all-to-alls added (communication, not in the ratio).")
    launched, rate = by_cause.get("launches", 0.0), by_cause.get("products' rate", 0.0)
    fused = by_cause.get("activations, norms and products fused", 0.0)
    floor = share + launched + rate + fused
    lines += [f"- **Every other cause removed** (no bytes above the share, heads perfectly even): the launches "
              f"and the products' rate alone leave {share / floor:.3f}"
              + (" (the activations, norms and products fused as they are)" if fused else "") + "; without the launches' excess "
              f"{share / (rank_s - launched):.3f}, without the products' "
              f"{share / (rank_s - rate):.3f}.", ""]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["gpt2-xl:12:8:1024", "llama-3-8b:4:2:4096"],
                   help="name:layers:batch:seq")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--profile", default="h200")
    p.add_argument("--out", default=None)
    p.add_argument("--fuse-products", action=argparse.BooleanOptionalAction, default=True,
                   help="the rank's sibling products joined (default, as autotp's own), "
                        "or as written (the figures before)")
    args = p.parse_args()
    kept = kept_lines(args.out)
    command = " ".join(["python benchmarks/rank_gap.py", *sys.argv[1:]])
    lines = ["# A rank's predicted excess over its share, by cause", "",
             f"Command: `{command}`" + (" (its output: this file down to the part written by hand, which "
                                        "`--out` keeps)" if kept else ""), "",
             "The cost model alone (meta models, bf16, the plan `build_plan` makes with sequence parallelism "
             "by cost, no memory limit" + (", sibling products joined: `fuse_products=True`, autotp's default"
                                           if args.fuse_products else
                                           ", sibling products as written") + "); no device is run, so the "
             "machine does not matter. The causes are defined in the script's docstring.", ""]
    for spec in args.models:
        name, layers, batch, seq = spec.split(":")
        lines += gap(name, int(layers), int(batch), int(seq), args.tp, args.profile, args.fuse_products)
    publish(lines, args.out)


if __name__ == "__main__":
    main()
