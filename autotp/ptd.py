"""Choosing tensor x pipeline x data parallelism (PTD-P) for a model on a number of GPUs.

``autotp.plan(model, world=N, gpus_per_node=8)`` lands here. The model's stack of identical
blocks (:func:`autotp.capture.expand.find_stacks`: exactly one, as in a decoder-only model) is
cut to two and to three blocks; each cut model is captured and planned by autotp at every
tensor-parallel size ``t`` and micro-batch size considered. The three-block plan minus the
two-block plan prices one layer (time, parameters, activations); the rest prices what lies
outside the layers (embedding, head, loss). :func:`autotp.cost_model.pipeline.choose` then puts
the layers into every feasible pipeline (``t`` within a node and dividing it, ``p`` dividing the
layers, ``d = N / (t p)`` dividing the batch in whole micro-batches, interleaved virtual stages
where the layers per stage allow, the first stage's memory within the device) and the fastest
is the choice. This is a planner: it prices and explains; ``PipelinePlan.parallelize_kwargs()``
is what runs its choice with ``autotp.parallelize`` (``autotp.runtime.pipeline``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from torch import nn

from .cost_model import get_profile
from .cost_model.pipeline import Choice, Cluster, LayerCost, choose, counted_flops
from .errors import ConfigError

#: tensor-parallel sizes and micro-batch sizes the search tries (t also bounded by the node)
TPS = (1, 2, 4, 8, 16)
MICRO_BATCHES = (1, 2, 4, 8)
VIRTUAL = (1, 2, 4)


@dataclass
class PipelinePlan:
    """The (t, p, d, micro-batch, schedule) chosen for ``world`` GPUs, with the alternatives."""

    world: int
    gpus_per_node: int
    profile: str
    batch: int
    seq: int
    layers: int
    choices: list[Choice]              # every feasible choice, fastest first
    rejected: dict[str, str]           # what ruled out the rest, in words

    @property
    def best(self) -> Choice:
        return self.choices[0]

    @staticmethod
    def schedule(c: Choice) -> str:
        if c.p == 1:
            return "no pipeline"
        return "1F1B" if c.virtual == 1 else f"interleaved 1F1B, {c.virtual} virtual stages per GPU"

    def parallelize_kwargs(self, choice: Choice | None = None) -> dict[str, Any]:
        """What runs ``choice`` (default: the best) with :func:`autotp.parallelize` in a world of
        ``t * p * d`` ranks: ``autotp.parallelize(model, **pplan.parallelize_kwargs())``; each
        dp replica then steps on ``micro_batch * micro_batches`` rows of the global batch."""
        c = choice or self.best
        kwargs: dict[str, Any] = {"tp": c.t, "batch": c.micro_batch * c.micro_batches, "seq": self.seq}
        if c.p > 1:
            kwargs.update(pp=c.p, microbatches=c.micro_batches,
                          schedule="interleaved1f1b" if c.virtual > 1 else "1f1b", virtual=c.virtual)
        return kwargs

    def why(self) -> list[str]:
        b, out = self.best, []
        out.append(f"t={b.t}: tensor parallelism stays inside a node ({self.gpus_per_node} GPUs), where its "
                   "per-layer all-reduces use the fast in-node link")
        if b.p > 1:
            held = b.parts.get("layers_per_gpu") or [self.layers // b.p] * b.p
            cut = f"{held[0]} of the {self.layers} layers per stage" if len(set(held)) == 1 else \
                f"the {self.layers} layers cut {held} over the stages (the first also runs the embedding, the last " \
                "the head and loss)"
            out.append(f"p={b.p}: {cut}; the bubble is {b.bubble:.1%} of the step with {b.micro_batches} "
                       f"micro-batches of {b.micro_batch}")
        for other in self.choices[1:]:
            if (other.t, other.p) != (b.t, b.p):
                out.append(f"the next other (t, p), ({other.t}, {other.p}) with d={other.d}, "
                           f"{self.schedule(other)}, takes {other.step_s / b.step_s:.2f}x as long")
                break
        out += [f"{k}: {v}" for k, v in self.rejected.items()]
        return out

    def __str__(self) -> str:
        b = self.best
        lines = [
            f"autotp PTD-P plan for {self.world} GPUs ({self.gpus_per_node} per node), profile {self.profile}, "
            f"global batch {self.batch} x seq {self.seq}, {self.layers} layers",
            f"  chosen: t={b.t} x p={b.p} x d={b.d}, micro-batch {b.micro_batch} ({b.micro_batches} per replica), "
            f"{self.schedule(b)}",
            f"  predicted step {b.step_s:.4g} s, pipeline bubble {b.bubble:.1%}, "
            f"memory per GPU {b.memory_bytes / 2**30:.2f} GiB"
            + (f", {b.flops_per_gpu / 1e12:.1f} TFLOP/s per GPU (model FLOPs)" if b.flops_per_gpu else ""),
            "  why:",
            *(f"    - {w}" for w in self.why()),
            "  fastest feasible choices:",
            "    t  p  d  mb  v  step s      bubble  GiB/GPU",
        ]
        for c in self.choices[:8]:
            lines.append(f"    {c.t:<2} {c.p:<2} {c.d:<2} {c.micro_batch:<3} {c.virtual:<2} {c.step_s:<11.4g} "
                         f"{c.bubble:<7.1%} {c.memory_bytes / 2**30:.2f}")
        return "\n".join(lines)


def plan_ptd(model: nn.Module, world: int, *, gpus_per_node: int = 8, batch: int = 8, seq: int,
             profile: Any = None, tp: int | None = None) -> PipelinePlan:
    """See the module docs. ``tp`` fixes t instead of searching it."""
    from .capture.expand import find_stacks

    if not isinstance(world, int) or world < 1:
        raise ConfigError(f"world={world!r}: give the number of GPUs, a positive int")
    if gpus_per_node < 1:
        raise ConfigError(f"gpus_per_node={gpus_per_node!r} must be a positive int")
    prof = get_profile(profile)
    stacks = find_stacks(model)
    if len(stacks) != 1:
        found = ", ".join(s.path for s in stacks) or "none"
        raise ConfigError(f"pipeline planning needs the model's layers as one stack of more than 3 identical blocks "
                          f"(an nn.ModuleList); found {len(stacks)} ({found}). Plan tensor parallelism alone with "
                          "autotp.plan(model, tp)")
    stack = stacks[0]
    if stack.period != 1:
        raise ConfigError(f"pipeline planning prices one layer of {stack.path} as every other's, and its layers "
                          f"differ, repeating every {stack.period} (e.g. sliding-window and full attention). "
                          "Plan tensor parallelism alone with autotp.plan(model, tp)")
    layers = stack.n
    tps = (tp,) if tp is not None else TPS
    rejected: dict[str, str] = {}
    outside_node = [t for t in tps if t > gpus_per_node]
    if outside_node:
        rejected["t beyond a node"] = (f"t in {outside_node} would put tensor parallelism's all-reduces on the "
                                       f"inter-node link ({gpus_per_node} GPUs per node)")
    costs: dict[tuple[int, int], LayerCost] = {}

    def priced(t: int, micro_batch: int) -> LayerCost:
        if (t, micro_batch) not in costs:
            costs[t, micro_batch] = layer_cost(model, stack, t, micro_batch, seq, prof)
        return costs[t, micro_batch]

    config = getattr(model, "config", None)
    hidden, vocab = _hidden(model), getattr(config, "vocab_size", None)
    cluster = Cluster(prof, gpus_per_node=gpus_per_node)
    usable = tuple(t for t in tps if t <= gpus_per_node and world % t == 0)   # heads may split unevenly
    with _quiet():
        # the model FLOPs of a step, counted off its own graph (a SwiGLU MLP, grouped-query
        # attention or an untied head are not the paper's GPT formula)
        flops = counted_flops(priced(usable[0], 1), batch=batch, micro_batch=1, layers=layers) if usable else None
        found = choose(priced, cluster, gpus=world, layers=layers, batch=batch, seq=seq,
                       hidden=hidden or 1, vocab=vocab or 0, tps=usable, micro_batches=MICRO_BATCHES,
                       virtual=VIRTUAL, flops=flops)
    if not found:
        raise ConfigError(
            f"no (t, p, d) fits {world} GPUs for this model: t must divide {world} and stay within a node "
            f"({gpus_per_node} GPUs), p must divide its {layers} layers, d = world / (t p) must divide the batch "
            f"({batch}) in whole micro-batches, and the first stage's memory must fit "
            f"{prof.memory / 2**30:.0f} GiB. Change world, batch or gpus_per_node")
    return PipelinePlan(world, gpus_per_node, prof.name, batch, seq, layers, found, rejected)


def layer_cost(model: nn.Module, stack: Any, t: int, micro_batch: int, seq: int, profile: Any) -> LayerCost:
    """What a micro-batch costs at tp ``t`` by autotp's plans of ``model`` with ``stack`` (a
    :class:`autotp.capture.expand.Stack`) cut to 2 and to 3 blocks: one layer is their
    difference, the rest lies outside the layers (the optimizer's share taken out: a pipeline
    prices it once a step), split between the first stage (before the layers) and the last as
    the plan's ops and collectives fall (``cost_model.pipeline.layer_costs``)."""
    from .planner import build_plan
    from .capture.cache import capture
    from .capture.expand import NotExpandable, cut
    from .cost_model.symbolic import forward_flops
    from .runtime.module.outline import layer_paths
    from .cost_model.pipeline import layer_costs

    prof = get_profile(profile)
    got, flops = {}, {}
    ends = (0.0, 0.0)
    for keep in (2, 3):
        try:
            with cut(model, [stack], keep):
                plan, index, prop = build_plan(capture(model), t, batch=micro_batch, seq=seq, profile=prof,
                                               memory_limit=float("inf"))
                if keep == 2:   # what lies before the layers and what after, as the runtime balances them
                    ends = layer_costs(index, prop, prof, layer_paths(model))[1:]
                flops[keep] = sum(forward_flops(info, index.env) for info in index.infos.values())
        except NotExpandable as why:
            raise ConfigError(f"pipeline planning cuts {stack.path} to {keep} blocks to price one, and this model "
                              f"cannot be cut: {why}. Plan tensor parallelism alone with autotp.plan(model, tp)") from why
        got[keep] = (plan.compute_s + plan.comm_s, max(plan.param_bytes_per_rank()) / plan.dtype_bytes,
                     plan.activation_bytes, plan.dtype_bytes)
    (t2, p2, a2, size), (t3, p3, a3, _) = got[2], got[3]
    layer_params, outside_params = p3 - p2, max(0.0, p2 - 2 * (p3 - p2))
    layer_s = (t3 - t2) - prof.update_time(layer_params)
    outside_s = max(0.0, (t2 - 2 * (t3 - t2)) - prof.update_time(outside_params))
    hidden = _hidden(model)
    boundary = micro_batch * seq * hidden * size if hidden else a3 - a2
    before = ends[0] / sum(ends) if sum(ends) > 0 else 0.0
    layer_flops = flops[3] - flops[2]
    return LayerCost(layer_s, outside_s, layer_params, outside_params, a3 - a2, boundary, first_s=outside_s * before,
                     layer_flops=layer_flops, outside_flops=max(0.0, flops[2] - 2 * layer_flops))


def _hidden(model: nn.Module) -> int | None:
    from .capture import config_int

    return config_int(model, "hidden_size", "n_embd", "d_model")


@contextlib.contextmanager
def _quiet():
    import logging

    log = logging.getLogger("autotp")
    level = log.level
    log.setLevel(logging.ERROR)   # the cut models' plans notes are not the user's plan
    try:
        yield
    finally:
        log.setLevel(level)


__all__ = ["PipelinePlan", "layer_cost", "plan_ptd"]
