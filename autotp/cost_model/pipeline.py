"""Tensor x pipeline x data parallelism (Megatron's PTD-P) priced from autotp's own plans.

A step of a GPT-like model with ``layers`` identical layers on ``t`` x ``p`` x ``d`` GPUs:

- **one micro-batch on one stage**: ``layers / p`` layers, each priced by autotp's tensor-parallel
  plan at ``t`` for the micro-batch (forward and backward, its collectives included; the
  optimizer's share the plan carries is taken out and priced once per step below), plus what lies
  outside the layers (embedding, head, loss: the first and the last stage carry it, so the
  slowest stage does). With full activation recomputation (``recompute=True``, what the PTD-P
  runs use) each layer's forward runs twice: 4/3 of forward + backward.
- **the pipeline** (1F1B, or GPipe: the same bubble): ``(m + p - 1)`` stage slots for ``m``
  micro-batches; with ``v`` virtual stages per GPU (interleaved 1F1B) the bubble shrinks to
  ``(p - 1) / v`` slots and each slot sends ``v`` times as many activations. Each slot sends one
  activation forward and one gradient back between stages over the inter-node link, split over
  the ``t`` GPUs of a stage (Megatron's scatter/gather).
- **data parallelism**: a ring all-reduce of each GPU's gradients (2 bytes per parameter) over the
  ``d`` replicas on the inter-node link, after the pipeline flush (not overlapped).
- **the optimizer**: AdamW over each GPU's parameters, memory-bound (the profile's update time).

Memory per GPU: the training state of its parameters, and with recomputation the input of each
of its layers for every micro-batch in flight (1F1B keeps ``p`` on the first stage; the
interleaved schedule's longer warm-up about ``1 + 1/v`` times as many layers) plus one layer's
activations being recomputed.

Per-GPU throughput uses the model FLOPs of Narayanan et al. (2021), eq. (3), as the paper does:
``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` per step (recomputation included).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .devices import DeviceProfile


@dataclass(frozen=True)
class Cluster:
    """GPUs in nodes: the profile prices a GPU and its in-node (TP) link; ``node_link_bw`` is
    each GPU's share of the inter-node network (bytes/s), ``node_link_latency`` per message."""

    profile: DeviceProfile
    gpus_per_node: int = 8
    node_link_bw: float = 25e9          # DGX A100: one 200 Gb/s InfiniBand HCA per GPU
    node_link_latency: float = 5e-6


@dataclass(frozen=True)
class LayerCost:
    """What autotp's plan at one tp says a micro-batch costs: seconds of forward + backward of
    one layer and of what lies outside the layers; parameters and activation bytes per GPU."""

    layer_s: float
    outside_s: float
    layer_params: float        # per GPU (already divided by t)
    outside_params: float      # per GPU
    layer_activation_bytes: float   # one layer's activations for one micro-batch, per GPU
    boundary_bytes: float      # the activation sent between stages, whole (b * s * h * dtype)


@dataclass(frozen=True)
class Choice:
    t: int
    p: int
    d: int
    micro_batch: int
    micro_batches: int
    virtual: int
    step_s: float
    bubble: float              # fraction of the step the pipeline idles
    memory_bytes: float        # per GPU
    flops_per_gpu: float       # model FLOP/s per GPU (the paper's count)
    parts: dict


def step_time(cost: LayerCost, cluster: Cluster, *, layers: int, t: int, p: int, d: int, batch: int,
              micro_batch: int, virtual: int = 1, recompute: bool = True) -> tuple[float, float, dict]:
    """(step seconds, bubble fraction, the parts) of PTD-P on ``t`` x ``p`` x ``d`` GPUs."""
    m = batch // (d * micro_batch)
    factor = 4 / 3 if recompute else 1.0
    stage = layers / p * cost.layer_s * factor + cost.outside_s
    p2p = 0.0
    if p > 1:
        p2p = 2 * virtual * (cluster.node_link_latency + cost.boundary_bytes / t / cluster.node_link_bw)
    slots = m + (p - 1) / virtual
    pipe = slots * (stage + p2p)
    params = layers / p * cost.layer_params + cost.outside_params
    dp = 0.0
    if d > 1:
        dp = 2 * (d - 1) * cluster.node_link_latency + 2 * (d - 1) / d * params * 2 / cluster.node_link_bw
    opt = cluster.profile.update_time(params)
    step = pipe + dp + opt
    bubble = (p - 1) / virtual * (stage + p2p) / step
    return step, bubble, {"stage_s": stage, "p2p_s": p2p, "pipeline_s": pipe, "dp_s": dp, "optimizer_s": opt,
                          "micro_batches": m}


