"""The summary of a round of ``benchmarks/gpu_round.py``: per issue point, what its figures show
against the point's goal. Input: the round's ``round.json`` (a dict); output: the lines of
``summary.md``. Rerun on a kept file: ``python3 benchmarks/gpu_summary.py $OUT/round.json``.

Goals (issues 44 and 47): one rank of tp 8 does >= 0.85 of its eighth of the serial step for the
dense models, eager, compute only; >= 0.7 for the mixtures of experts; the solver's experts
layout measured within 10% of the fastest measured; ``torch.compile(pm)`` at tp 1 no slower than
HF's module compiled, with no graph break. A mixture of experts' versions are read as the rank
whose experts' load on the batch is nearest the mean (``benchmarks/moe_load.py``): the goal is
a balanced router's step; the batch's skew and the most loaded rank's step, where run, are stated
beside it.
"""
from __future__ import annotations

import json
import math
import sys

DENSE_GOAL, MOE_GOAL, PICK_SLACK = 0.85, 0.7, 1.10
#: a rank's experts' rows within this of a balanced share read as a balanced router's step
LOAD_SLACK = 0.10
#: rank_efficiency.py's experts versions, beside its "default" (the solver's own plan)
VERSIONS = ("expert-parallel", "expert-TP", "expert-parallel, all-to-all dispatch")
#: rank_efficiency.py's default plan made at the batch's measured routing load (``--plan-load``)
AT_LOAD = "default, measured load"


def _clock(results: dict) -> str:
    """The clock a rank's step is read by: the wall clock on a GPU (synchronized), the thread's
    CPU time on a CPU (a shared machine's load is in the wall clock)."""
    return "thread" if results["device"] == "cpu" else "clock"


def _ratio(share: float, rank: float) -> float:
    return share / rank if rank and rank == rank and share == share else math.nan


def _f(x: float, fmt: str = ".2f") -> str:
    return "-" if x is None or x != x else format(x, fmt)


def _status(row: dict) -> str | None:
    if "skipped" in row:
        return row["skipped"]
    if "failed" in row:
        return "FAILED: " + row["failed"]
    return None


def summary(results: dict) -> list[str]:
    parts = results["parts"]
    clock = _clock(results)
    device = (f" GPU: {results['gpu']}." if results.get("gpu") else
              " No GPU: a CPU rehearsal (`--quick`: tiny widths, so its ratios say that the code runs, not how fast).")
    read = "wall clock, the device synchronized" if clock == "clock" else "thread CPU time"
    lines = [f"# Round {results['round']}: what the figures show against the issues' goals", "",
             f"Command: `{results['command']}`", "",
             f"{results['machine']}{device} Whole round {results.get('total_s', 0):.0f} s of a budget of "
             f"{results['budget_s']:.0f} s.", "",
             "Efficiency is serial/8 ÷ rank (1.00: the rank does exactly its eighth; compute only, the fake backend "
             f"moves nothing), read off the {read}.",
             "", "## Parts", "", "| part | issue point | estimate on an H200 s | ran s | result |",
             "|---|---|---|---|---|"]
    for name, row in parts.items():
        lines.append(f"| {name} | {row['point']} | {row['estimate_s']} | {_f(row.get('s'), '.0f')} | "
                     f"{_status(row) or 'done'} |")
    lines += ["", "## Issue 44, point 3: a dense rank at its eighth (goal >= 0.85 eager)", "",
              "| model | eager | compiled | device busy (rank: eager / compiled) | predicted | verdict |",
              "|---|---|---|---|---|---|"]
    for name, fig in _measured(parts, "44.3", lines):
        serial, rank = fig["versions"]["serial"], fig["versions"]["default"]
        eager = _ratio(serial[clock] / 8, rank[clock])
        compiled = (_ratio(serial["compiled"][clock] / 8, rank["compiled"][clock])
                    if serial.get("compiled") and rank.get("compiled") else math.nan)
        verdict = ("meets the goal" if eager >= DENSE_GOAL else f"short of the goal by {DENSE_GOAL - eager:.2f}"
                   if eager == eager else "-")
        lines.append(f"| {fig['model']} ({fig['layers']} layers, {fig['batch']} x {fig['seq']}, {fig['dtype']}; "
                     f"part {name}) | "
                     f"**{_f(eager)}** | {_f(compiled)} | {_f(rank['busy'], '.0%')} / "
                     f"{_f((rank.get('compiled') or {}).get('busy', math.nan), '.0%')} | "
                     f"{_f(_ratio(rank['predicted_share'], rank['predicted']))} | {verdict} |")
    lines += ["", "Where a rank falls short, its part's table (`rank_<model>.md`) gives its time per ATen op beside "
              "serial/8 and its copies: the ops above their share are what is left.", ""]
    lines += _moe(parts, clock)
    lines += _compiled_moe(parts.get("moe:compile"))
    lines += _noticed(parts)
    return lines


