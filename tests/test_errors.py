"""Bad input gets a clear autotp error that names the cause and the fix."""
import pytest
import torch

import autotp
from autotp.errors import CaptureError, ConfigError, InputError, PlanError
from tests.helpers import batch, tiny_gpt2


@pytest.mark.parametrize("tp", [0, -2, 2.0, True, "2"])
def test_tp_that_is_not_a_positive_int_is_refused(tp):
    with pytest.raises(ConfigError, match="tp must be a positive integer"):
        autotp.plan(tiny_gpt2(), tp=tp)


def test_tp_above_the_head_count_names_the_heads():
    with pytest.raises(PlanError, match=r"tp=8 exceeds the model's 4 attention heads \(config.n_head=4\)"):
        autotp.plan(tiny_gpt2(n_head=4), tp=8)


def test_heads_that_do_not_divide_name_the_dimension_and_the_valid_tps():
    with pytest.raises(PlanError, match=r"12 attention heads \(config.n_head\) cannot be split 8 ways evenly; "
                                        r"choose tp in \[1, 2, 3, 4, 6, 12\]"):
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


def test_input_longer_than_n_positions_is_refused_before_running(cluster):
    with pytest.raises(InputError, match=r"input_ids has 20 elements in dim 1 but the model was captured for "
                                         r"at most 16"):
        cluster.run(_too_long_input)


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:   # data-dependent control flow
            return self.lin(x)
        return -self.lin(x)


def test_untraceable_model_names_the_failure_and_what_to_try():
    with pytest.raises(CaptureError, match=r"(?s)could not capture Branchy.*data-dependent.*torch.cond"):
        autotp.plan(Branchy(), tp=1, example_kwargs={"x": torch.randn(2, 4)})


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
