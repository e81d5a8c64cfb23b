"""A plan file is read whole or refused: ``Plan.from_json`` checks every field (autotp/plan_schema.py),
so a loaded plan's table, figure and diff never fail raw; ``plan.diff`` takes a Plan or its JSON."""
from __future__ import annotations

import functools
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotp.errors import ConfigError
from autotp.plan import Plan
from autotp.testing import MEGATRON_GPT2


@functools.lru_cache(maxsize=None)
def _plan_text() -> str:
    """A small real plan (GPT-2, 2 layers, tp 2) with its layer flows and attention heads."""
    import autotp
    from tests.helpers import tiny_gpt2

    return autotp.plan(tiny_gpt2(n_layer=2, dtype=__import__("torch").float32), tp=2, batch=2, seq=8,
                       layout=MEGATRON_GPT2).to_json()


def _paths(doc, prefix=()):
    """Every place of ``doc`` (a JSON tree): the path of keys and indices to it."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _set(doc, path, value):
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


def _use(plan: Plan) -> None:
    """What a user does with a loaded plan: the table, the figure, a diff both ways, the costs."""
    plan.table(full=True)
    str(plan)
    plan.cost
    plan.heads_per_rank()
    good = Plan.from_json(_plan_text())
    str(plan.diff(good))
    str(good.diff(plan))
    try:
        plan.figure()
    except ConfigError as exc:   # a plan without layer flows says so
        assert "records no layer flows" in str(exc)


@pytest.mark.parametrize("field, value, named", [
    (("compute_s",), math.nan, "compute_s is nan, expected a non-negative finite number"),
    (("tp",), 0, "tp is 0, expected an integer >= 1"),
    (("tp",), "two", "tp is 'two', expected an integer >= 1"),
    (("batch",), 2.5, "batch is 2.5, expected an integer >= 1"),
    (("comms", 0, "seconds"), -1.0, "comms[0].seconds is -1.0"),
    (("params", "transformer.h.0.attn.c_attn.weight", "shape"), "768", "shape is '768', expected a list"),
    (("params", "transformer.h.0.attn.c_attn.weight", "placement", "dim"), 5, "placement.dim is 5, expected a dim"),
    (("notes",), "a note", "notes is 'a note', expected a list"),
    (("memory_limit",), math.nan, "memory_limit is nan"),
])
def test_a_plan_file_with_a_wrong_field_is_refused_naming_it(field, value, named):
    # before: NaN costs, tp 0 and tp "two" were accepted, and failed raw later (table, figure, diff)
    doc = json.loads(_plan_text())
    _set(doc, field, value)
    with pytest.raises(ConfigError, match="malformed autotp plan: ") as info:
        Plan.from_json(json.dumps(doc))
    assert named in str(info.value), str(info.value)
    assert "re-create the plan with autotp.plan(...)" in str(info.value)


_WRONG = st.sampled_from([None, True, 0, -1, 2.5, math.nan, math.inf, "two", "", [], [1, "a"], {}, {"kind": "x"},
                          10 ** 6])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_plan_file_with_any_field_replaced_loads_whole_or_is_refused(data):
    """Any field (a leaf or a whole object) replaced by a value of another type or range:
    ``from_json`` raises ConfigError, or the plan it returns serves every view."""
    doc = json.loads(_plan_text())
    paths = [p for p in _paths(doc) if p and p[0] != "autotp_plan"]
    path = data.draw(st.sampled_from(paths))
    _set(doc, path, data.draw(_WRONG))
    try:
        plan = Plan.from_json(json.dumps(doc))
    except ConfigError:
        return
    _use(plan)


def test_a_plan_as_loaded_serves_every_view():
    _use(Plan.from_json(_plan_text()))


@pytest.mark.parametrize("other", [None, 3, "{not json"])
def test_diff_with_what_is_not_a_plan_is_a_config_error(other):
    # before: a raw AttributeError ('NoneType' object has no attribute 'cost')
    plan = Plan.from_json(_plan_text())
    with pytest.raises(ConfigError, match=r"plan.diff takes another Plan|not an autotp plan"):
        plan.diff(other)


def test_diff_takes_a_plans_json_text():
    plan = Plan.from_json(_plan_text())
    assert str(plan.diff(_plan_text())) == str(plan.diff(plan))


@pytest.mark.parametrize("field, value", [
    (("params", "transformer.h.0.attn.c_proj.bias", "shape"), []),   # a scalar parameter: the figure drew max(())
    (("flows", 0, "indices"), []),
    (("flows", 0, "steps"), []),
])
def test_the_fields_a_wider_search_found_load_whole_or_are_refused(field, value):
    # found by the property above at 2000 examples: the figure failed raw (IndexError, ValueError)
    doc = json.loads(_plan_text())
    _set(doc, field, value)
    try:
        plan = Plan.from_json(json.dumps(doc))
    except ConfigError as exc:
        assert "malformed autotp plan: flows[0]" in str(exc), str(exc)
        return
    _use(plan)
