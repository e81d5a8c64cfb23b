"""The runtime: a rank's part of the model, run, on the groups of :mod:`autotp.distributed`.

Input: a capture, its plan and this rank's rewritten program (:mod:`autotp.passes.rewrite`), the
mesh, and the model or a checkpoint. Output: a module that is called (or stepped) like the model.

- :mod:`.module`      the parallel module: ParallelModule, its state, programs, inputs' checks, DTensor
  views, outlining and FSDP2
- :mod:`.checkpoint`  its weights read and written on every rank: HuggingFace folders, DCP, their safety
- :mod:`.pipeline`    pipeline stages over tensor-parallel programs (PipelineModule)

``autotp.runtime.dcp`` and ``autotp.runtime.fsdp`` are the paths the README shows for
:mod:`.checkpoint.dcp` and :mod:`.module.fsdp`.
"""
