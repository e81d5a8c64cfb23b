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
