"""Tensor x pipeline x data parallelism (Megatron's PTD-P) priced from autotp's own plans.

A step of a GPT-like model with ``layers`` identical layers on ``t`` x ``p`` x ``d`` GPUs:

- **one micro-batch on one stage**: its layers, each priced by autotp's tensor-parallel plan at
  ``t`` for the micro-batch (forward and backward, its collectives included; the optimizer's
  share the plan carries is taken out and priced once per step below), the first stage also
  running what lies before the layers (the embedding) and the last what follows them (head and
  loss). The layers are cut as autotp's runtime cuts them (:func:`balance`: the head's stage
  gets fewer where that makes the slowest faster) or evenly (``balanced=False``, Megatron-LM's
  cut); the slowest GPU sets the pace (:func:`stage_layers`). With full activation recomputation (``recompute=True``, what the PTD-P
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
from typing import Any, Callable

from ..capture import layer_of
from ..errors import ConfigError
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
    #: the part of ``outside_s`` before the layers (the embedding: the first stage's), the rest
    #: after them (head and loss: the last stage's); None: not known, all of it on one stage
    first_s: float | None = None
    #: forward FLOPs of one micro-batch (the whole model's, not a GPU's share): one layer's and
    #: what lies outside the layers (the head), counted off the captured graph's products and
    #: attention; None: not counted
    layer_flops: float | None = None
    outside_flops: float | None = None

    def ends(self) -> tuple[float, float] | None:
        """(seconds on the first stage, on the last) outside the layers, or None if not known."""
        if self.first_s is None:
            return None
        first = min(max(self.first_s, 0.0), self.outside_s)
        return first, self.outside_s - first


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


def layer_costs(index: Any, prop: Any, profile: Any, layers: list[str]) -> tuple[list[float], float, float]:
    """Seconds of each of ``layers`` (module paths; forward and backward, collectives included)
    by a plan's cost model (``index``, ``prop``: the plan's graph index and propagation), and of
    what lies before the first layer and after the last. A collective counts in its consumer's
    layer, but for one that moves a tensor made before the layers into one layer alone: that is
    the layers' entry, run once (GPT-2's embeddings read by columns, resharded into the sequence
    split at the first layer's norm; a vocabulary-parallel lookup's sum taken there), counted
    before them with the embedding that chose its layout, as :func:`autotp.ptd.layer_cost`'s
    difference of plans counts it outside the layers. A tensor moved into several layers (a
    mask, each layer's own collective) keeps each in its layer."""
    graph = index.capture.graph
    per_layer = dict.fromkeys(layers, 0.0)
    before = after = 0.0
    seen_layer: set = set()     # nodes downstream of a layer's op (fx nodes)
    where: dict[str, str | None] = {}
    after_layers: set[str] = set()       # names of the nodes outside the layers that follow them
    before_layers: set[str] = set()      # names of the nodes outside the layers that precede them
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        layer = layer_of(node, layers)
        where[node.name] = layer
        downstream = layer is not None or any(x in seen_layer for x in node.all_input_nodes)
        if downstream:
            seen_layer.add(node)
            if layer is None:
                after_layers.add(node.name)
        strat = prop.chosen.get(node)
        seconds = index.compute_time(node, strat, profile) if strat is not None and node in index.infos else 0.0
        if layer is not None:
            per_layer[layer] += seconds
        elif downstream:
            after += seconds
        else:
            before_layers.add(node.name)
            before += seconds
    entering: dict[str, set] = {}    # a tensor made before the layers: the layers its collectives feed
    for comm in prop.comms:
        if comm.tensor in before_layers and where.get(comm.consumer) is not None:
            entering.setdefault(comm.tensor, set()).add(where[comm.consumer])
    for comm in prop.comms:
        layer = where.get(comm.consumer)
        if layer is not None and len(entering.get(comm.tensor, ())) == 1:   # the layers' entry
            before += comm.seconds
        elif layer is not None:
            per_layer[layer] += comm.seconds
        elif comm.consumer in after_layers:
            after += comm.seconds
        else:     # before the first layer (the embedding's)
            before += comm.seconds
    return [per_layer[layer] for layer in layers], before, after


def cut_layers(costs: tuple[list[float], float, float], layers: list[str], pp: int, virtual: int,
               asked: Any = None) -> list[list[str]]:
    """The repeated ``layers`` dealt to ``pp * virtual`` chunks, in order (chunk ``c`` runs on
    stage ``c mod pp``): ``asked`` (``stage_layers``: a count per chunk, checked), else as
    :func:`balance` finds them by ``costs`` (:func:`layer_costs`)."""
    chunks = pp * virtual
    sizes = balance(*_priced(costs, layers), chunks, pp) if asked is None else _asked(asked, len(layers), pp, virtual)
    return [layers[sum(sizes[:c]):sum(sizes[:c + 1])] for c in range(chunks)]


def _asked(sizes: Any, layers: int, pp: int, virtual: int) -> list[int]:
    """``stage_layers``: the layers of each chunk as the user asks, checked."""
    chunks = pp * virtual
    sizes = list(sizes)
    if len(sizes) != chunks or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ConfigError(f"stage_layers={sizes} must give a positive number of layers to each of the {chunks} chunks "
                          f"(pp={pp} x virtual={virtual}), in order")
    if sum(sizes) != layers:
        even = f"; {layers // chunks} each" if layers % chunks == 0 else \
            f" ({layers} does not divide into {chunks} equal chunks: give some chunks one layer more)"
        raise ConfigError(f"stage_layers={sizes} adds up to {sum(sizes)} layers but the model has {layers} repeated "
                          f"layers to cut into {chunks} chunks{even}; or leave stage_layers out and the cost model "
                          "balances them")
    return sizes


def _priced(costs: tuple[list[float], float, float], layers: list[str]) -> tuple[list[float], float, float]:
    per_layer, before, after = costs
    if len(per_layer) != len(layers):
        raise ConfigError(f"the model has {len(layers)} repeated layers but its plan priced {len(per_layer)}")
    return per_layer, before, after


def _check_chunks(n: int, chunks: int) -> None:
    if chunks > n:
        raise ConfigError(f"{n} repeated layers cannot be cut into {chunks} pipeline chunks (pp x virtual stages): "
                          f"each chunk needs a layer; choose pp x virtual <= {n}")


def balance(costs: list[float], first: float, last: float, chunks: int, gpus: int | None = None) -> list[int]:
    """How many of the layers (``costs``: seconds each, in order) each of ``chunks`` contiguous
    chunks runs: every chunk at least one, the first also paying ``first``, the last ``last``;
    the slowest chunk as fast as possible, ties broken toward equal chunks (exact, by dynamic
    programming over the cut points). ``gpus``: chunk ``c`` runs on GPU ``c mod gpus`` (virtual
    stages), and the slowest GPU's chunks together set the pace: see :func:`_for_gpus`."""
    n = len(costs)
    _check_chunks(n, chunks)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    sizes = _slowest_chunk_first(prefix, first, last, chunks)
    return _for_gpus(sizes, prefix, first, last, gpus or chunks)


def _slowest_chunk_first(prefix: list[float], first: float, last: float, chunks: int) -> list[int]:
    n = len(prefix) - 1

    def span(i: int, j: int, k: int) -> float:     # layers i..j-1 as chunk k
        return prefix[j] - prefix[i] + (first if k == 0 else 0.0) + (last if k == chunks - 1 else 0.0)

    # best[k][j]: (slowest, sum of squared sizes) for layers 0..j-1 in chunks 0..k, and the cut
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(chunks)]
    cut = [[0] * (n + 1) for _ in range(chunks)]
    for j in range(1, n + 1):
        best[0][j] = (span(0, j, 0), j * j)
    for k in range(1, chunks):
        for j in range(k + 1, n + 1):
            for i in range(k, j):
                prev = best[k - 1][i]
                cand = (max(prev[0], span(i, j, k)), prev[1] + (j - i) ** 2)
                if _better(cand, best[k][j]):
                    best[k][j], cut[k][j] = cand, i
    sizes, j = [], n
    for k in range(chunks - 1, 0, -1):
        i = cut[k][j]
        sizes.append(j - i)
        j = i
    sizes.append(j)
    return sizes[::-1]


