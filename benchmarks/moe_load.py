"""The routing load of a mixture of experts on one batch: the rows each expert and each rank's
experts get, from the serial model's own top-k.

Under expert parallelism a rank computes the (token, expert) rows routed to its experts, so its
step follows its experts' load, not an even ``T * k / tp``. A trained router is balanced (its
load-balancing loss); a randomly initialized one is not: random attention averages the tokens,
so their hidden states, and so their top-k, are correlated, and a few experts get most rows.
One rank of tp=N timed alone (``benchmarks/rank_efficiency.py``) then measures that rank's load,
not the layout. This module counts the load, so the benchmark can say what it measured and run
a rank whose load is nearest the mean (what a balanced router's step costs) and the most loaded
one (what a real step under this router waits for); and it reads the rows a rank's experts did
run from its grouped products' FLOPs (``expert_rows_share``): on the fake backend those are not
the serial count (its all-reduces leave a rank's own part, so the rank routes values of its
own), and the benchmark can pick its rank by them.

The top-k is read where transformers' experts module receives it (the library's
``autotp.planner.expert_load.routed_ids``, which ``autotp.measure_expert_load`` counts for the
planner): every module holding a 3-D stack of experts (``[experts, ...]``) is called as
``experts(hidden, top_k_index, top_k_weights)``; a forward pre-hook reads its integer argument. A rank's experts are those its
Shard(0) of the stack holds (``autotp.placements.local_ranges``, uneven where tp does not divide
them), as the expert-parallel layout splits them.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class LayerLoad:
    """One MoE layer's routing on a batch: ``experts[e]`` rows routed to expert ``e``;
    ``ranks[r]`` rows routed to rank ``r``'s experts (expert parallelism, all tokens)."""
    name: str
    experts: tuple[int, ...]
    ranks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Load:
    """The routing load of every MoE layer of a model on one batch, for ``tp`` ranks."""
    tp: int
    tokens: int
    top_k: int
    layers: tuple[LayerLoad, ...]

    @property
    def ranks(self) -> tuple[int, ...]:
        """Rows per rank summed over the layers (what its experts compute in one step)."""
        return tuple(sum(layer.ranks[r] for layer in self.layers) for r in range(self.tp))

    @property
    def mean(self) -> float:
        return sum(self.ranks) / self.tp

    def skew(self, rank: int) -> float:
        """``rank``'s rows over the mean (1.00: a balanced router's share)."""
        return self.ranks[rank] / self.mean if self.mean else float("nan")

    @property
    def balanced_rank(self) -> int:
        """The rank whose load is nearest the mean (the lowest such rank)."""
        return min(range(self.tp), key=lambda r: (abs(self.ranks[r] - self.mean), r))

    @property
    def busiest_rank(self) -> int:
        """The most loaded rank (the lowest such rank): the one a real step waits for."""
        return max(range(self.tp), key=lambda r: (self.ranks[r], -r))


def expert_ranges(experts: int, tp: int, rank: int) -> tuple[tuple[int, int], ...]:
    """The experts ``rank`` holds under expert parallelism (the stack's Shard(0))."""
    from autotp.placements import Shard, local_ranges

    return local_ranges(experts, Shard(0), tp, rank)


def routing_load(model: nn.Module, batch: dict, tp: int) -> Load:
    """The serial model's routing on ``batch`` (one forward, no gradient), counted per expert and
    per rank."""
    from autotp.planner.expert_load import routed_ids

    ids = routed_ids(model, batch)
    layers, top_k, tokens = [], 0, 0
    for name, (index, experts) in ids.items():
        tokens, top_k = index.shape
        per_expert = torch.bincount(index.reshape(-1), minlength=experts)
        ranks = []
        for r in range(tp):
            held = torch.zeros(experts, dtype=torch.bool)
            for lo, hi in expert_ranges(experts, tp, r):
                held[lo:hi] = True
            ranks.append(int(per_expert[held].sum()))
        layers.append(LayerLoad(name, tuple(int(c) for c in per_expert), tuple(ranks)))
    return Load(tp, tokens, top_k, tuple(layers))


def load_lines(load: Load, measured: dict[str, int]) -> list[str]:
    """The load table of a result file: rows per rank per layer, the skew, and which ranks ran
    (``measured``: what each run rank stands for -> its rank; none: the ranks are chosen otherwise)."""
    lines = [f"Routing load (the serial model's top-{load.top_k} on this batch, {load.tokens} tokens per layer; "
             f"rows each rank's experts get under expert parallelism; expert parallelism's ranks hold "
             f"contiguous runs of experts):", "",
             "| MoE layer | " + " | ".join(f"rank {r}" for r in range(load.tp)) + " | max ÷ mean |",
             "|---|" + "---|" * (load.tp + 1)]
    for layer in load.layers:
        mean = sum(layer.ranks) / load.tp
        lines.append(f"| `{layer.name}` | " + " | ".join(str(c) for c in layer.ranks)
                     + f" | {max(layer.ranks) / mean:.2f} |")
    lines.append("| all layers | " + " | ".join(str(c) for c in load.ranks)
                 + f" | **{max(load.ranks) / load.mean:.2f}** |")
    ran = "; ".join(f"{what}: rank {r} ({load.ranks[r]} rows, {load.skew(r):.2f}x the mean)"
                    for what, r in measured.items())
    return lines + (["", f"Ranks run: {ran}."] if measured else [])


def expert_rows_share(rank_counts, serial_counts, tp: int) -> float:
    """The rows a rank's grouped expert products ran over a balanced share (1.00: ``T * k / tp``):
    their FLOPs (forward + backward, ``autotp.testing.work.WorkCounter``) against serial's over
    ``tp``, a grouped product's FLOPs being proportional to its rows (0.00: the rank's experts got
    none). NaN where serial ran no grouped product (a batched experts implementation computes
    every expert on every token)."""
    grouped = lambda counts: sum(f for op, f in counts.by_op.items() if "grouped_mm" in op)   # noqa: E731
    rank, serial = grouped(rank_counts), grouped(serial_counts)
    return rank / (serial / tp) if serial else float("nan")


def experts_seconds(index, prop, profile, rank: int) -> float:
    """The cost model's forward + backward seconds, on ``rank``, of the ops on its experts' rows
    (a ``Routed`` placement held by the experts' rank, sent there by a dispatch or not: not a
    rank's own token rows). The model prices them at a balanced router's ``1/tp`` of the rows;
    at another load their time scales with the rows (``at_load``)."""
    from autotp.cost_model.symbolic import split_seconds
    from autotp.placements import Routed

    def experts_rows(p) -> bool:
        return isinstance(p, Routed) and not p.tokens

    total = 0.0
    for node, strat in prop.chosen.items():
        outs = strat.output if isinstance(strat.output, tuple) else (strat.output,)
        if any(experts_rows(p) for p in (*strat.inputs, *outs)):
            parts = split_seconds(index.infos[node], strat, index.env, profile, index.tp, index.align, rank)
            total += parts["products"] + parts["attention"] + parts["memory"]
    return total


def at_load(predicted: float, experts: float, share: float) -> float:
    """A rank's predicted step with its experts' part scaled from a balanced share to ``share``
    (its rows over the mean); ``predicted`` where the share is not known."""
    return predicted + experts * (share - 1.0) if share == share else predicted
