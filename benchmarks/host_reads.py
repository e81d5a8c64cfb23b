"""Reads of device values on the host in a rank's step, and what the planner makes of their price.

    python benchmarks/host_reads.py --out benchmarks/host_reads.md

Part 1, counted: one rank of tp 2 on torch's ``fake`` backend (``deferred_checks`` on, as under
NCCL), every zoo family with experts, tiny configs in float32: the reads of a steady-state
training step and inference call, by ``tests/runtime/test_host_syncs.py``'s counter
(``HostReads``), autotp's own apart from the model's (transformers' float32 grouped fallback reads
its offsets per product), by default and under ``host_reads=False`` (the experts then on
transformers' ``batched_mm``: the float32 grouped fallback reads by itself, which
``host_reads=False`` refuses).

Part 1b, the all-to-all dispatch: the same counter, experts pinned whole per rank, the tokens
split along the sequence (``sequence_parallel=True``) and sent to their experts' ranks
(the solver's choice there, checked), for the families whose experts take it (``--dispatch-only``: this
part alone, to count another tree of the code with the same counter).

Part 2, planned: the published configs (2 layers; DeepSeek-V3 4, its fourth the first MoE; meta device, bfloat16) at tp 8 on the ``h200`` profile,
batch 2 x seq 4096: the experts layout the solver chooses and its margin over the other layout
(the plan's note), with a host read priced (``DeviceProfile.host_read_time``) and without
(``sync_s=0``, the price before it was modelled), and under ``host_reads=False``.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

import torch
from common import machine, publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

MOE_FAMILIES = ("deepseek-v3", "gpt-oss", "granitemoehybrid", "jamba", "llama4", "minimax", "mixtral", "olmoe",
                "qwen2-moe", "qwen3-moe", "qwen3.5-moe")
PUBLISHED = ("mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v3")
#: layers planned: two, and DeepSeek-V3's first three dense (first_k_dense_replace) and one MoE layer
LAYERS = {"deepseek-v3": 4}


#: families whose experts the all-to-all dispatch serves (grouped experts after a router's top-k)
DISPATCH_FAMILIES = ("deepseek-v3", "gpt-oss", "mixtral", "olmoe", "qwen2-moe", "qwen3-moe")


def counted(family: str, host_reads: bool, dispatch: bool = False) -> tuple[int, int, int, int]:
    """(experts layers, autotp's reads, the model's reads, ...) per training step and inference
    call; ``dispatch``: the experts whole per rank, the tokens sent to them by the all-to-all."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autotp
    import test_host_syncs as T
    from autotp import zoo
    from autotp.capture import EXAMPLE_SEQ

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=T.TP, store=FakeStore())
    config = zoo.tiny_config(family, layers=2, heads=4, kv_heads=2, head_dim=4, vocab=61)
    if not host_reads:
        config._experts_implementation = "batched_mm"
    model = zoo.build(family, config, dtype=torch.float32, seed=1)
    inputs = zoo.example_batch(family, config, batch=2, seq=EXAMPLE_SEQ, seed=2)
    more = dict(layout={"*.experts.*": "expert"}, sequence_parallel=True) if dispatch else {}
    pm = autotp.parallelize(model, T.TP, batch=64, seq=4096, profile="h100-dgx", host_reads=host_reads, **more)
    if dispatch:
        kinds = [type(m).__name__ for m in pm.graph_module.modules()]
        if kinds.count("DispatchRows") != T.layers_of_experts(model):
            raise ValueError(f"the solver sends {kinds.count('DispatchRows')} of {T.layers_of_experts(model)} "
                             "expert layers' tokens by the all-to-all")
    pm.deferred_checks = True
    T._reads.family = family
    out = [T.layers_of_experts(model)]
    for train in (True, False):
        reads = T._reads(pm, inputs, train)
        model_reads = [w for w, stack in reads if any(f.startswith(T.MODEL_READS) for f in stack)]
        out += [len(reads) - len(model_reads), len(model_reads)]
    dist.destroy_process_group()
    return tuple(out)