def _even_cut(n: int, chunks: int) -> list[int]:
    """Megatron-LM's cut: ``n / chunks`` layers each, the first ``n mod chunks`` one more."""
    return [n // chunks + (1 if c < n % chunks else 0) for c in range(chunks)]


def _better(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Lexicographic, the times compared up to rounding (the last entry, a size spread, exactly)."""
    for x, y in zip(a[:-1], b[:-1]):
        if abs(x - y) > 1e-9 * max(abs(x), abs(y), 1e-30):
            return x < y
    return a[-1] < b[-1]


def _for_gpus(sizes: list[int], prefix: list[float], first: float, last: float, gpus: int) -> list[int]:
    """With several chunks per GPU (``len(sizes) > gpus``) a GPU runs all of its chunks, so its
    total, not its slowest chunk, sets the pace: the slowest-chunk cut can load one GPU with
    the leftover layers of two (8 layers, 4 chunks on 2 GPUs, a costly embedding: 1+3 | 2+2
    puts 5 layers on the head's GPU against 4 for an even cut). From three starts (the
    slowest-chunk cut, the even one, and :func:`_uniform_balance`'s, exact for layers of equal
    cost), the best of the cuts one or two cut points a layer away is taken while it makes
    (slowest GPU, slowest chunk, size spread) smaller; the best end wins. Never slower than any
    start, so for equal layers as fast as the cost model's cut; with unequal ones a local
    search, not an exhaustive one."""
    chunks, n = len(sizes), len(prefix) - 1
    if gpus >= chunks:
        return sizes

    def score(s: list[int]) -> tuple[float, float, float]:
        gpu, slowest, start = [0.0] * gpus, 0.0, 0
        for c, k in enumerate(s):
            t = prefix[start + k] - prefix[start] + (first if c == 0 else 0.0) + (last if c == chunks - 1 else 0.0)
            gpu[c % gpus] += t
            slowest = max(slowest, t)
            start += k
        return max(gpu), slowest, float(sum(k * k for k in s))

    def neighbours(s: list[int]):   # one cut point moved a layer either way, or two cut points
        steps = [(c, d) for c in range(chunks - 1) for d in (1, -1)]
        for a, (c, d) in enumerate(steps):
            t = list(s)
            t[c], t[c + 1] = t[c] + d, t[c + 1] - d
            if min(t[c], t[c + 1]) < 1:
                continue
            yield t
            for c2, d2 in steps[a + 2 - a % 2:]:     # a later cut point
                u = list(t)
                u[c2], u[c2 + 1] = u[c2] + d2, u[c2 + 1] - d2
                if min(u[c2], u[c2 + 1]) >= 1:
                    yield u

    def descend(s: list[int]) -> tuple[list[int], tuple]:
        best = score(s)
        while True:
            step = None
            for t in neighbours(s):
                cand = score(t)
                if _better(cand, best if step is None else step[0]):
                    step = (cand, t)
            if step is None:
                return s, best
            best, s = step

    even = _even_cut(n, chunks)
    dealt = _uniform_balance(n, prefix[-1] / n, first, last, chunks, gpus)   # exact were the layers alike
    best, best_score = None, None
    for start in (sizes, even, dealt):
        s, score_s = descend(start)
        if best is None or _better(score_s, best_score):
            best, best_score = s, score_s
    return best


def _uniform_balance(n: int, per: float, first: float, last: float, chunks: int, gpus: int | None = None) -> list[int]:
    """:func:`balance` of ``n`` layers of ``per`` seconds each, in O(n log n) instead of its
    O(chunks n^2) (a search over (t, p, v, micro-batch) cuts hundreds of times): the smallest
    slowest chunk over the candidate times ``a * per + extra``, then the layers dealt as evenly as
    each chunk's room allows. The slowest chunk is balance's; which chunk takes a leftover layer
    may differ from its tie-breaking. With ``gpus`` fewer than ``chunks`` (chunk ``c`` on GPU
    ``c mod gpus``) the same first deals the layers to the GPUs (each at least one per chunk it
    runs, GPU 0 paying ``first`` and the last chunk's GPU ``last``), which makes the slowest GPU
    as fast as it can be, then each GPU's layers to its chunks, the fewest to a chunk that pays
    an extra."""
    _check_chunks(n, chunks)
    gpus = min(gpus or chunks, chunks)
    if per <= 0:
        return [n - chunks + 1] + [1] * (chunks - 1)
    if gpus == chunks:
        extras = [0.0] * chunks
        extras[0] += first
        extras[-1] += last
        return _deal(n, per, extras, [1] * chunks)
    extras = [0.0] * gpus
    extras[0] += first
    extras[(chunks - 1) % gpus] += last
    held = _deal(n, per, extras, [len(range(g, chunks, gpus)) for g in range(gpus)])
    sizes = [0] * chunks
    for g in range(gpus):
        mine = list(range(g, chunks, gpus))
        chunk_extra = [(first if c == 0 else 0.0) + (last if c == chunks - 1 else 0.0) for c in mine]
        for c, k in zip(mine, _deal(held[g], per, chunk_extra, [1] * len(mine))):
            sizes[c] = k
    return sizes


def _deal(n: int, per: float, extras: list[float], least: list[int]) -> list[int]:
    """``n`` layers of ``per`` seconds to slots that each pay ``extras[k]`` and take at least
    ``least[k]``: the smallest slowest slot over the candidate times ``a * per + extra``, then
    the layers dealt as evenly as each slot's room allows, a leftover to slots without extra first."""
    slots = len(extras)

    def room(limit: float) -> list[int]:   # layers each slot can take within limit
        return [int((limit - e) / per + 1e-9) for e in extras]

    def fits(limit: float) -> bool:
        return all(r >= m for r, m in zip(room(limit), least)) and sum(room(limit)) >= n

    candidates = sorted({a * per + e for e in set(extras) for a in range(1, n + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    caps = room(candidates[lo])
    # as even as the caps allow: the largest level L with every slot at min(cap, L) not over n
    level = max(least)
    while sum(max(m, min(c, level + 1)) for c, m in zip(caps, least)) <= n and level < n:
        level += 1
    sizes = [max(m, min(c, level)) for c, m in zip(caps, least)]
    for k in sorted(range(slots), key=lambda k: extras[k]):   # one leftover layer a slot at most
        if sum(sizes) < n and sizes[k] < caps[k]:
            sizes[k] += 1
    return sizes


def stage_layers(cost: LayerCost, *, layers: int, p: int, virtual: int = 1, recompute: bool = True,
                 balanced: bool = True) -> tuple[list[int], float]:
    """(layers each GPU runs, the slowest GPU's seconds per micro-batch) with the layers cut into
    ``p * virtual`` chunks, chunk ``c`` on GPU ``c mod p``, the first chunk also running what lies
    before the layers and the last what follows them. ``balanced``: cut as autotp's pipeline
    runtime does (:func:`balance`'s slowest chunk, as fast as possible, so the head's GPU gets
    fewer layers); else evenly (``layers / (p v)`` each, as Megatron-LM does).
    Without a known split of ``outside_s`` all of it lands on the slowest GPU."""
    per = cost.layer_s * (4 / 3 if recompute else 1.0)
    chunks = p * virtual
    ends = cost.ends()
    if p == 1 or ends is None:
        return [layers // p] * p, layers / p * per + cost.outside_s
    first, last = ends
    if balanced:
        sizes = _uniform_balance(layers, per, first, last, chunks, p)
    else:
        sizes = _even_cut(layers, chunks)
    held = [sum(sizes[c] for c in range(g, chunks, p)) for g in range(p)]
    work = [n * per for n in held]
    work[0] += first
    work[(chunks - 1) % p] += last
    return held, max(work)


def step_time(cost: LayerCost, cluster: Cluster, *, layers: int, t: int, p: int, d: int, batch: int,
              micro_batch: int, virtual: int = 1, recompute: bool = True,
              balanced: bool = True) -> tuple[float, float, dict]:
    """(step seconds, bubble fraction, the parts) of PTD-P on ``t`` x ``p`` x ``d`` GPUs; the
    slowest GPU's work sets the pace (:func:`stage_layers`)."""
    m = batch // (d * micro_batch)
    held, stage = stage_layers(cost, layers=layers, p=p, virtual=virtual, recompute=recompute, balanced=balanced)
    p2p = 0.0
    if p > 1:
        p2p = 2 * virtual * (cluster.node_link_latency + cost.boundary_bytes / t / cluster.node_link_bw)
    slots = m + (p - 1) / virtual
    pipe = slots * (stage + p2p)
    params = max(held) * cost.layer_params + cost.outside_params
    dp = 0.0
    if d > 1:
        dp = 2 * (d - 1) * cluster.node_link_latency + 2 * (d - 1) / d * params * 2 / cluster.node_link_bw
    opt = cluster.profile.update_time(params)
    step = pipe + dp + opt
    bubble = (p - 1) / virtual * (stage + p2p) / step
    return step, bubble, {"stage_s": stage, "p2p_s": p2p, "pipeline_s": pipe, "dp_s": dp, "optimizer_s": opt,
                          "micro_batches": m, "layers_per_gpu": held}


def memory(cost: LayerCost, cluster: Cluster, *, layers: int, p: int, micro_batch: int,
           recompute: bool = True, virtual: int = 1, micro_batches: int | None = None,
           balanced: bool = True) -> float:
    """Bytes per GPU of the fullest: the first stage's in-flight activations (the fullest under
    1F1B) on the most layers any GPU holds (:func:`stage_layers`)."""
    held = max(stage_layers(cost, layers=layers, p=p, virtual=virtual, recompute=recompute, balanced=balanced)[0])
    params = held * cost.layer_params + cost.outside_params
    state = params * cluster.profile.state_bytes_per_param
    in_flight = in_flight_layers(layers=held * p, p=p, virtual=virtual, micro_batches=micro_batches)
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
    """Narayanan et al. (2021) eq. (3): FLOPs of a training step with recomputation, for a
    GPT (4h MLP, full multi-head attention, tied head)."""
    h, s, l = hidden, seq, layers
    return 96 * batch * s * l * h * h * (1 + s / (6 * h) + vocab / (16 * l * h))


def counted_flops(cost: LayerCost, *, batch: int, micro_batch: int, layers: int, recompute: bool = True) -> float:
    """The same count from the model's own graph (``cost.layer_flops``, ``cost.outside_flops``:
    forward FLOPs of a micro-batch): each layer's forward three times (forward, and backward's
    two products), four with recomputation, and the head's three times, over ``batch /
    micro_batch`` micro-batches. For a GPT it is eq. (3); for SwiGLU MLPs, grouped-query
    attention or an untied head it counts what the model computes (Llama-3-8B 1.07 times eq.
    (3) at its hidden size and vocabulary, Qwen2-7B 1.43 times)."""
    if cost.layer_flops is None or cost.outside_flops is None:
        raise ValueError("this LayerCost has no FLOP count")
    per_layer = (4 if recompute else 3) * cost.layer_flops
    return batch / micro_batch * (layers * per_layer + 3 * cost.outside_flops)


def choose(layer_cost: Callable[[int, int], LayerCost], cluster: Cluster, *, gpus: int, layers: int, batch: int,
           seq: int, hidden: int, vocab: int, tps=(1, 2, 4, 8), micro_batches=(1, 2, 4), virtual=(1,),
           recompute: bool = True, balanced: bool = True, flops: float | None = None) -> list[Choice]:
    """Every feasible (t, p, d, micro-batch, virtual stages) for ``gpus`` GPUs, fastest first.
    ``layer_cost(t, micro_batch)`` prices a micro-batch at tp ``t``. t stays inside a node; p
    divides the layers; d divides the batch in whole micro-batches; the state fits the memory.
    ``flops``: a step's model FLOPs (:func:`counted_flops`) for the FLOP/s per GPU; default
    the paper's eq. (3) (:func:`model_flops`)."""
    if flops is None:
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
                                 virtual=v, micro_batches=batch // (d * mb), balanced=balanced)
                    if mem > cluster.profile.memory:
                        continue
                    step, bubble, parts = step_time(cost, cluster, layers=layers, t=t, p=p, d=d, batch=batch,
                                                    micro_batch=mb, virtual=v, recompute=recompute,
                                                    balanced=balanced)
                    out.append(Choice(t, p, d, mb, parts["micro_batches"], v, step, bubble, mem,
                                      flops / step / gpus, parts))
    return sorted(out, key=lambda c: c.step_s)
