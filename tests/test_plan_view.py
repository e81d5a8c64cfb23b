"""The plan as a person reads it: repeated layers folded and two plans compared (autotp.plan_view,
autotp.plan_diff), on small hand-made plans. Plans of real models: tests/test_plan.py (gpt2-xl
folded, a pinned layout's diff), tests/passes/test_families_plan.py (every family's figure)."""
from autotp.placements import REPLICATE, Shard
from autotp.plan import CommOp, Plan
from autotp.plan.view import indices_text, layer_groups

TP = 4


def _layer(stack: str, i: int, *, rotate: int = 0, extra: bool = False, experts: bool = False) -> dict:
    """One decoder layer's parameters: name -> (shape, role, placement)."""
    p = f"{stack}.{i}."
    out = {p + "norm.weight": ((64,), "replicate", REPLICATE),
           p + "attn.qkv.weight": ((192, 64), "column", Shard(0, chunks=3, unit=16, rotate=rotate)),
           p + "attn.out.weight": ((64, 64), "row", Shard(1, unit=16, rotate=rotate))}
    if extra:   # T5's first block: a position bias the others do not have
        out[p + "attn.bias.weight"] = ((32, 5), "column", Shard(1, rotate=rotate))
    if experts:   # an MoE layer: whole experts per rank
        out[p + "mlp.experts.gate_up_proj"] = ((8, 64, 256), "column", Shard(0))
    else:
        out[p + "mlp.up.weight"] = ((256, 64), "column", Shard(0))
    return out


def _comms(stack: str, i: int) -> list[CommOp]:
    return [CommOp("f", f"x{i}", f"linear_{2 * i}", "R", "R", 0.0, 1e6, 1e-4, f"{stack}.{i}.attn.qkv"),
            CommOp("g", f"y{i}", f"view_{i}", "P", "R", 1e6, 0.0, 1e-4, f"{stack}.{i}.attn.out")]


def _plan(layers: dict, comms: list[CommOp] = (), **kw) -> Plan:
    layers = {"embed.weight": ((100, 64), "vocab", Shard(0)), **layers}
    kw = {"compute_s": 0.01, "comm_s": 0.002, "memory_bytes": 2**30, **kw}
    return Plan(tp=TP, profile="h100-dgx", batch=8, seq=128, params={k: v[2] for k, v in layers.items()},
                shapes={k: v[0] for k, v in layers.items()}, roles={k: v[1] for k, v in layers.items()},
                comms=list(comms), **kw)


def test_index_sets_print_as_ranges():
    assert indices_text([0, 1, 2, 3]) == "{0..3}"
    assert indices_text([5]) == "{5}"
    assert indices_text([0, 2, 3, 4, 9]) == "{0, 2..4, 9}"
    assert indices_text([1, 3, 5, 7]) == "{1, 3, ..., 7}"


def test_layers_alike_up_to_rotation_fold_into_one_group():
    params = {}
    for i in range(6):
        params |= _layer("model.layers", i, rotate=i % TP)
    groups = layer_groups(_plan(params))
    assert [(g.name, len(g.params)) for g in groups] == [("model.layers.{0..5}", 4)]


def test_a_layer_that_differs_is_a_group_of_its_own_and_stacks_stay_apart():
    params = _layer("encoder.block", 0, extra=True)
    for i in (1, 2):
        params |= _layer("encoder.block", i)
    for i in range(3):
        params |= _layer("decoder.block", i)
    names = [g.name for g in layer_groups(_plan(params))]
    assert names == ["encoder.block.0", "encoder.block.{1..2}", "decoder.block.{0..2}"]


def test_a_dense_first_layer_then_moe_layers_fold_apart():
    params = _layer("model.layers", 0)
    for i in range(1, 4):
        params |= _layer("model.layers", i, experts=True)
    plan = _plan(params)
    assert [g.name for g in layer_groups(plan)] == ["model.layers.0", "model.layers.{1..3}"]
    text = plan.table()
    assert "mlp.experts.gate_up_proj" in text and "mlp.up.weight" in text and "8x64x256" in text


