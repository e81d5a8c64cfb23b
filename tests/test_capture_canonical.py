"""Processes with different string-hash seeds build one program (autotp.capture.canonical).

Each process draws its own ``PYTHONHASHSEED`` unless it is fixed, and transformers builds the
masks and rotary tables of ModernBERT, Gemma 3 and Llama 4 once per layer type in the order of
``set(config.layer_types)``: export recorded them in another order under another seed, so the
ops were named otherwise and the ranks' fingerprints differed. One subprocess per seed builds
one rank's program of each family (tp 2, torch's fake backend) and prints its listing, its
capture's and its agreement fingerprint; all seeds must print the same.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import fx

from autotp.capture.canonical import canonical_order

ROOT = Path(__file__).resolve().parents[1]

#: the zoo's families whose programs differed between hash seeds before (ModernBERT: its rotary
#: tables, full and sliding; Gemma 3 and Llama 4: their masks and rotary tables by layer type)
FAMILIES = ("modernbert", "gemma3", "llama4")
#: two seeds under which each of them recorded its layer types in different orders before
SEEDS = (0, 1)

_RANK = """
import json, logging, sys
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import autotp
from autotp import zoo
from autotp.distributed.agreement import _graph_entries, fingerprint

logging.disable(logging.WARNING)
dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
out = {}
for family in sys.argv[1:]:
    config = zoo.tiny_config(family, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=61)
    model = zoo.build(family, config, dtype=torch.float32, seed=1)
    pm = autotp.parallelize(model, 2, batch=64, seq=4096, profile="h100-dgx")
    out[family] = {"program": _graph_entries(pm.graph_module), "captured": _graph_entries(pm.capture.graph, sizes=False),
                   "fingerprint": fingerprint(pm.plan, pm.graph_module, pm.capture.graph).digests(),
                   "plan": pm.plan.to_json()}
print(json.dumps(out))
"""


def _programs(seed: int) -> subprocess.Popen:
    # each process exports its own (no folder of captures shared with the others)
    env = {k: v for k, v in os.environ.items() if k != "AUTOTP_CAPTURE_CACHE"}
    env.update(PYTHONHASHSEED=str(seed), PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", _RANK, *FAMILIES], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow   # 30-40 s: two fresh interpreters; the fast tier's ranks compare their programs in every
# e2e test (the agreement check), and tests/e2e/test_torchrun.py runs ranks with their own hash seeds
def test_processes_with_other_hash_seeds_build_the_same_programs():
    runs = {seed: _programs(seed) for seed in SEEDS}
    got = {}
    for seed, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        got[seed] = json.loads(stdout.strip().splitlines()[-1])
    first = got[SEEDS[0]]
    for family in FAMILIES:
        assert any(e.startswith("call_module") for e in first[family]["program"]), f"{family}: no collective"
        for seed in SEEDS[1:]:
            for what in ("plan", "captured", "program", "fingerprint"):
                assert got[seed][family][what] == first[family][what], (family, seed, what)


def _two_chains(first: str) -> fx.GraphModule:
    """``a`` and ``b`` (each: x * c, then cos) computed from two buffers, in either order, then
    both added to the product of x and a weight: export's record of a loop over a set."""
    graph = fx.Graph()
    w, bufs, x = graph.placeholder("p_w"), {k: graph.placeholder(f"b_{k}") for k in "ab"}, graph.placeholder("x")
    ops = torch.ops.aten
    chains = {}
    for k in (first, "b" if first == "a" else "a"):
        chains[k] = graph.call_function(ops.cos.default, (graph.call_function(ops.mul.Tensor, (x, bufs[k])),))
    y = graph.call_function(ops.mul.Tensor, (x, w))
    graph.output(graph.call_function(ops.add.Tensor, (graph.call_function(ops.add.Tensor, (y, chains["a"])),
                                                      chains["b"])))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_independent_chains_recorded_in_either_order_come_out_alike():
    listings = []
    for first in "ab":
        gm = _two_chains(first)
        for node in gm.graph.nodes:
            node.meta["val"] = torch.empty(2)
        canonical_order(gm.graph, ["p_w"])
        gm.recompile()
        place = {n: i for i, n in enumerate(gm.graph.nodes)}
        x_node = next(n for n in gm.graph.nodes if n.name == "x")
        assert [place[u] for u in x_node.users] == sorted(place[u] for u in x_node.users)   # in graph order
        listings.append([f"{n.target} {[a.name if a.op == 'placeholder' else place[a] for a in n.all_input_nodes]}"
                         for n in gm.graph.nodes])
        x, w, a, b = (torch.randn(3, dtype=torch.float64) for _ in range(4))
        assert torch.equal(gm(w, a, b, x), x * w + torch.cos(x * a) + torch.cos(x * b))
    assert listings[0] == listings[1]
    # the chains stay before the product with the weight, the one the first add reads first
    assert listings[0][4:] == ["aten.mul.Tensor ['x', 'b_a']", "aten.cos.default [4]", "aten.mul.Tensor ['x', 'b_b']",
                               "aten.cos.default [6]", "aten.mul.Tensor ['x', 'p_w']", "aten.add.Tensor [8, 5]",
                               "aten.add.Tensor [9, 7]", "output [10]"]
