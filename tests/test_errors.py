"""Bad input gets a clear autotp error that names the cause and the fix.

One test (at least) per entry of docs/errors.md; the entries about ranks that disagree or die
are tested in tests/runtime/test_agreement.py and tests/runtime/test_faults.py.
"""
import ast
import inspect
import logging
from pathlib import Path

import pytest
import torch

import autotp
from autotp.errors import CaptureError, ConfigError, InputError, PlanError
from autotp.passes import rules
from tests.helpers import batch, tiny_gpt2


@pytest.mark.parametrize("tp", [0, -2, 2.0, True, "2"])
def test_tp_that_is_not_a_positive_int_is_refused(tp):
    with pytest.raises(ConfigError, match="tp must be a positive integer"):
        autotp.plan(tiny_gpt2(), tp=tp)


def test_tp_above_the_head_count_names_the_heads():
    with pytest.raises(PlanError, match=r"tp=8 exceeds the 4 attention heads of transformer.h.0.attn \(read off its attention op\)"):
        autotp.plan(tiny_gpt2(n_head=4), tp=8)


def test_heads_that_do_not_divide_name_the_dimension_and_the_valid_tps():
    with pytest.raises(PlanError, match=r"12 attention heads \(transformer.h.0.attn\) cannot be split 8 ways evenly "
                                        r"with uneven=False; choose tp in \[1, 2, 3, 4, 6, 12\]"):
        autotp.plan(tiny_gpt2(n_head=12, head_dim=2), tp=8, uneven=False)


def test_parallelize_without_a_process_group_says_how_to_launch():
    with pytest.raises(ConfigError, match="needs an initialized torch.distributed process group"):
        autotp.parallelize(tiny_gpt2(), tp=2)


def _parallelize_tp3():
    autotp.parallelize(tiny_gpt2(n_head=6, head_dim=4), tp=3)


def test_tp_that_does_not_divide_the_world_lists_the_divisors(cluster):
    with pytest.raises(ConfigError, match=r"world size 4 is not divisible by tp=3; choose tp in \{1, 2, 4\}"):
        cluster.run(_parallelize_tp3)


def _too_long_input():
    model = tiny_gpt2(n_positions=16)
    pm = autotp.parallelize(model, tp=2)
    pm(**batch(100, s=20))


def _unequal_lengths():
    model = tiny_gpt2(n_positions=16)
    pm = autotp.parallelize(model, tp=2)
    ids = torch.zeros(1, 5, dtype=torch.long)
    pm(input_ids=ids, labels=torch.zeros(1, 6, dtype=torch.long), use_cache=False)


def test_inputs_captured_with_one_length_called_with_two_are_refused(cluster_of):
    # Capture found labels' and input_ids' lengths equal; a program for unequal lengths is tried,
    # and GPT-2's loss (which shifts one against the other) cannot take them: the error says both.
    with pytest.raises(InputError, match=r"input_ids dim 1 has size 5 but labels dim 1 has 6: .* its forward "
                                         r"fails with them unequal \(ValueError: Expected input batch_size"):
        cluster_of(2).run(_unequal_lengths)


def _out_of_vocabulary(which: str):
    model = tiny_gpt2(vocab=100)
    pm = autotp.parallelize(model, tp=2, layout={"lm_head.weight": "vocab"})
    inputs = batch(100, s=5)
    inputs[which][0, 2] = 100 if which == "input_ids" else -3
    pm(**inputs)


def test_token_ids_or_labels_outside_the_vocabulary_are_refused_like_serial(cluster_of):
    # Serial raises IndexError; the vocab-parallel lookup and loss would mask the id away.
    with pytest.raises(IndexError):
        inputs = batch(100, s=5)
        inputs["input_ids"][0, 2] = 100
        tiny_gpt2(vocab=100)(**inputs)
    with pytest.raises(InputError, match=r"input_ids holds 100, outside \[0, 100\)"):
        cluster_of(2).run(_out_of_vocabulary, "input_ids")
    with pytest.raises(InputError, match=r"labels holds -3, outside \[0, 100\).*-100 marks an ignored"):
        cluster_of(2).run(_out_of_vocabulary, "labels")


