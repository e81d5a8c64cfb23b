"""Capture: an unmodified model -> an ATen fx graph with dynamic batch and sequence dims.

See :mod:`autotp.capture.export` for the steps; the names the later stages use are here.
"""
from .export import (DEFAULT_SEQ_RANGE, EXAMPLE_BATCH, EXAMPLE_SEQ, Capture, bind_inputs, capture, config_int,
                     example_like, flat_inputs, forward_signature, gc_paused, hf_example_kwargs, module_path,
                     on_meta, seq_bounds, shape_of, shape_twin, to_sympy, unflatten_outputs)

__all__ = [
    "Capture", "capture", "bind_inputs", "config_int", "example_like", "flat_inputs", "forward_signature",
    "gc_paused", "hf_example_kwargs", "module_path", "on_meta", "seq_bounds", "shape_of", "shape_twin",
    "to_sympy", "unflatten_outputs", "DEFAULT_SEQ_RANGE", "EXAMPLE_BATCH", "EXAMPLE_SEQ",
]
