"""Higher-order ops in forward: a ``torch.no_grad()`` or ``torch.autocast`` block is inlined
exactly (autotp.capture.higher_order); ``torch.cond`` runs whole, its branches carried into the program.
Each checked against the serial model on two gloo ranks at tp=2."""
import torch
from torch import nn

import autotp
from autotp.testing import TOLERANCE, equivalence_errors, keep_loss_precision, tolerance


class NoGradScale(nn.Module):
    """A scale computed under no_grad (as rotary models compute cos/sin), a block with autocast off."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)
        self.register_buffer("freq", torch.arange(16, dtype=torch.float64))

    def forward(self, x):                                  # x: (b, 16)
        with torch.no_grad():
            scale = torch.cos(self.freq * 0.1) + 2.0       # (16,), no gradient
        with torch.autocast("cpu", enabled=False):
            y = self.down(torch.relu(self.up(x * scale)))  # (b, 16)
        return (y * y).sum()


class Branchy(nn.Module):
    """A data-dependent branch between two split matrices."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        h = self.up(x)                                                       # (b, 64)
        h = torch.cond(x.sum() > 0, lambda t: t * 2.0, lambda t: t - 1.0, (h,))
        return (self.down(torch.relu(h)) ** 2).sum()


class NoGradThenLayers(nn.Module):
    """A no_grad region before a stack of layers (as rotary models compute cos/sin before theirs)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("freq", torch.arange(16, dtype=torch.float64))
        self.layers = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(16, 64), "down": nn.Linear(64, 16)})
                                    for _ in range(2))

    def forward(self, x):                                  # x: (b, 16)
        with torch.no_grad():
            scale = torch.cos(self.freq * 0.1) + 2.0
        h = x * scale
        for layer in self.layers:
            h = h + layer["down"](torch.relu(layer["up"](h)))
        return (h * h).sum()


MEGATRON_MLP = {"up.weight": "column", "down.weight": "row"}


def run_module(kind: str) -> tuple[dict, str]:
    torch.manual_seed(0)
    model = (NoGradScale() if kind == "no_grad" else Branchy()).double()
    x = torch.randn(3, 16, dtype=torch.float64)
    x = x * torch.sign(x.sum()) * (-1 if kind == "cond_false" else 1)   # which branch runs
    pm = autotp.parallelize(model, 2, example_inputs=(x,), layout=MEGATRON_MLP)
    return equivalence_errors(model, pm, {"x": x}), pm.graph_module.code


def run_checkpointed_layers(_: str) -> tuple[dict, bool]:
    torch.manual_seed(0)
    model = NoGradThenLayers().double()
    x = torch.randn(3, 16, dtype=torch.float64)
    pm = autotp.parallelize(model, 2, example_inputs=(x,), layout={"*.up.weight": "column", "*.down.weight": "row"},
                            activation_checkpointing=True)
    return equivalence_errors(model, pm, {"x": x}), torch.is_grad_enabled()


def run_tiny_llama(_: str) -> tuple[dict, str]:
    from autotp import zoo

    config = zoo.tiny_config("llama", layers=2, heads=4, kv_heads=2, head_dim=8, vocab=67)
    model = keep_loss_precision(zoo.build("llama", config, dtype=torch.float64))
    pm = autotp.parallelize(model, 2, batch=64, seq=4096, profile="h100-dgx")
    batch = zoo.example_batch("llama", config, seq=7)
    # float32's bound: its RMSNorm casts down (autotp.testing.tolerance)
    return equivalence_errors(model, pm, batch), pm.graph_module.code, tolerance(model, batch)


def test_no_grad_and_autocast_regions_are_inlined_exactly(cluster_of):
    for errors, code in cluster_of(2).run(run_module, "no_grad"):
        assert max(errors.values()) <= TOLERANCE[torch.float64], errors
        assert "wrap_with" not in code and "torch._C._set_grad_enabled(False)" in code
        assert "torch.amp.autocast_mode._enter_autocast" in code


def test_a_no_grad_region_before_checkpointed_layers_stays_inside_its_partition(cluster_of):
    # split_module carries a grad-mode call into every later partition unless it is renamed:
    # the layers then ran without autograd and the mode stayed off after the call
    for errors, grad_on in cluster_of(2).run(run_checkpointed_layers, ""):
        assert max(errors.values()) <= TOLERANCE[torch.float64], errors
        assert grad_on


def test_cond_runs_whole_with_its_branches_on_every_rank(cluster_of):
    for kind in ("cond", "cond_false"):
        for errors, code in cluster_of(2).run(run_module, kind):
            assert max(errors.values()) <= TOLERANCE[torch.float64], (kind, errors)
            assert "cond" in code


def test_rotary_model_with_no_grad_in_forward_parallelizes(cluster_of):
    for errors, code, bound in cluster_of(2).run(run_tiny_llama, ""):
        assert bound == TOLERANCE[torch.float32] and max(errors.values()) <= bound, errors
        assert "wrap_with_set_grad_enabled" not in code