def test_the_folded_table_states_the_rotation_and_accounts_for_every_parameter():
    params, comms = {}, []
    for i in range(8):
        params |= _layer("model.layers", i, rotate=i % TP)
        comms += _comms("model.layers", i)
    plan = _plan(params, comms, aliases={"lm_head.weight": "embed.weight"})
    text = plan.table()
    assert "model.layers.{0..7}: 8 layers, 4 parameters each" in text
    assert "uneven splits rotate by 1 rank per layer" in text
    for rest in ("norm.weight", "attn.qkv.weight", "attn.out.weight", "mlp.up.weight"):
        assert rest in text
    assert "embed.weight" in text and "lm_head.weight" in text and "(tied to embed.weight)" in text
    assert "collectives in each layer of model.layers.{0..7} (x 8 layers)" in text
    # one row per collective of a layer, not one per layer
    assert text.count("attn.qkv: linear") == 1 and text.count("attn.out: view") == 1
    assert "collectives: f=8, g=8" in text and "predicted step: 12.000 ms" in text
    full = plan.table(full=True)
    assert all(name in full for name in plan.params)


def test_a_collective_only_one_layer_runs_is_listed_with_its_full_name():
    params, comms = {}, []
    for i in range(3):
        params |= _layer("h", i)
        comms += _comms("h", i)
    comms.append(CommOp("g", "emb", "layer_norm", "P", "R", 1e6, 0.0, 1e-4, "h.0.norm"))
    text = _plan(params, comms).table()
    assert "collectives outside the repeated layers" in text and "h.0.norm: layer_norm" in text
    assert "collectives in each layer of h.{0..2}" in text


def test_diff_lists_changed_layouts_folded_and_collectives_removed_per_layer():
    before, after = {}, {}
    comms_before, comms_after = [], []
    for i in range(4):
        before |= _layer("h", i)
        layer = _layer("h", i)
        layer[f"h.{i}.mlp.up.weight"] = ((256, 64), "replicate", REPLICATE)
        after |= layer
        comms_before += _comms("h", i)
        comms_after += _comms("h", i)[1:]   # without the f
    a, b = _plan(before, comms_before), _plan(after, comms_after, compute_s=0.02)
    d = a.diff(b)
    assert [(c.name, c.before, c.after) for c in d.layouts] == [("h.{0..3}.mlp.up.weight", "column S(0)",
                                                                  "replicate R")]
    assert [(c.where, c.sign, c.count) for c in d.collectives] == [("h.{0..3}", "-", 1)]
    text = str(d)
    assert "h.{0..3}: - f before attn.qkv: linear (R->R) per layer" in text
    assert "predicted step: 12.000 -> 22.000 ms (+83.3%)" in text
    assert "collectives per step: f 4 -> 0, g 4 -> 4" in text


def test_diff_of_a_plan_with_itself_is_empty():
    params = {}
    for i in range(2):
        params |= _layer("h", i, rotate=i)
    plan = _plan(params, _comms("h", 0) + _comms("h", 1))
    d = plan.diff(Plan.from_json(plan.to_json()))
    assert d.layouts == () and d.collectives == ()
    assert "layouts changed: none" in str(d) and "(+0.0%)" in str(d)


def test_diff_says_which_planning_arguments_changed():
    # before, two plans made with and without sequence parallelism forced read alike here
    from autotp.plan.arguments import PlanArguments

    params = _layer("h", 0)
    a = _plan(params, arguments=PlanArguments())
    b = _plan(params, arguments=PlanArguments(sequence_parallel=True, expert_dispatch=True))
    assert "planned with: sequence_parallel None -> True, expert_dispatch None -> True" in str(a.diff(b))
    assert "planned with" not in str(a.diff(a))
