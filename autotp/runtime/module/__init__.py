"""The parallel module: this rank's shards and its programs, called like the model.

Input: a capture, the plan it was written under and one rank's rewritten graph
(:func:`autotp.passes.rewrite.rewrite`), the TP mesh (:mod:`autotp.distributed.mesh`) and the
model (or a checkpoint's reader). Output: a :class:`ParallelModule` whose parameters are DTensors
under the model's own names and whose calls return what the model's do. It is built in one pass,
in stage order: the mesh's groups, the ranks' agreement on what they run, the state (parameter
shards and buffers), then the programs.

- :mod:`.module`       ParallelModule: the construction above, and each call (checks, program, outputs)
- :mod:`.state`        this rank's parameter shards and the buffers under the model's names; dtype kept
- :mod:`.dtensor`      autotp's parameter layouts as DTensor placements
- :mod:`.leaves`       a DTensor parameter fed to a program as its local tensor, its gradient handed back
- :mod:`.program`      one kind of call's capture, plan and graph, and which calls it serves
- :mod:`.inputs`       call-time checks of inputs' values (index bounds) and sizes; :mod:`.input_kinds` their kinds
- :mod:`.outline`      a program's repeated layers as calls of the modules holding their parameters
- :mod:`.fsdp`         data parallelism through FSDP2 (``fully_shard`` of a ParallelModule)
"""
from .module import ParallelModule

__all__ = ["ParallelModule"]
