"""Capture: an unmodified model -> one ATen fx graph with dynamic batch and sequence dims.

Input: an ``nn.Module`` (real or meta device; its weights are never read) and, optionally,
example inputs (else synthesized from a HuggingFace config). Output: a :class:`Capture`, the
model's ``torch.export`` program for one call signature: parameters, buffers and constants lifted
to named placeholders, the user inputs in call order, batch and sequence dims symbolic over the
range the model allows, higher-order regions inlined, biases split from their products.
Invariants: the graph is the one a whole export gives, node for node, however it was obtained
(cut and expanded, or from the cache); it depends on the model's structure and the call's
signature only, never on weight values or on the process's string-hash seed (its ops in an
order of the graph's own: ``canonical``); later stages read it and never mutate it.

The steps, each a module, in the order they import one another (each imports only those above it):

- ``program``: the :class:`Capture` type and its readers (module paths, symbolic shapes, a call's inputs and outputs)
- ``inputs``: example inputs, dynamic dims and sequence bounds
- ``masks``: a call without a mask traced as transformers runs it eagerly
- ``draws``: 0-d random draws (LayerDrop) answered under capture
- ``higher_order``: no_grad/autocast regions inlined as plain ops
- ``canonical``: export's op order made a function of the graph alone (the same under any string-hash seed)
- ``normalize``: the exported program -> a normalized Capture
- ``twin``: the weightless shape twin a rank keeps for later captures
- ``structure``: a module's structure as text (the cache's key, the blocks' comparison)
- ``expand``: cut a stack of alike blocks to three (later one; or a head and two periods), then grow the graph
- ``export``: :func:`capture`, torch.export with dynamic dims, narrowed where the model allows less
- ``cache``: one capture per structure, reused by models that differ only in their weights
"""
from .export import capture, gc_paused
from .inputs import (DEFAULT_SEQ_RANGE, EXAMPLE_BATCH, EXAMPLE_SEQ, bind_inputs, config_int, example_like,
                     forward_signature, hf_example_kwargs, lengths_of, seq_bounds)
from .program import Capture, fits_call, flat_inputs, guards_hold, layer_of, module_path, shape_of, to_sympy, unflatten_outputs
from .twin import on_meta, shape_twin

__all__ = [
    "Capture", "capture", "bind_inputs", "config_int", "example_like", "fits_call", "flat_inputs",
    "forward_signature", "guards_hold", "lengths_of",
    "gc_paused", "hf_example_kwargs", "layer_of", "module_path", "on_meta", "seq_bounds", "shape_of", "shape_twin",
    "to_sympy", "unflatten_outputs", "DEFAULT_SEQ_RANGE", "EXAMPLE_BATCH", "EXAMPLE_SEQ",
]