def _measured(parts: dict, point: str, lines: list[str]):
    """(name, figures) of each part of issue point ``point`` that brought figures back; a part that
    did not is a row of its table's six columns with its status, appended to ``lines``."""
    for name, row in parts.items():
        if row["point"] != point:
            continue
        if not row.get("figures"):
            lines.append(f"| {name} | - | - | - | - | {_status(row)} |")
            continue
        yield name, row["figures"]


def _moe(parts: dict, clock: str) -> list[str]:
    """Issue 47 point 2. The versions' main figures are the rank whose experts' load on the batch is
    nearest the mean (``benchmarks/moe_load.py``: a balanced router's step): the goal reads them.
    The batch's routing skew and, where run, the most loaded rank's step are stated beside them."""
    lines = ["## Issue 47, point 2: experts layouts measured (goal >= 0.7; the solver's pick within 10% of the "
             "fastest)", "",
             "The goal reads each version as the rank whose experts' load on the batch is nearest the mean (a "
             "trained router is balanced); the most loaded rank's step, where run, is what this random router's "
             "step waits for.", "",
             "| model | version | experts' roles | rank (experts' work ÷ mean) | predicted ms (at the rank's load) | "
             "measured ms | efficiency |",
             "|---|---|---|---|---|---|---|"]
    picks = []
    for name, fig in _measured(parts, "47.2", lines):
        versions = {k: v for k, v in fig["versions"].items() if k != "load"}
        share = versions["serial"][clock] / 8
        for label in ("default", AT_LOAD, *VERSIONS):
            v = versions.get(label)
            if v is None:
                continue
            shown = {"default": "solver's pick (default plan)",
                     AT_LOAD: "solver's pick at the batch's measured load"}.get(label, label)
            roles = ", ".join(v["expert_roles"]) or "-"
            roles += " (all-to-all dispatch)" if v.get("dispatch") else ""
            for run, row in ((shown, v), (f"{shown}, busiest rank", v.get("busiest"))):
                if row is None:
                    continue
                lines.append(f"| {fig['model']} | {run} | {roles} | {_rank(row)} | {_f(row['predicted'] * 1e3)}"
                             + (f" ({_f(row['predicted_at_load'] * 1e3)})" if "predicted_at_load" in row else "")
                             + f" | {_f(row[clock] * 1e3)} | **{_f(_ratio(share, row[clock]))}** |")
        measured = {k: v[clock] for k, v in versions.items() if k != "serial" and v[clock] == v[clock]}
        if "default" in measured and len(measured) > 1:
            fastest = min(measured, key=measured.get)
            over = measured["default"] / measured[fastest]
            by_prediction = min((k for k in versions if k != "serial"), key=lambda k: versions[k]["predicted"])
            picks.append(f"- {fig['model']}: the solver's pick measured {over:.2f}x the fastest ({fastest}): "
                         + ("within 10%" if over <= PICK_SLACK else "**more than 10% slower**")
                         + f"; best efficiency {_ratio(share, measured[fastest]):.2f} against the goal {MOE_GOAL}; "
                         f"fastest predicted: {by_prediction}. " + _skew(fig["versions"].get("load"), versions, clock)
                         + "Plan notes: " + " | ".join(n[:200] for n in versions["default"]["notes"][:2]))
        if AT_LOAD in versions:
            picks.append(_pick_at_load(fig["model"], versions, clock))
    return lines + [""] + picks + [""]


def _pick_at_load(model: str, versions: dict, clock: str) -> str:
    """The plan made at the measured load against this router's real step: each version's
    slowest rank run (its busiest where one was run, else the rank that ran: every rank alike)."""
    def waits(v: dict) -> float:
        return (v.get("busiest") or v)[clock]

    steps = {k: waits(v) for k, v in versions.items() if k not in ("serial", "load") and waits(v) == waits(v)}
    others = {k: t for k, t in steps.items() if k not in ("default", AT_LOAD)}
    if AT_LOAD not in steps or not others:
        return f"- {model}: the pick at the measured load was not measured against the layouts."
    fastest = min(others, key=others.get)
    over = steps[AT_LOAD] / others[fastest]
    return (f"- {model}, at this router's load (each version's busiest rank run, what its step waits for): the "
            f"solver's pick planned at the measured load ({', '.join(versions[AT_LOAD]['expert_roles']) or '-'}) "
            f"measured {over:.2f}x the fastest ({fastest}): "
            + ("within 10%" if over <= PICK_SLACK else "**more than 10% slower**")
            + (f"; at a balanced router's plan {steps['default'] / others[fastest]:.2f}x" if "default" in steps
               else "") + ".")


def _rank(row: dict) -> str:
    return f"{row['rank']} ({_f(row['load'])})" if "rank" in row else "0"