def test_index_bounds_skip_ignored_positions_and_name_the_first_bad_input():
    from autotp.runtime.module.inputs import check_index_bounds

    bounds = {"input_ids": (10, None, "an embedding table"), "labels": (10, -100, "the classes of a loss")}
    ids, labels = torch.tensor([[0, 9, 3]]), torch.tensor([[-100, 9, 0]])
    check_index_bounds(bounds, {"input_ids": ids, "labels": labels})
    check_index_bounds(bounds, {"input_ids": ids, "labels": torch.full((1, 3), -100)})   # all ignored
    check_index_bounds(bounds, {"input_ids": ids})                                      # no labels given
    with pytest.raises(InputError, match=r"labels holds 10, outside \[0, 10\)"):
        check_index_bounds(bounds, {"input_ids": ids, "labels": torch.tensor([[-100, 10, 0]])})
    with pytest.raises(InputError, match=r"input_ids holds -1, outside"):
        check_index_bounds(bounds, {"input_ids": torch.tensor([[-1, 10]]), "labels": labels})


def test_input_longer_than_n_positions_is_refused_before_running(cluster_of):
    with pytest.raises(InputError, match=r"input_ids has 20 elements in dim 1 but the model was captured for "
                                         r"at most 16"):
        cluster_of(2).run(_too_long_input)


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:   # data-dependent control flow
            return self.lin(x)
        return -self.lin(x)


def test_untraceable_model_names_the_failure_the_source_line_and_what_to_try():
    lines, first = inspect.getsourcelines(Branchy.forward)
    branch = first + next(i for i, line in enumerate(lines) if "if x.sum()" in line)
    with pytest.raises(CaptureError, match=r"(?s)could not capture Branchy.*data-dependent.*torch.cond") as info:
        autotp.plan(Branchy(), tp=1, example_kwargs={"x": torch.randn(2, 4)})
    assert f"(at {__file__}:{branch})" in str(info.value)


def test_model_without_config_needs_example_inputs():
    with pytest.raises(CaptureError, match="pass example_kwargs"):
        autotp.plan(torch.nn.Linear(4, 4), tp=1)


def test_positional_inputs_to_a_forward_taking_star_args_are_refused():
    class StarArgs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, *xs):
            return self.lin(xs[0])

    with pytest.raises(ConfigError, match=r"takes \*args"):
        autotp.plan(StarArgs(), tp=1, example_inputs=(torch.randn(2, 4),))


# ---------------------------------------------------------------- an op with no sharding rule

