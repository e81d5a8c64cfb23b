"""Graph passes: per-op sharding rules, the graph index and propagation, the exact solve, and the per-rank rewrite."""
