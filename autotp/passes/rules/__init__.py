"""Per-op sharding rules: one registry keyed by ATen op overload (:mod:`.registry`; what a
rule sees and answers is :mod:`.contract`), filled by the family files (``matrix``, the
view-like ops' ``view``, ``pieces`` and ``joins`` over :mod:`.view_map`, ``pointwise``, ``nn``,
``misc``, then the experts' files: ``experts``, which extends the index rule, ``token_rows``,
which extends the views', ``routed`` and ``routed_localizer``, the registry's hooks for routed
rows), which import the registry and one another downward only; importing this package
registers them all."""
# the families register themselves on import
from . import joins, matrix, misc, nn, pieces, pointwise, view  # noqa: F401
# after misc and view: they extend their index and view rules
from . import experts, routed, routed_localizer, token_rows  # noqa: F401,E402
from .contract import LocalContext, OpInfo, OutputPlacement, Strategy, TensorMeta
from .registry import (Localizer, Rule, aliases_first, aten, functional_of, has_outer, has_rule, has_tail, is_partial,
                       is_replicate, is_routed, is_shard, localizer, localizer_for, log, mutates_first, norm_dim,
                       op_name, register, register_localizer, registered_ops, replicate_all, replicated_output,
                       strategies, tail_sound, _LOCALIZERS, _OUTER_OPS, _RULES, _in_place, _outputs, _warned)
