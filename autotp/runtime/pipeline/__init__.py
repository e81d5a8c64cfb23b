"""Pipeline parallelism (the p of Megatron's PTD-P) over tensor-parallel stages.

Input: the whole model's capture, plan and one rank's rewritten program (as for a
:class:`~autotp.runtime.module.ParallelModule`), a DP x PP x TP mesh, and the plan's per-layer
costs. Output: this rank's stage, a :class:`PipelineModule` whose ``step(**batch)`` runs one
training step's micro-batches under torch.distributed.pipelining's schedules. Its parameters and
buffers are held as a ParallelModule holds them (:mod:`autotp.runtime.module.state`).

- :mod:`.stage`   PipelineModule: where to cut (cost-balanced chunks of the repeated layers), the
  loss's token count, the schedule, the gradients shared between stages and over dp
- :mod:`.chunks`  a rank program cut into chunks: what each computes, receives and sends on
"""
from .stage import SCHEDULES, PipelineModule, balance, check_pipeline, cut, layer_costs, token_counter

__all__ = ["PipelineModule", "balance", "cut", "layer_costs", "check_pipeline", "token_counter", "SCHEDULES"]
