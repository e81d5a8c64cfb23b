"""A placement survives a plan file whole: ``placements.from_json(to_json(p)) == p`` for every kind
and every field (``Routed``'s marks ``own``, ``ascending`` and ``alone`` too, which the file once
dropped), through the JSON text and ``Plan.from_json``'s checks; a file written before a field
existed reads as that field's default, and a field of the wrong type is refused naming it."""
import dataclasses
import json

import pytest
from hypothesis import given, settings

from autotp.errors import ConfigError
from autotp.plan import Plan
from autotp.placements import PARTIAL, Routed, Shard, from_json, to_json
from autotp.testing.strategies import placements


@settings(max_examples=300, deadline=None)
@given(p=placements())
def test_every_placement_round_trips_through_its_json_text(p):
    assert from_json(json.loads(json.dumps(to_json(p)))) == p


def _plan_text(output) -> str:
    """A one-parameter plan whose output ``logits`` is held as ``output``, as a file."""
    return Plan(tp=2, profile="cpu-gloo", batch=1, seq=4, params={"w": Shard(0)}, shapes={"w": (4, 4)},
                roles={"w": "column"}, sharded_outputs={"logits": output}).to_json()


@settings(max_examples=100, deadline=None)
@given(p=placements())
def test_a_plan_file_keeps_every_placement_it_holds(p):
    # through Plan.to_json / from_json, the schema's checks included (plan/schema.py)
    assert Plan.from_json(_plan_text(p)).sharded_outputs == {"logits": p}


@pytest.mark.parametrize("routed", [
    Routed(0, tokens=True, own=True),
    Routed(0, span=2, tokens=True, reordered=True, ascending=True),
    Routed(0, tokens=True, reordered=True, alone=True),
])
def test_routeds_marks_are_kept(routed):
    # before: own, ascending and alone were written nowhere, and read back False
    assert from_json(to_json(routed)) == routed


#: for each field of each placement with fields, one placement that differs from the default there
#: (with what the field needs): a field added to a placement must be added here, and so to its JSON
EVERY_FIELD = {
    Routed: {"dim": Routed(1), "span": Routed(0, span=2), "tokens": Routed(0, tokens=True),
             "sent": Routed(0, sent=True), "reordered": Routed(0, tokens=True, reordered=True),
             "unit": Routed(0, unit=4), "own": Routed(0, tokens=True, own=True),
             "ascending": Routed(0, tokens=True, reordered=True, ascending=True),
             "alone": Routed(0, tokens=True, reordered=True, alone=True),
             "heads": Routed(0, tokens=True, unit=2, heads=4)},
    Shard: {"dim": Shard(2), "chunks": Shard(0, chunks=3), "unit": Shard(0, unit=8), "rotate": Shard(0, rotate=1),
            "tail": Shard(0, tail=1), "per_block": Shard(0, chunks=2, per_block=True),
            "outer": Shard(0, chunks=2, per_block=True, outer=1), "sizes": Shard(0, chunks=3, sizes=(4, 1, 1)),
            "whole": Shard(0, chunks=3, sizes=(2, 1, 1), whole=(1, 2))},
}


def test_every_field_of_every_placement_is_kept():
    for kind, examples in EVERY_FIELD.items():
        assert set(examples) == {f.name for f in dataclasses.fields(kind)}, (kind, "a field with no example here")
        default = kind(0)
        for name, p in examples.items():
            assert getattr(p, name) != getattr(default, name), (kind, name)
            assert from_json(json.loads(json.dumps(to_json(p)))) == p, (kind, name)


@pytest.mark.parametrize("doc, read", [
    ({"kind": "partial"}, PARTIAL),
    ({"kind": "partial", "routed": 0, "tokens": True, "reordered": True}, Routed(0, tokens=True, reordered=True)),
    ({"kind": "shard", "dim": 1}, Shard(1)),
])
def test_a_file_written_before_a_field_existed_reads_as_its_default(doc, read):
    assert from_json(doc) == read


@pytest.mark.parametrize("field, value, named", [
    ("own", "yes", "sharded_outputs['logits'].own is 'yes', expected true or false"),
    ("span", 0, "sharded_outputs['logits'].span is 0, expected an integer >= 1"),
    ("ascending", True, "sharded_outputs['logits'] is {'kind': 'partial', 'routed': 0, 'tokens': True, "
                        "'ascending': True}, expected marks Routed accepts together (Routed.ascending says rows "
                        "reordered lie in their ids' order"),   # without reordered
])
def test_a_routed_field_of_the_wrong_kind_is_refused_naming_it(field, value, named):
    doc = json.loads(_plan_text(Routed(0, tokens=True)))
    doc["sharded_outputs"]["logits"][field] = value
    with pytest.raises(ConfigError, match="malformed autotp plan") as info:
        Plan.from_json(json.dumps(doc))
    assert named in str(info.value), str(info.value)
