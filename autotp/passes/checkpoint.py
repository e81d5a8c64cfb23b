"""Activation checkpointing of the rewritten graph, one transformer layer at a time.

Input: a rank's rewritten ``GraphModule`` (whose nodes keep ``nn_module_stack``) and its
:class:`~autotp.distributed.rng.RNGTracker`. Output: a ``GraphModule`` of consecutive partitions
(``torch.fx.passes.split_module``): one per repeated layer (a numbered child of a ModuleList,
``transformer.h.7``) and one for each stretch between them. Each layer partition runs under
``torch.utils.checkpoint``: its activations are dropped after forward and recomputed in
backward, so backward holds only the layers' inputs (Megatron's full recomputation).

Recomputation re-runs the layer's collectives (a g all-reduces again), as Megatron's does, and
must redraw the same dropout masks: the tracker's states are put back to what they were when
the layer first ran, then restored to their advanced values. It starts from the layer's inputs
as checkpoint kept them, so no g may have summed one of them in place: a g reduces in place
only a partial its own layer makes (:func:`autotp.passes.in_place.recomputed_layer_in_place`).
"""
from __future__ import annotations

import operator
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from ..capture.program import numbered_layer
from .in_place import recomputed_layer_in_place


def set_grad_enabled(mode: bool) -> None:
    """``torch._C._set_grad_enabled`` under another name, which ``split_module`` leaves alone.
    torch 2.11's ``split_module`` takes each ``_set_grad_enabled`` to open a region that lasts
    until the next one and sets its mode again at the start of every later partition; it
    asserts a constant argument, while an inlined grad-mode region restores the mode it found
    (``_set_grad_enabled(prev)``, ``prev`` a node: autotp.capture.higher_order). With that restoring
    call renamed alone, Llama's rotary ``no_grad`` region reached every later partition: the
    layers ran without autograd and the grad mode stayed off after the call (the loss had no
    gradient; a pipeline's next stage ran without one). Every grad-mode call is renamed: the
    partitions run in order on one thread, so the mode one sets reaches the next as it would
    unsplit; a layer that starts with grad off runs without checkpointing (nothing to
    recompute), and one that starts with it on is recomputed from that same mode."""
    torch._C._set_grad_enabled(mode)


def checkpoint_layers(gm: fx.GraphModule, rng: Any = None) -> fx.GraphModule:
    """See the module docstring. Communication nodes (no module stack of their own) join the
    layer of the op they feed, so a layer's f and g are recomputed with it. A g that the layer
    reads from outside it (the embedding's, pulled into the first layer) copies: reduced in
    place, it would write one of the inputs checkpoint recomputes from
    (:func:`autotp.passes.in_place.recomputed_layer_in_place`)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    owner: dict[fx.Node, str | None] = {}
    for node in reversed(gm.graph.nodes):   # consumers first: a comm node takes its user's layer
        if node.op in ("placeholder", "output"):
            continue
        layer = numbered_layer(node)
        if layer is None and node.op == "call_module":
            users = sorted(node.users, key=order.get)
            layer = owner.get(users[0]) if users else None
        owner[node] = layer
    partition: dict[fx.Node, int] = {}
    layers: dict[int, str] = {}
    current, key = -1, object()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if owner[node] != key:
            current, key = current + 1, owner[node]
            if key is not None:
                layers[current] = key
        partition[node] = current
    if not layers:
        return gm
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            node.target = set_grad_enabled   # a plain call to split_module (see there)
    split = split_module(gm, gm, lambda n: partition[n], keep_original_order=True)
    for index, layer in layers.items():
        name = f"submod_{index}"
        inner = getattr(split, name, None)
        if inner is not None:
            recomputed_layer_in_place(inner)
            setattr(split, name, CheckpointedLayer(inner, layer, rng))
    for node in split.graph.nodes:   # each layer's call keeps the layer's module path (runtime.module.outline)
        called = getattr(split, node.target, None) if node.op == "call_module" else None
        if isinstance(called, CheckpointedLayer):
            node.meta["nn_module_stack"] = {called.layer: (called.layer, CheckpointedLayer)}
    split.recompile()
    return split


class CheckpointedLayer(nn.Module):
    """One layer's partition under ``torch.utils.checkpoint`` (non-reentrant)."""

    def __init__(self, inner: nn.Module, layer: str, rng: Any = None):
        super().__init__()
        self.inner, self.layer, self.rng = inner, layer, rng

    def forward(self, *args: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        if not torch.is_grad_enabled():
            return self.inner(*args)
        return checkpoint(self.inner, *args, use_reentrant=False, context_fn=self._contexts)

    def _contexts(self):
        """(forward context, recompute context): the recompute sees the tracker as it was."""
        rng = self.rng
        if rng is None:
            return _nothing(), _nothing()
        at_forward = rng.snapshot()

        @contextmanager
        def recompute() -> Iterator[None]:
            advanced = rng.snapshot()
            rng.restore(at_forward)
            try:
                yield
            finally:
                rng.restore(advanced)

        return _nothing(), recompute()

    def extra_repr(self) -> str:
        return f"layer={self.layer}"


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def price_recomputation(index: Any) -> None:
    """Sets ``index`` (a :class:`~autotp.passes.propagate.GraphIndex`) to price what
    :func:`checkpoint_layers` does to a training program, so that the plan's memory and time are
    those of the run that checkpoints (``activation_checkpointing=True``):

    - backward holds each repeated layer's activations one layer at a time (it recomputes the
      layer, then runs its backward): an op of a layer adds 1/L of what it keeps, L the layers,
      so that the layers together add one layer's (exact where the layers are alike; where they
      differ, as an encoder's and a decoder's, their mean stands for the largest);
    - what checkpoint keeps instead, every tensor a layer reads that it did not make (the
      previous layer's output, rotary's cos and sin, the mask): whole, once, at the op that
      makes it, at that op's placement;
    - each op of a layer runs its forward twice (the recomputation: the op priced with no
      input carrying a gradient).

    - the collectives of a layer run again in the recomputation, forward only (a g's all-reduce,
      an all-gather; an f's forward is nothing): those of an op of a layer (a vocab-parallel
      loss's, an expert dispatch's all-to-all) and the conversions of a tensor whose first reader
      is an op of a layer, whose communication nodes :func:`checkpoint_layers` puts in that
      layer (``GraphIndex.converted_again``; a conversion one consumer outside the layers shares
      with it is counted by the first reader alone).

    Not priced: the recomputed layer's input counted with the layer's share as well as among the
    kept inputs (one layer input over the whole program). A program without gradients
    (inference, a generation step) runs its layers unchecked: nothing is set."""
    from ..cost_model.saved import kept_root

    if not index.grads:
        return
    owner = {node: numbered_layer(node) for node in index.infos}
    layers = {layer for layer in owner.values() if layer is not None}
    if not layers:
        return
    share = 1.0 / len(layers)
    index.recomputed = {node: share for node, layer in owner.items() if layer is not None}
    kept: set = set()
    for node, layer in owner.items():
        if layer is None:
            continue
        for inp in index.tensor_inputs.get(node, ()):
            root = kept_root(inp)
            maker = root.args[0] if root.target is operator.getitem else root
            if root.op == "call_function" and maker in index.infos and owner.get(maker) != layer:
                kept.add(root)
    index.layer_inputs = frozenset(kept)
    order = {node: i for i, node in enumerate(index.capture.graph.nodes)}
    again = set()
    for node in order:
        readers = [user for user in node.users if user in owner]
        if readers and owner[min(readers, key=order.get)] is not None:
            again.add(node)
    index.converted_again = frozenset(again)
