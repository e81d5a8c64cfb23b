"""Graph passes: per-op sharding rules, propagation/planning, and the per-rank rewrite."""
