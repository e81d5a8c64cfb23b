"""Per-op sharding rules: one registry keyed by ATen op overload (:mod:`.registry`, where the
contract is), filled by the family files (``matrix``, ``view``, ``pointwise``, ``nn``,
``misc``, then ``experts``, which extends the index and transpose rules), which import the registry
and one another downward only; importing this package registers them all."""
from . import matrix, misc, nn, pointwise, view  # noqa: F401  (the families register themselves on import)
from . import experts  # noqa: F401,E402  (after misc and view: it extends their index and transpose rules)
from .registry import (LocalContext, Localizer, OpInfo, OutputPlacement, Rule, Strategy, TensorMeta, aliases_first, aten,
                       functional_of, has_outer, has_rule, has_tail, is_partial, is_replicate, is_routed, is_shard, localizer,
                       localizer_for,
                       log, mutates_first, norm_dim, op_name, register, register_localizer, registered_ops,
                       replicate_all, replicated_output, strategies, tail_sound, _LOCALIZERS, _OUTER_OPS, _RULES,
                       _in_place, _outputs, _warned)
