"""What autotp's own tests use, for users to test their models the same way.

* :func:`launch` / :class:`LocalCluster`: local ranks (gloo on CPU) without torchrun.
* :func:`equivalence_errors` / :func:`assert_equivalent`: run the serial model and its parallel
  counterpart on the same inputs, forward and backward, and compare loss, logits and every
  parameter's gradient (this rank's shard against the same slice of the serial gradient).
* :func:`gpt2_cases`: hypothesis strategy of small GPT-2 configurations with a tp and a layout.
* :func:`keep_loss_precision`: HuggingFace's causal-LM loss casts logits to float32 even in a
  float64 model; this gives the model a loss in the logits' own dtype, so that a float64 check
  measures the rewrite and not float32 rounding of the loss.

Modules: ``equivalence`` (the serial-against-parallel measure and its tolerances), ``strategies``
(hypothesis cases, pinned layouts), ``work`` (:class:`~autotp.testing.work.WorkCounter`: FLOPs of
products and bytes written, per op). The local ranks (the fork server, LocalCluster, launch) are
:mod:`autotp.distributed.launch`, re-exported here; calibration starts them too.
"""
from .equivalence import (TOLERANCE, assert_equivalent, computed_precision, equivalence_errors, keep_loss_precision,
                          relative_error, tolerance)
from ..distributed.launch import LocalCluster, launch, preload
from .strategies import MEGATRON_GPT2, gpt2_cases

__all__ = ["launch", "LocalCluster", "preload", "relative_error", "equivalence_errors", "assert_equivalent",
           "gpt2_cases", "keep_loss_precision", "MEGATRON_GPT2", "TOLERANCE",
           "tolerance", "computed_precision"]
