"""A product's predicted time (``cost_model.symbolic.product_seconds``, the rate of
``DeviceProfile.product_rate``) on every profile: more work of the same kind never costs less."""
from __future__ import annotations

import pytest
import sympy
from hypothesis import given, settings, strategies as st

from autotp.cost_model import PROFILES
from autotp.cost_model.symbolic import product_seconds
from autotp.cost_model.work import Product

SIZES = st.integers(1, 1 << 15)


@settings(max_examples=300, deadline=None)
@given(profile=st.sampled_from(sorted(PROFILES)), m=SIZES, n=SIZES, k=SIZES, batch=st.integers(1, 64),
       dim=st.sampled_from(["m", "n", "k", "batch"]), more=st.integers(1, 1 << 12))
def test_a_products_time_never_falls_as_a_dim_grows(profile, m, n, k, batch, dim, more):
    """Before, the depth term multiplied the size term's fixed work: ``(W + w0)(k + k0)/k`` fell with k
    where ``m·n·k² < w0·k0`` (a 1x1 product contracting 1 cost twice one contracting 2 on h200)."""
    prof = PROFILES[profile]
    shape = dict(m=m, n=n, k=k, batch=batch)

    def seconds(s: dict) -> float:
        p = Product(*(sympy.Integer(s[d]) for d in ("m", "n", "k", "batch")), aligned=True)
        return product_seconds(p, {}, prof, prof.dtype_bytes)[0]

    grown = dict(shape, **{dim: shape[dim] + more})
    assert seconds(grown) >= seconds(shape) * (1 - 1e-12), (shape, grown)


@settings(max_examples=50, deadline=None)
@given(half_work=st.floats(0, 1e10), half_k=st.floats(0, 500), peak=st.floats(1e10, 1e15))
def test_calibration_recovers_the_shape_constants_from_the_rates_they_give(half_work, half_k, peak):
    """``calibrate``'s fit of the two constants (``measure.fit_product_shape``) from a small and a
    shallow product's rates, as ``product_rate`` gives them, returns the constants."""
    from dataclasses import replace

    from autotp.cost_model.measure import fit_product_shape

    prof = replace(PROFILES["h200"], flops=peak, product_half_work=half_work, product_half_k=half_k)
    small, shallow = (1024, 1024, 1024), (4096, 4096, 32)
    rate = {s: prof.product_rate(s[0] * s[1] * s[2], s[2]) for s in (small, shallow)}
    fitted = fit_product_shape(peak, small, rate[small], shallow, rate[shallow])
    assert fitted == pytest.approx((half_work, half_k), rel=1e-6, abs=1e-6)
