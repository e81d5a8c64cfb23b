"""autotp.cost_model.work.differ: whether two element counts differ, as sympy.simplify says.

The cost model tells a broadcast operand from one of the output's size by comparing element
counts, sympy expressions in the graph's size symbols (positive integers), with floor divisions
and remainders where a model pads its sequence (a Mamba2 mixer's chunks). ``differ`` must answer
what ``sympy.simplify(a - b) != 0`` answered before it (the plans stay the same), on expressions
drawn from sums and products of sizes, torch's ``FloorDiv`` and ``Mod`` of them, and pairs that
are equal written two ways."""
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._sympy.functions import FloorDiv, Mod

from autotp.cost_model.work import differ

S, B = sympy.symbols("s0 s1", integer=True, positive=True)


def _sizes(depth: int = 2):
    leaf = st.one_of(st.sampled_from([S, B]), st.integers(1, 8).map(sympy.Integer))
    if depth == 0:
        return leaf
    inner = _sizes(depth - 1)
    return st.one_of(
        leaf,
        st.tuples(inner, inner).map(lambda ab: ab[0] + ab[1]),
        st.tuples(inner, inner).map(lambda ab: ab[0] * ab[1]),
        st.tuples(inner, st.integers(1, 4)).map(lambda ac: FloorDiv(ac[0], ac[1])),
        st.tuples(inner, st.integers(2, 4)).map(lambda ac: Mod(ac[0], ac[1])),
        # a sequence padded up to a multiple of c, as a chunked scan pads it
        st.tuples(inner, st.integers(2, 4)).map(lambda ac: ac[0] + Mod(ac[1] - Mod(ac[0], ac[1]), ac[1])))


@st.composite
def pairs(draw):
    a = draw(_sizes())
    how = draw(st.sampled_from(["other", "same", "rewritten", "multiple"]))
    if how == "other":
        return a, draw(_sizes())
    if how == "same":
        return a, a
    if how == "rewritten":   # equal, written another way
        return a, sympy.Mul(a + 1, 2, evaluate=False) - a - 2
    c = draw(st.integers(2, 4))
    return FloorDiv(c * a, c), a


@settings(max_examples=60, deadline=None, derandomize=True)
@given(pair=pairs())
def test_differ_answers_as_simplify_does(pair):
    a, b = pair
    assert differ(a, b) == (sympy.simplify(a - b) != 0), (a, b)


def test_a_chunked_sequences_sizes_are_told_apart_and_alike():
    padded = S + Mod(4 - Mod(S, 4), 4)
    chunks = FloorDiv(padded, 4)
    assert differ(2 * B * chunks * FloorDiv(padded, chunks) ** 2, 16 * B * chunks)
    assert not differ(B * chunks * 4, 4 * chunks * B)
    assert differ(S, 16 * S * B) and not differ(S * B, B * (S + 1) - B)