def experts_note(size: str, profile, host_reads: bool = True) -> str:
    import autotp
    from autotp import zoo

    # in bfloat16, as they train: captured with torch's grouped kernel (in float32 transformers'
    # fallback, which reads its offsets itself: host_reads=False refuses it)
    model = zoo.build(zoo.published_sizes()[size], zoo.published_config(size, layers=LAYERS.get(size, 2)),
                      device="meta", dtype=torch.bfloat16)
    plan = autotp.plan(model, tp=8, batch=2, seq=4096, profile=profile, host_reads=host_reads)
    notes = [n for n in plan.notes if n.startswith("experts ")]
    return " / ".join(re.sub(r"^experts \S+: ", "", n) for n in notes) or "(no experts note)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--families", nargs="*", default=list(MOE_FAMILIES))
    parser.add_argument("--dispatch-only", action="store_true")
    args = parser.parse_args()
    from autotp.cost_model import get_profile

    dispatch = ["", "## Counted: the all-to-all dispatch, one rank of tp 2, fake backend, tiny configs, float32", "",
                "As above, the experts pinned whole per rank (`layout={'*.experts.*': 'expert'}`), the tokens split "
                "along the sequence (`sequence_parallel=True`) and sent to their experts' ranks by the "
                "all-to-all, as the solver chooses there (one `DispatchRows` per expert layer, checked; "
                "`expert_dispatch=True` is not used: its inference program does not plan, before and after "
                "this count).", "",
                "| family | expert layers | training | inference |", "|---|---|---|---|"]
    for family in DISPATCH_FAMILIES:
        if family in args.families:
            try:
                layers, t, tm, i, im = counted(family, True, dispatch=True)
            except Exception as error:   # a plan the forced dispatch cannot make: say so, count the rest
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
                dispatch.append(f"| {family} | - | fails: {type(error).__name__}: {str(error)[:160]} | |")
            else:
                dispatch.append(f"| {family} | {layers} | {t} ({tm}) | {i} ({im}) |")
            print(dispatch[-1], flush=True)
    if args.dispatch_only:
        publish(dispatch[1:], args.out)
        return

    lines = ["# Reads to the host in a rank's step", "",
             "Command: `python benchmarks/host_reads.py --out benchmarks/host_reads.md`", "",
             machine(), "",
             "## Counted: one rank of tp 2, fake backend, tiny configs, float32", "",
             "Reads per steady-state training step / inference call (autotp's; the model's own, transformers' "
             "float32 grouped fallback, in brackets). Default: the plan the solver chooses at batch 64 x seq 4096 "
             "on `h100-dgx`; `host_reads=False`: the experts on transformers' `batched_mm` (the grouped fallback "
             "reads by itself, which `host_reads=False` refuses).", "",
             "| family | expert layers | default: training | inference | host_reads=False: training | inference |",
             "|---|---|---|---|---|---|"]
    for family in args.families:
        layers, t, tm, i, im = counted(family, True)
        _, t0, tm0, i0, im0 = counted(family, False)
        lines.append(f"| {family} | {layers} | {t} ({tm}) | {i} ({im}) | {t0 + tm0} | {i0 + im0} |")
        print(lines[-1], flush=True)
    lines += dispatch
    h200 = get_profile("h200")
    lines += ["", "## Planned: published configs, 2 layers (DeepSeek-V3: 4, one MoE), tp 8, `h200`, batch 2 x seq 4096", "",
              f"A host read priced at `h200`'s `host_read_time()` = sync {h200.sync_s * 1e6:.0f} us + a launch "
              f"{h200.launch_s * 1e6:.0f} us = {h200.host_read_time() * 1e6:.0f} us, one per expert layer under "
              "expert parallelism; 'unpriced' is the same profile with `sync_s=0` (reads cost nothing, the model "
              "before).", "",
              "| model | unpriced: chosen, margin | priced: chosen, margin | host_reads=False |", "|---|---|---|---|"]
    for size in PUBLISHED:
        before = experts_note(size, dataclasses.replace(h200, sync_s=0.0))
        after = experts_note(size, h200)
        forbidden = experts_note(size, h200, host_reads=False)
        lines.append(f"| {size} | {before} | {after} | {forbidden} |")
        print(lines[-1], flush=True)
    publish(lines, args.out)


if __name__ == "__main__":
    main()
