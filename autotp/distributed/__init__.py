"""The process-group layer, and what a rank program calls on it: beneath the passes and the runtime.

The rewrite (:mod:`autotp.passes.rewrite`) writes graphs that call the mappings, functions and
random streams here; the runtime (:mod:`autotp.runtime`) builds its modules on the groups and
agreement here. So this package knows no plan, no graph pass and no module: its inputs are
process groups, tensors and plain values, and it imports only :mod:`autotp.errors`,
:mod:`autotp.placements`, :mod:`autotp.version` and :mod:`autotp.capture` (a graph's op names,
for agreement).

From the group up:

- :mod:`.timeouts`     how long a collective may take; a group's own timeout
- :mod:`.faults`       which rank is lost: a roll call through the store after a collective fails; step guards
- :mod:`.mesh`         DP x TP (x PP) process groups from torchrun's environment; their DeviceMesh
- :mod:`.launch`       local ranks without torchrun (``launch``, ``LocalCluster``): tests, calibration, ``autotp check``
- :mod:`.comm`         a group's size and ranks; a failed collective named; the all-reduce of f and g
- :mod:`.shards`       sharded layouts without communication: a rank's part, its slice, the whole assembled
- :mod:`.gather_scatter` the backends' all-gather and reduce-scatter of a sharded tensor (no autograd)
- :mod:`.exchange`     the all-to-all reshard: one split -> another (no autograd)
- :mod:`.collectives`  Megatron's f and g (all-reduce, all-gather, reduce-scatter, all-to-all) as autograd Functions
- :mod:`.comm_modules` the mappings as ``nn.Module``s, which the rewritten fx graphs call
- :mod:`.functional`   the sharded forms of ops that need more than their ATen op (vocab-parallel
  embedding and cross-entropy, a tail's exact add, a mean's share)
- :mod:`.experts`      what a rank runs of an expert layer: its own experts' routed rows
- :mod:`.rng`          dropout's random numbers: the same masks where replicated, own ones where split
- :mod:`.agreement`    ranks agree on what they run (plan, program, inputs, state) before they talk

Every collective runs inside :func:`.comm._comm`: a failure becomes a ``CommError``, a
lost peer a ``LostRankError`` naming it, never a hang past the group's timeout.
"""