class Arctan(torch.nn.Module):
    """A column-parallel linear feeding aten.atan, an op autotp has no sharding rule for."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(4, 6)
        self.down = torch.nn.Linear(6, 3)

    def forward(self, x):                                   # (b, s, 4)
        return self.down(torch.atan(self.up(x)))           # (b, s, 3)


ARCTAN_INPUTS = {"x": torch.randn(2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))}


def _arctan_relative_error() -> float:
    from autotp.testing import relative_error

    torch.manual_seed(0)
    model = Arctan().double()
    pm = autotp.parallelize(model, tp=2, layout={"up.weight": "column"}, example_kwargs=ARCTAN_INPUTS)
    return relative_error(pm(**ARCTAN_INPUTS), model(**ARCTAN_INPUTS))


def test_op_without_a_rule_runs_replicated_with_a_warning_naming_it(monkeypatch, caplog, cluster):
    monkeypatch.setattr(rules.registry, "_warned", set())  # the warning is given once per op and process
    with caplog.at_level(logging.WARNING, logger="autotp.rules"):
        plan = autotp.plan(Arctan().double(), tp=2, layout={"up.weight": "column"}, example_kwargs=ARCTAN_INPUTS)
    assert "no sharding rule for aten.atan.default; it runs replicated (correct, maybe slower)" in caplog.text
    assert plan.comm_counts().get("all_gather") == 1  # the split activation is gathered for atan
    assert max(cluster.run(_arctan_relative_error)) < 1e-12


# ---------------------------------------------------------------- plans and layouts

def test_pinned_layout_that_no_strategy_fits_names_the_parameter_and_the_op():
    # 3 output features cannot be dealt to 4 ranks: the pin alone cannot hold
    with pytest.raises(PlanError, match=r"no feasible plan: down.weight \(shape \[3, 6\], split along dim 0 by "
                                        r"layout pin 'down.weight'\) cannot be split 4 ways: no sharding rule of "
                                        r"linear_default_1 \(aten.linear.default\), the op that reads it, "
                                        r"accepts that split at tp=4 .*Pin it 'replicate'"):
        autotp.plan(Arctan().double(), tp=4, layout={"down.weight": "column"}, example_kwargs=ARCTAN_INPUTS)


def test_unknown_layout_role_lists_the_roles():
    with pytest.raises(ConfigError, match=r"layout for up.weight: unknown role 'sideways'; use one of "
                                          r"\('column', 'row', 'vocab', 'replicate', 'expert', 'expert_column', "
                                          r"'expert_row'\) or a Placement"):
        autotp.plan(Arctan(), tp=2, layout={"up.weight": "sideways"}, example_kwargs=ARCTAN_INPUTS)


def test_plan_of_an_unknown_schema_version_is_refused():
    text = autotp.plan(tiny_gpt2(n_layer=1), tp=2).to_json().replace('"autotp_plan": 2', '"autotp_plan": 99')
    with pytest.raises(ConfigError, match=r"autotp plan schema version 99 is not supported \(this autotp reads "
                                          r"versions 1, 2, 3\); re-create the plan with autotp.plan"):
        autotp.Plan.from_json(text)


def test_plan_that_is_not_json_is_refused_without_unpickling():
    with pytest.raises(ConfigError, match="not an autotp plan: invalid JSON"):
        autotp.Plan.from_json("\x80\x04\x95 a pickle, not JSON")


# ---------------------------------------------------------------- nothing unsafe is loaded

UNSAFE_LOADERS = {("pickle", "load"), ("pickle", "loads"), ("dill", "load"), ("dill", "loads"),
                  ("marshal", "loads"), ("torch", "load")}
#: The local launcher pickles its own task functions and results between its own processes; it
#: never reads a file or a user's data.
PICKLE_ALLOWED = {"distributed/launch.py"}


def _unsafe_loads(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)):
            continue
        call = (node.func.value.id, node.func.attr)
        if call not in UNSAFE_LOADERS:
            continue
        safe = call == ("torch", "load") and any(
            k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
            for k in node.keywords)
        if not safe and not (call[0] == "pickle" and f"{path.parent.name}/{path.name}" in PICKLE_ALLOWED):
            found.append(f"{path}:{node.lineno}: {'.'.join(call)}")
    return found


def test_autotp_loads_no_pickle_and_torch_load_only_with_weights_only():
    package = Path(autotp.__file__).parent
    assert [hit for path in sorted(package.rglob("*.py")) for hit in _unsafe_loads(path)] == []


def test_the_scan_finds_torch_load_without_weights_only_and_pickle(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle, torch\ntorch.load('w.pt')\npickle.loads(b'')\ntorch.load('w.pt', weights_only=True)\n")
    assert [hit.split(": ")[1] for hit in _unsafe_loads(bad)] == ["torch.load", "pickle.loads"]


def _planning_fails_on_rank_1():
    import torch.distributed as dist

    layout = {"*.c_attn.weight": "sideways"} if dist.get_rank() == 1 else None   # an unknown role
    autotp.parallelize(tiny_gpt2(n_layer=1), tp=2, layout=layout)
    return "ok"


def test_a_rank_that_fails_to_plan_stops_its_group_at_once_instead_of_leaving_it_waiting(cluster, monkeypatch):
    # ranks 2 and 3 plan on: on loaded cores (load 25 on two) that takes longer than the default 3 s grace
    # the cluster gives them after rank 1 fails; a rank stuck in a collective would not finish in 60 s either
    monkeypatch.setattr(cluster, "error_grace", 60.0)
    with pytest.raises(ConfigError, match="unknown role 'sideways'") as caught:
        cluster.run(_planning_fails_on_rank_1)
    message = str(caught.value)
    assert "ranks that failed: [0, 1]" in message      # rank 0 was told, and raised; ranks 2, 3 went on
    assert "did not finish" not in message              # nobody was left waiting in a collective


def test_a_malformed_plan_document_is_a_config_error():
    import json

    doc = json.loads(autotp.plan(tiny_gpt2(n_layer=1), tp=2).to_json())
    del doc["params"]["transformer.wpe.weight"]["placement"]
    with pytest.raises(ConfigError, match="malformed autotp plan"):
        autotp.Plan.from_json(json.dumps(doc))