def memory(cost: LayerCost, cluster: Cluster, *, layers: int, p: int, micro_batch: int,
           recompute: bool = True, virtual: int = 1, micro_batches: int | None = None) -> float:
    """Bytes per GPU of the first stage (the fullest under 1F1B)."""
    params = layers / p * cost.layer_params + cost.outside_params
    state = params * cluster.profile.state_bytes_per_param
    in_flight = in_flight_layers(layers=layers, p=p, virtual=virtual, micro_batches=micro_batches)
    if recompute:   # each layer keeps its input; the one being recomputed holds all of its own
        acts = in_flight * cost.boundary_bytes + cost.layer_activation_bytes
    else:
        acts = in_flight * cost.layer_activation_bytes
    return state + acts


def in_flight_layers(*, layers: int, p: int, virtual: int = 1, micro_batches: int | None = None) -> float:
    """Layer-micro-batches whose activations the first GPU holds at its fullest. 1F1B: its
    ``layers / p`` layers for the ``p`` micro-batches in flight. Interleaved 1F1B (``v`` chunks of
    ``layers / (p v)`` layers per GPU, torch's ``ScheduleInterleaved1F1B``): a warm-up of
    ``(v - 1) p + 2 (p - 1)`` chunk forwards before the first backward, plus the one running --
    about ``1 + 1/v`` times 1F1B's, the paper's "comparable footprint"; never more than the
    ``m v`` chunks a step runs."""
    if virtual <= 1:
        chunks, per_chunk = (min(p, micro_batches) if micro_batches else p), layers / p
    else:
        chunks, per_chunk = (virtual - 1) * p + 2 * (p - 1) + 1, layers / (p * virtual)
        if micro_batches:
            chunks = min(chunks, micro_batches * virtual)
    return chunks * per_chunk


def model_flops(*, batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. (2021) eq. (3): FLOPs of a training step with recomputation."""
    h, s, l = hidden, seq, layers
    return 96 * batch * s * l * h * h * (1 + s / (6 * h) + vocab / (16 * l * h))


def choose(layer_cost: Callable[[int, int], LayerCost], cluster: Cluster, *, gpus: int, layers: int, batch: int,
           seq: int, hidden: int, vocab: int, tps=(1, 2, 4, 8), micro_batches=(1, 2, 4), virtual=(1,),
           recompute: bool = True) -> list[Choice]:
    """Every feasible (t, p, d, micro-batch, virtual stages) for ``gpus`` GPUs, fastest first.
    ``layer_cost(t, micro_batch)`` prices a micro-batch at tp ``t``. t stays inside a node; p
    divides the layers; d divides the batch in whole micro-batches; the state fits the memory."""
    flops = model_flops(batch=batch, seq=seq, layers=layers, hidden=hidden, vocab=vocab)
    out = []
    for t in tps:
        if t > cluster.gpus_per_node or gpus % t:
            continue
        for mb in micro_batches:
            cost = layer_cost(t, mb)
            for p in range(1, layers + 1):
                if layers % p or gpus % (t * p):
                    continue
                d = gpus // (t * p)
                if batch % (d * mb):
                    continue
                for v in virtual:
                    if v > 1 and (p == 1 or (layers // p) % v):
                        continue
                    mem = memory(cost, cluster, layers=layers, p=p, micro_batch=mb, recompute=recompute,
                                 virtual=v, micro_batches=batch // (d * mb))
                    if mem > cluster.profile.memory:
                        continue
                    step, bubble, parts = step_time(cost, cluster, layers=layers, t=t, p=p, d=d, batch=batch,
                                                    micro_batch=mb, virtual=v, recompute=recompute)
                    out.append(Choice(t, p, d, mb, parts["micro_batches"], v, step, bubble, mem,
                                      flops / step / gpus, parts))
    return sorted(out, key=lambda c: c.step_s)
