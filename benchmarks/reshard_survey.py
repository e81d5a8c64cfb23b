"""Where plans reshard: every zoo family's published configuration (2 layers, meta device),
planned at tp 8 with sequence parallelism by cost, forced and forbidden, and at tp 3 (uneven),
and the conversions of one split to another each plan lists (``reshard`` as an all-gather then
a cut, ``all_to_all`` where one all-to-all moves it), with the tensor's shape and whether both
splits are even.

    PYTHONPATH=$PWD python benchmarks/reshard_survey.py [family ...] > benchmarks/reshard_survey.md
"""
from __future__ import annotations

import sys
import time

import torch

from autotp import zoo
from autotp.api import _planning_seq
from autotp.capture.cache import capture as capture_model
from autotp.passes.propagate import _meta, _even
from autotp.placements import Shard
from autotp.planner.planner import build_plan

CASES = [(8, None), (8, True), (8, False), (3, None)]


def survey(family: str) -> None:
    fam = zoo.family(family)
    size = next(iter(fam.published))
    config = zoo.published_config(size, layers=2)
    model = zoo.build(family, config, device="meta")
    cap = capture_model(model, (), None)
    nodes = {n.name: n for n in cap.graph.nodes}
    for tp, sp in CASES:
        started = time.monotonic()
        try:
            _, index, prop = build_plan(cap, tp, batch=8, seq=_planning_seq(model, None), sequence_parallel=sp)
        except Exception as e:   # a forced layout that cannot be had is a finding too
            print(f"{family} ({size}) tp={tp} sp={sp}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        found = [c for c in prop.comms if c.kind == "reshard" or (   # not an expert dispatch's all-to-all
            c.kind == "all_to_all" and isinstance(c.src, Shard) and isinstance(c.dst, Shard))]
        gathers = sum(c.kind in ("all_gather", "all_gather_f") for c in prop.comms)
        print(f"{family} ({size}) tp={tp} sp={sp}: {len(found)} reshard(s) of {len(prop.comms)} comms "
              f"({gathers} gathers) [{time.monotonic() - started:.1f} s]")
        for c in found:
            meta = _meta(nodes[c.tensor])
            even = "/".join("dynamic" if meta.static(p.dim) is None else "even" if _even(meta, p, tp) else "uneven"
                            for p in (c.src, c.dst))
            shape = tuple(str(s) for s in meta.shape)
            print(f"    {c.kind:10s} {c.tensor:40s} {c.src!r} -> {c.dst!r}  shape={shape}  {even}  "
                  f"fwd={c.fwd_bytes / 2**20:.2f} MiB  for {c.consumer}")
        sys.stdout.flush()


if __name__ == "__main__":
    print(f"torch {torch.__version__}; planned on the meta device, default profile, batch 8, the family's seq")
    for name in sys.argv[1:] or sorted(zoo._all_families()):
        try:
            survey(name)
        except Exception as e:
            print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