def _skew(load: dict | None, versions: dict, clock: str) -> str:
    """What the batch's routing was: rows per rank max ÷ mean, which rank ran, and the most loaded
    rank's step against it where that was run."""
    if load is None:
        return "Routing load not counted (rank 0 ran: its experts' load, not a balanced one). "
    busiest = [f"{k} {_f(_ratio(v['busiest'][clock], v[clock]))}x" for k, v in versions.items()
               if k != "serial" and v.get("busiest")]
    off = [f"{k} {v['load']:.2f}" for k, v in versions.items() if k != "serial" and "expert" in v["expert_roles"]
           and abs(v.get("load", 1.0) - 1.0) > LOAD_SLACK]
    return (f"This batch's routing (a random router): rows per rank max ÷ mean {load['max_over_mean']:.2f}; rank "
            f"{load['balanced_rank']} (nearest the mean) ran every version"
            + (f"; the most loaded, rank {load['busiest_rank']}, took " + ", ".join(busiest) + " of its step"
               if busiest else "") + ". "
            + ("**Not a balanced step** where the rank's experts ran off a balanced share by more than 10% (the "
               "fake world's all-reduces leave a rank's own part, so it routes values of its own): " + ", ".join(off)
               + "; `rank_efficiency.py --rank-by probe` picks the rank by the rows it runs. " if off else ""))


def _compiled_moe(row: dict | None) -> list[str]:
    lines = ["## Issue 47, point 3: compiled MoE at tp 1 against HF compiled (goal: no slower, no graph break)", ""]
    if row is None or not row.get("figures"):
        return lines + [("not in this round" if row is None else _status(row)), ""]
    fig = row["figures"]
    med, breaks = fig["median_s"], fig["breaks"]
    ratio = med["autotp compiled"] / med["HF compiled"]
    broken = sum(breaks.get("autotp compiled", {}).values())
    lines += [f"autotp compiled {med['autotp compiled'] * 1e3:.2f} ms against HF compiled "
              f"{med['HF compiled'] * 1e3:.2f} ms (median): **{ratio:.3f}x** "
              + ("(no slower: meets the goal)" if ratio <= 1.0 else "(slower: short of the goal)")
              + f"; graphs {fig['graphs'].get('autotp compiled')}, graph breaks {broken}"
              + (" (none: meets the goal)" if not broken else ": " + "; ".join(breaks["autotp compiled"]))
              + f". Eager: autotp {med['autotp eager'] * 1e3:.2f} ms, HF {med['HF eager'] * 1e3:.2f} ms.", ""]
    return lines


def _noticed(parts: dict) -> list[str]:
    lines = ["## Noticed on the way", ""]
    norm = parts.get("norm:rms", {})
    if norm.get("figures"):
        fig = norm["figures"]
        dispatched = fig["dispatched"]["aten.rms_norm"]
        ms = fig["ms"]
        bf16 = fig["exactness"].get("torch.bfloat16", {})
        lines.append("- `aten.rms_norm`: dispatches " + ", ".join(sorted(set(dispatched)))
                     + f"; forward + backward bf16 {_f(ms.get('aten.rms_norm torch.bfloat16'), '.3f')} ms against the "
                     f"written statistic's {_f(ms.get('written torch.bfloat16'), '.3f')} ms"
                     + (f"; kernels {fig['kernels']}" if "kernels" in fig else "")
                     + "; bf16 against the written: " + "; ".join(
                         f"{k} {c['differing']} of {c['of']} differ (fused vs f64 {c['fused_vs_f64']:.1e}, written "
                         f"{c['written_vs_f64']:.1e})" for k, c in bf16.items()))
    else:
        lines.append(f"- norm:rms: {_status(norm) if norm else 'not in this round'}")
    coll = parts.get("nccl:collectives", {})
    if coll.get("figures"):
        fig = coll["figures"]
        bad = {k: v for k, v in fig["checks"].items() if v != "passed"}
        lines.append(f"- collectives under {fig['backend']} in a world of one: {len(fig['checks']) - len(bad)} of "
                     f"{len(fig['checks'])} passed" + ("" if not bad else "; " + "; ".join(f"{k}: {v}"
                                                                                          for k, v in bad.items())))
    else:
        lines.append(f"- nccl:collectives: {_status(coll) if coll else 'not in this round'}")
    host = parts.get("host:cuda", {})
    if host.get("figures"):
        fig = host["figures"]
        cells = []
        for key, row in fig.items():
            spec, kind, label = key.split(" | ")
            if label != "serial":
                serial = fig[f"{spec} | {kind} | serial"]
                cells.append(f"{spec} {kind} {label} {row['thread'] / serial['thread']:.2f}")
        lines.append("- host work per step on the device, rank ÷ serial (thread time): " + "; ".join(cells))
    else:
        lines.append(f"- host:cuda: {_status(host) if host else 'not in this round'}")
    probe = parts.get("host:gpt2-xl", {})
    if probe.get("figures"):
        fig = probe["figures"]
        lines.append(f"- where the host's time goes (issue 44, point 4), {fig['model']} {fig['layers']} layers, "
                     f"{fig['batch']} x {fig['seq']}, sequence parallelism "
                     f"{'chosen' if fig['sequence_parallel'] else 'not chosen'}: {fig['verdict']} "
                     "(its tables: `host_gpt2-xl.md`)")
    else:
        lines.append(f"- host:gpt2-xl: {_status(probe) if probe else 'not in this round'}")
    return lines + [""]


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print("\n".join(summary(json.load(f))))
