"""Hypothesis strategies for property tests against the serial model, and the layouts they pin."""
from __future__ import annotations

#: GPT-2's layout in the Megatron-LM paper, as autotp roles (for pinning in tests).
MEGATRON_GPT2 = {"*.c_attn.weight": "column", "*.mlp.c_fc.weight": "column",
                 "*.attn.c_proj.weight": "row", "*.mlp.c_proj.weight": "row"}


def gpt2_cases(tps: tuple[int, ...] = (1, 2, 4), max_layers: int = 3):
    """Hypothesis strategy: dicts describing a small GPT-2, a tp dividing its heads, a layout
    (Megatron's, one drawn per template, or None to let the planner choose), inputs and dtype."""
    from hypothesis import strategies as st

    roles = st.sampled_from(["replicate", "column", "row"])
    emb_roles = st.sampled_from(["replicate", "vocab", "column"])

    @st.composite
    def case(draw):
        tp = draw(st.sampled_from(tps))
        heads = tp * draw(st.integers(1, 3))
        head_dim = draw(st.sampled_from([2, 4, 8]))
        n_positions = 16
        kind = draw(st.sampled_from(["megatron", "drawn", "planner"]))
        layout = None
        if kind == "megatron":
            layout = dict(MEGATRON_GPT2)
        elif kind == "drawn":
            layout = {t: draw(roles) for t in ("*.c_attn.weight", "*.attn.c_proj.weight", "*.mlp.c_fc.weight",
                                                "*.mlp.c_proj.weight")}
            layout["lm_head.weight"] = draw(emb_roles)
            layout["transformer.wpe.weight"] = draw(emb_roles)
        return {
            "tp": tp,
            "config": dict(n_layer=draw(st.integers(1, max_layers)), n_head=heads, n_embd=heads * head_dim,
                           vocab_size=tp * draw(st.integers(3, 24)), n_positions=n_positions,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
            "batch": draw(st.integers(1, 3)),
            "seq": draw(st.integers(2, n_positions).filter(lambda s: s != 8)),  # 8 is the traced length
            "dtype": draw(st.sampled_from(["float64", "float32"])),
            "layout": layout,
            "seed": draw(st.integers(0, 2**16)),
        }

    return case()


def placements():
    """Hypothesis strategy: every kind of placement (autotp/placements.py) with its fields
    drawn among the combinations it accepts: ``Replicate``, ``Partial``, ``ReplicatePartialGrad``,
    ``Shard`` (plain, with a tail dealt per block or not, blocks of unequal sizes, some held whole)
    and ``Routed`` (rows routed, sent or held by their tokens' ranks, and the marks of each)."""
    from hypothesis import strategies as st

    from ..placements import PARTIAL, REPLICATE, REPLICATE_PARTIAL_GRAD, Routed, Shard

    @st.composite
    def shard(draw):
        dim, chunks = draw(st.integers(0, 3)), draw(st.integers(1, 4))
        unit, rotate = draw(st.integers(1, 8)), draw(st.integers(0, 7))
        kind = draw(st.sampled_from(["plain", "tail", "sizes", "whole"]))
        if kind == "tail":
            per_block = draw(st.booleans())
            outer = draw(st.sampled_from([-1] + [d for d in range(4) if d != dim])) if per_block else -1
            return Shard(dim, chunks, unit, rotate, draw(st.integers(0, 3)), per_block, outer)
        if kind == "plain" or chunks == 1 and kind == "whole":
            return Shard(dim, chunks, unit, rotate)
        sizes = tuple(draw(st.lists(st.integers(1, 6), min_size=chunks, max_size=chunks)))
        whole = ()
        if kind == "whole":   # some blocks, never all, held whole
            whole = tuple(draw(st.sets(st.integers(0, chunks - 1), min_size=1, max_size=chunks - 1)))
        return Shard(dim, chunks, unit, rotate, sizes=sizes, whole=whole)

    @st.composite
    def routed(draw):
        holder = draw(st.sampled_from(["experts", "sent", "tokens"]))
        tokens = holder == "tokens"
        reordered = tokens and draw(st.booleans())
        return Routed(draw(st.integers(0, 3)), span=draw(st.integers(1, 3)), tokens=tokens, sent=holder == "sent",
                      reordered=reordered, unit=draw(st.integers(1, 4)), own=tokens and draw(st.booleans()),
                      ascending=reordered and draw(st.booleans()), alone=reordered and draw(st.booleans()),
                      heads=draw(st.integers(1, 8)) if tokens and draw(st.booleans()) else 0)

    return st.one_of(st.just(REPLICATE), st.just(PARTIAL), st.just(REPLICATE_PARTIAL_GRAD), shard(), routed())
