"""The per-rank program: named f/g nodes, the row-parallel bias added once after the all-reduce,
GPT-2's fused q/k/v sharded by heads, local view sizes."""

import torch

import autotp
from autotp.placements import Shard
from autotp.testing import MEGATRON_GPT2
from tests.helpers import batch, tiny_gpt2


def _rank_program():
    model = tiny_gpt2(n_layer=1, n_head=4, head_dim=8)
    pm = autotp.parallelize(model, tp=2, layout=MEGATRON_GPT2)
    gm = pm.graph_module
    c_proj_bias = "p_transformer_h_0_attn_c_proj_bias"
    bias_adds = [n for n in gm.graph.nodes if n.op == "call_function"
                 and any(getattr(a, "name", None) == c_proj_bias for a in n.args)]
    other = [a for a in bias_adds[0].args if getattr(a, "name", None) != c_proj_bias][0]
    q, k, v = model.transformer.h[0].attn.c_attn.weight.detach().split(32, dim=1)
    rank = pm.mesh.tp_rank
    heads = slice(16 * rank, 16 * (rank + 1))   # this rank's 2 heads of 8 columns
    expected_qkv = torch.cat([q[:, heads], k[:, heads], v[:, heads]], dim=1)
    local_qkv = pm.local_parameter("transformer.h.0.attn.c_attn.weight").detach()
    return {
        "code": gm.code,
        "comm_kinds": sorted({type(m).__name__ for m in gm.children()}),
        "bias_add_input": (other.op, str(other.target)),
        "n_bias_adds": len(bias_adds),
        "qkv_ok": torch.equal(local_qkv, expected_qkv),
    }


def test_rank_program_shows_f_and_g_and_adds_the_row_bias_once_after_g(cluster_of):
    results = cluster_of(2).run(_rank_program)
    for r in results:
        assert "self.f_0(" in r["code"] and "self.g_0(" in r["code"]
        assert {"CopyToTP", "ReduceFromTP"} <= set(r["comm_kinds"])
        assert r["n_bias_adds"] == 1
        assert r["bias_add_input"][0] == "call_module" and r["bias_add_input"][1].startswith("g_")


def test_each_rank_holds_its_own_heads_of_q_k_and_v(cluster_of):
    assert all(r["qkv_ok"] for r in cluster_of(2).run(_rank_program))


class _RowsMLP(torch.nn.Module):
    """An MLP run on the tokens as rows, its hidden width spelled out in a view (as GPT-2's Conv1D
    was captured before it became one matmul of the 3-D x, whose views say -1)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 64)     # column-parallel: 32 hidden units on each of 2 ranks
        self.down = torch.nn.Linear(64, 16)   # row-parallel

    def forward(self, x):                               # x: (b, s, 16)
        h = torch.relu(self.up(x)).view(-1, 64)         # (b*s, 64)
        return self.down(h).view(x.shape)              # (b*s, 16) -> (b, s, 16)


def test_view_sizes_are_rewritten_to_local_sizes():
    from autotp.capture import capture
    from autotp.passes.rewrite import rewrite
    from autotp.planner import build_plan

    cap = capture(_RowsMLP(), example_kwargs={"x": torch.randn(2, 8, 16)})
    layout = {"up.weight": "column", "down.weight": "row"}
    plan, index, prop = build_plan(cap, 2, batch=2, seq=8, profile="cpu-gloo", layout=layout)
    assert [c.kind for c in plan.comms] == ["f", "g"]   # nothing gathered between: the view runs split
    for rank in range(2):
        gm = rewrite(index, prop, rank, None, None)
        sizes = [n.args[1] for n in gm.graph.nodes if n.target is torch.ops.aten.view.default]
        assert [-1, 32] in sizes and [-1, 64] not in sizes, (rank, sizes)   # each rank's 32 of the 64


def _inputs_without_labels():
    model = tiny_gpt2(n_layer=1)
    example = {"input_ids": torch.randint(0, 100, (2, 8))}
    pm = autotp.parallelize(model, tp=2, layout=MEGATRON_GPT2, example_kwargs=example)
    x = batch(100, b=3, s=5)["input_ids"]
    out, ref = pm(input_ids=x), model(input_ids=x)
    return (out.logits - ref.logits).abs().max().item(), out.loss is None


def test_example_kwargs_override_the_synthesized_inputs(cluster_of):
    for err, no_loss in cluster_of(2).run(_inputs_without_labels):
        assert err < 1e-12 and no_loss


class _MLP(torch.nn.Module):
    """A plain module, no config: its inputs come from example_inputs, positionally."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 64)     # column-parallel candidate
        self.down = torch.nn.Linear(64, 16)   # row-parallel candidate

    def forward(self, x):                      # x: (b, s, 16)
        return self.down(torch.relu(self.up(x)))


def _positional_inputs():
    torch.manual_seed(0)
    model = _MLP().double()
    example = (torch.randn(2, 8, 16, dtype=torch.float64),)
    pm = autotp.parallelize(model, tp=2, example_inputs=example,
                            layout={"up.weight": "column", "down.weight": "row"})
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    return ((pm(x) - model(x)).abs().max().item(), (pm(x=x) - model(x)).abs().max().item(),
            pm.plan.param_layouts["up.weight"], pm.plan.param_layouts["down.weight"])


def test_positional_example_inputs_capture_and_call_by_position(cluster_of):
    for by_position, by_name, up, down in cluster_of(2).run(_positional_inputs):
        assert by_position < 1e-12 and by_name < 1e-12
        assert (up, down) == ("column", "row")


def test_a_dynamic_size_is_localized_at_run_time_in_contiguous_runs_only():
    import pytest
    import sympy
    from torch import fx

    from autotp.errors import PlanError
    from autotp.passes.rewrite import GraphLocalContext
    from autotp.placements import Shard, local_size

    s = sympy.Symbol("s", integer=True, positive=True)
    for rank in range(4):
        graph = fx.Graph()
        full = graph.placeholder("n")
        graph.output(GraphLocalContext(4, rank, graph).local(full, s, Shard(0)))
        program = fx.GraphModule(torch.nn.Module(), graph)
        assert [program(n) for n in range(0, 14)] == [local_size(n, Shard(0), 4, rank) for n in range(0, 14)]
    graph = fx.Graph()
    with pytest.raises(PlanError, match="plain contiguous runs"):
        GraphLocalContext(4, 0, graph).local(graph.placeholder("n"), s, Shard(0, unit=2))


class _NoGradParts(torch.nn.Module):
    """A weight's product (carries a gradient) beside a buffer's and a no_grad block's (carry none)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 6))
        self.register_buffer("table", torch.randn(6))

    def forward(self, x):
        with torch.no_grad():
            scale = x.abs().amax(-1, keepdim=True) + 1.0
        y = x @ self.w
        return (y * self.table / scale).sum()


def test_only_nodes_reached_from_parameters_or_float_inputs_outside_no_grad_carry_gradients():
    from autotp.capture import capture
    from autotp.passes.propagate import grad_nodes

    cap = capture(_NoGradParts(), (torch.randn(2, 5, 6),))
    grads = {n.name for n in grad_nodes(cap)}
    by_op = {}
    for n in cap.graph.nodes:
        if n.op == "call_function":
            by_op.setdefault(getattr(n.target, "__name__", str(n.target)).split(".")[0], []).append(n.name)
    assert all(name in grads for name in by_op["matmul"] + by_op["sum"]), (grads, by_op)
    # the no_grad block's amax/add and anything from the buffer alone carry none
    assert not any(name in grads for name in by_op["amax"]), (grads, by_op)
    assert "b_table" not in grads and cap.param_names and all(p in grads for p in cap.param_names)


def test_a_layout_pinned_at_tp_1_runs_the_captured_ops_alone():
    """At tp 1 every conversion and f/g is the identity: Megatron's layout pinned on one rank
    (data parallelism alone) gives a program without a collective or a copy standing for one,
    that computes what the model does."""
    from autotp.planner import build_plan
    from autotp.capture import capture
    from autotp.passes.rewrite import rewrite
    from tests.test_capture_expand import run

    model = tiny_gpt2(n_layer=2, n_head=4, head_dim=8).double()
    cap = capture(model)
    plan, index, prop = build_plan(cap, 1, batch=2, seq=8, layout=MEGATRON_GPT2)
    assert any(c.kind in ("f", "g") for c in prop.comms)   # the plan still says where they would be
    gm = rewrite(index, prop, 0, None, None)
    assert [n for n in gm.graph.nodes if n.op == "call_module"] == []
    # the capture as planned: its GELUs each one op (autotp/passes/activations.py)
    assert len(index.capture.graph.nodes) < len(cap.graph.nodes)
    # op for op, but the column-parallel Conv1D products (c_attn, c_fc: two a layer) run their
    # bias inside as HF's Conv1D does (autotp/passes/fused_bias.py): addmm on the flattened tokens
    # with a view each side, sized from x's three dims and W's columns, for the captured matmul
    # and add (five nodes more each); an op of the capture nothing reads (HF's position ids'
    # expand) does not run (rewrite.remove_dead)
    fused = [n for n in gm.graph.nodes if n.target is torch.ops.aten.addmm.default]
    assert len(fused) == 4, fused
    unread = [n.name for n in index.capture.graph.nodes if n.op == "call_function" and not n.users]
    assert unread == ["expand_default"], unread
    assert len(gm.graph.nodes) == len(index.capture.graph.nodes) + 5 * len(fused) - len(unread)
    data = batch(model.config.vocab_size)
    planned = index.capture
    want = run(planned, model, data)
    planned.graph_module = gm   # the rank's program, fed as the capture is
    got = run(planned, model, data)
    for name in ("loss", "logits"):
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


class _InPlace(torch.nn.Module):
    """In-place ops as user models write them: a scaling and an inplace ReLU between a column
    and a row product (sharded there), and a masked fill of the row product's output (partial
    there: it must be summed first, so the op writes a converted copy)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8, bias=False)

    def forward(self, x):
        h = self.up(x)
        h.mul_(2.0)
        h = torch.nn.functional.relu(h, inplace=True)
        y = self.down(h)
        y.masked_fill_(x > 1.5, 0.25)
        return (y * y).sum(-1)


class _WrittenThroughAView(torch.nn.Module):
    """transformers' experts write their bias through a view (``bmm(...).squeeze(-1).add_(b)``):
    here a column of a split activation, read whole (gathered) through ``select`` and written in
    place. With ``read_after`` the activation is read after the write, which the write must show
    through."""

    def __init__(self, read_after: bool):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8, bias=False)
        self.read_after = read_after

    def forward(self, x):
        h = self.up(x)
        y = self.down(torch.relu(h))
        first = h.select(-1, 0)
        first.add_(1.0)
        if self.read_after:
            y = y + h[..., :8]
        return (y * y).sum(-1) + first * first


class _RowsWrittenInALoop(torch.nn.Module):
    """Gated DeltaNet's chunk loop (Qwen3-Next, Qwen3.5): a per-head matrix whose rows are
    written in place one by one through views, each row reading the rows written before it
    (``attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)``), between two products the
    planner splits by head."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.o = (torch.nn.Linear(16, 16, bias=False) for _ in range(3))

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 4).transpose(1, 2)
        k = self.k(x).view(b, s, 4, 4).transpose(1, 2)
        attn = (q @ k.transpose(-1, -2)).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(), 0)
        for i in range(1, s):
            row, sub = attn[..., i, :i].clone(), attn[..., :i, :i].clone()
            attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
        return self.o((attn @ q).transpose(1, 2).reshape(b, s, 16)).pow(2).sum()


def _rows_written_in_a_loop():
    from autotp.testing import equivalence_errors

    torch.manual_seed(0)
    model = _RowsWrittenInALoop().double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    pm = autotp.parallelize(model, 2, example_inputs=(x,), layout={"q.weight": "column", "k.weight": "column",
                                                                   "o.weight": "row"})
    return max(equivalence_errors(model, pm, {"x": x}).values()), dict(pm.plan.roles)


def _written_through_a_view(read_after: bool):
    from autotp.testing import equivalence_errors

    torch.manual_seed(0)
    model = _WrittenThroughAView(read_after).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    pm = autotp.parallelize(model, 2, example_inputs=(x,), layout={"up.weight": "column", "down.weight": "row"})
    try:
        return max(equivalence_errors(model, pm, {"x": x}).values())
    except RuntimeError as e:
        return str(e)


def _in_place_matches_serial():
    from autotp.testing import equivalence_errors

    torch.manual_seed(0)
    model = _InPlace().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    pm = autotp.parallelize(model, 2, example_inputs=(x,), layout={"up.weight": "column", "down.weight": "row"})
    errors = equivalence_errors(model, pm, {"x": torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))})
    placements = {n.target.__name__.split(".")[0]: str(n.meta.get("autotp_placement"))
                  for n in pm.graph_module.graph.nodes
                  if n.op == "call_function" and n.target.__name__.split(".")[0] in ("relu_", "mul_", "masked_fill_")}
    clones = sum(n.target is torch.ops.aten.clone.default for n in pm.graph_module.graph.nodes)
    return (max(errors.values()), placements, clones, _written_through_a_view(False), _written_through_a_view(True),
            _rows_written_in_a_loop())


def test_in_place_ops_keep_the_split_they_write_or_write_a_copy_of_a_converted_tensor(cluster_of):
    # Before, an in-place op without a rule of its own ran replicated on an all-gathered view,
    # which autograd refuses to let an op write ("Output 0 of _GatherFromTP is a view and is
    # being modified inplace"): an nn.ReLU(inplace=True) between the products failed to train.
    for worst, placements, clones, view, view_read_after, loop in cluster_of(2).run(_in_place_matches_serial):
        assert worst < 1e-12
        assert placements["relu_"].startswith("S(") and placements["mul_"].startswith("S("), placements
        assert placements["masked_fill_"] == "R" and clones == 1, (placements, clones)
        # written through a view of a gathered tensor: a copy is written (gpt-oss's experts bias)
        assert isinstance(view, float) and view < 1e-12, view
        # where the tensor is read after the write, a copy would hide the write from those reads
        # (and autograd refuses to write a collective's output through a view): the solver never
        # converts what a view written in place reads (GraphIndex.moves_written). Before, the
        # plan gathered it and the call failed ("Output 0 of Slice is a view and is being
        # modified inplace"): Qwen3-Next's and Qwen3.5's chunk loop after their mixers split by head
        assert isinstance(view_read_after, float) and view_read_after < 1e-12, view_read_after
        error, roles = loop
        assert error < 1e-12 and set(roles.values()) != {"replicate"}, (error, roles)


class _StateInABuffer(torch.nn.Module):
    """A recurrent layer's last state written into a ``zeros`` buffer, as transformers' cache does."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 32, bias=False)
        self.down = torch.nn.Linear(32, 16, bias=False)

    def forward(self, x):                                          # x: (b, s, 16)
        h = self.up(x)                                             # (b, s, 32)
        state = torch.zeros(x.shape[0], 32, dtype=h.dtype, device=h.device)
        state.copy_(h[:, -1])                                      # (b, 32): the last position's
        return self.down(torch.relu(state))                        # (b, 16)


def test_a_buffer_written_by_a_split_state_is_made_at_each_ranks_share():
    # copy_ had no rule: the split state was all-gathered into a whole buffer on every rank.
    # Now the buffer takes the state's shard and each rank makes its own 16 of the 32 columns
    # (a zeros at the local size, not a whole one sliced)
    from autotp.capture import capture
    from autotp.passes.rewrite import rewrite
    from autotp.planner import build_plan

    cap = capture(_StateInABuffer(), example_kwargs={"x": torch.randn(2, 8, 16)})
    layout = {"up.weight": "column", "down.weight": "row"}
    plan, index, prop = build_plan(cap, 2, batch=2, seq=8, profile="cpu-gloo", layout=layout)
    # nothing gathered into the buffer: it takes the state's split (a scatter of zeros, which
    # the rank program makes at its size)
    assert [(c.kind, c.tensor.split("_")[0]) for c in plan.comms] == [("f", "x"), ("scatter", "zeros"), ("g", "linear")]
    for rank in range(2):
        gm = rewrite(index, prop, rank, None, None)
        zeros = [n.args[0] for n in gm.graph.nodes if n.target is torch.ops.aten.zeros.default]
        assert len(zeros) == 1 and zeros[0][1] == 16, (rank, zeros)
        assert not any(name.startswith("scatter") for name, _ in gm.named_children()), gm.code


class _HeadsMergedForOneProduct(torch.nn.Module):
    """Mamba2's decode product: a state and C split by head, read as ``[b*h, ...]`` for one ``bmm``."""

    def __init__(self, heads: int = 4, d: int = 3, n: int = 2):
        super().__init__()
        self.heads, self.d, self.n = heads, d, n
        self.state = torch.nn.Linear(8, heads * d * n, bias=False)
        self.c = torch.nn.Linear(8, heads * n, bias=False)
        self.out = torch.nn.Linear(heads * d, 8, bias=False)

    def forward(self, x):                                          # x: (b, 8)
        b, h, d, n = x.shape[0], self.heads, self.d, self.n
        state = self.state(x).view(b, h, d, n)                     # (b, h, d, n), split by head
        c = self.c(x).view(b, h, n)                                # (b, h, n)
        y = torch.bmm(state.view(b * h, d, n), c.view(b * h, n, 1))   # (b*h, d, 1): the batch merged with h
        y = y * torch.rsqrt(y.pow(2).mean(1, keepdim=True) + 1e-6)   # a norm per head (a gated norm's)
        return self.out(torch.relu(y.view(b, h, d)).reshape(b, h * d))


def _heads_merged(tp: int, batch: int):
    from autotp.testing import equivalence_errors

    torch.manual_seed(0)
    model = _HeadsMergedForOneProduct().double()
    x = torch.randn(3, 8, dtype=torch.float64)
    pm = autotp.parallelize(model, tp, example_inputs=(x,), uneven=True,
                            layout={"state.weight": "column", "c.weight": "column", "out.weight": "row"})
    errors = equivalence_errors(model, pm, {"x": torch.randn(batch, 8, dtype=torch.float64)})
    placed = {str(n.target).split(".")[1]: str(n.meta.get("autotp_placement"))
              for n in pm.graph_module.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.bmm.default}
    return max(errors.values()), [c.kind for c in pm.plan.comms], placed


def test_a_merge_of_the_batch_with_split_heads_keeps_each_ranks_heads(cluster_of):
    # view(b * h, ...) of a tensor split by head merges the dynamic batch with a split dim, which
    # no Shard can say: the state and C were all-gathered for the bmm and its output sliced back
    # (Mamba2's decode step, every step). Now the merge makes the rank's rows (b runs of its
    # heads: P(tokens 0, by 4 heads)), the bmm and a norm over each head's features keep them, and the view
    # back is the heads' split again: nothing gathered, exact forward and backward (4 heads at
    # tp 3: one rank holds two).
    for tp, batch in ((2, 5), (3, 1)):
        for worst, kinds, placed in cluster_of(tp).run(_heads_merged, tp, batch):
            assert worst < 1e-12, worst
            assert sorted(kinds) == ["f", "g"], kinds   # x's gradient, out's sum
            assert placed == {"bmm": "P(tokens 0, by 4 heads)"}, placed


class _JoinedForADepthwiseConv(torch.nn.Module):
    """Gated DeltaNet's causal conv: q | k | v, each split by head, joined for one depthwise conv."""

    def __init__(self, k_heads: int = 2, dk: int = 4, v_heads: int = 4, dv: int = 4):
        super().__init__()
        self.sizes = [k_heads * dk, k_heads * dk, v_heads * dv]
        self.q, self.k, self.v = (torch.nn.Linear(8, n, bias=False) for n in self.sizes)
        c = sum(self.sizes)
        self.conv = torch.nn.Conv1d(c, c, 3, groups=c, padding=2, bias=False)
        self.out = torch.nn.Linear(self.sizes[0] + self.sizes[2], 8, bias=False)

    def forward(self, x):                                                    # x: (b, s, 8)
        qkv = torch.cat((self.q(x), self.k(x), self.v(x)), dim=-1)           # (b, s, c)
        y = self.conv(qkv.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)  # (b, s, c)
        q, k, v = torch.split(y, self.sizes, dim=-1)
        return self.out(torch.cat((q * k, v), dim=-1))


def _joined_for_a_conv():
    from autotp.testing import equivalence_errors

    torch.manual_seed(0)
    model = _JoinedForADepthwiseConv().double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    pm = autotp.parallelize(model, 2, example_inputs=(x,), layout={"q.weight": "column", "k.weight": "column",
                                                                   "v.weight": "column", "out.weight": "row"})
    errors = equivalence_errors(model, pm, {"x": torch.randn(3, 5, 8, dtype=torch.float64)})
    return max(errors.values()), [c.kind for c in pm.plan.comms], pm.plan.params["conv.weight"]


def test_heads_joined_along_their_split_dim_are_blocks_of_one_shard(cluster_of):
    # cat((q, k, v), -1) of tensors each split by head had no strategy but whole: the three were
    # all-gathered and the depthwise conv (and with it a recurrent layer's conv state) ran whole
    # on every rank. Now each input is a block of the joined dim, dealt as it was (q's, k's and
    # v's heads of a rank side by side: S(2x1:1:2)), and the conv splits by those channels.
    for worst, kinds, conv in cluster_of(2).run(_joined_for_a_conv):
        assert worst < 1e-12, worst
        assert sorted(kinds) == ["f", "g"], kinds
        assert isinstance(conv, Shard) and (conv.chunks, conv.sizes) == (3, (1, 1, 2)), conv


class _TokensWrittenIntoABuffer(torch.nn.Module):
    """Gated DeltaNet's recurrence: each position's output, per head, written into a slice of a
    ``zeros_like`` buffer (``out[:, :, i] = ...``), which is read after the loop."""

    def __init__(self, heads: int = 4, d: int = 2):
        super().__init__()
        self.heads, self.d = heads, d
        self.up = torch.nn.Linear(8, heads * d, bias=False)
        self.down = torch.nn.Linear(heads * d, 8, bias=False)

    def forward(self, x):                                                      # x: (b, s, 8)
        b, s = x.shape[0], x.shape[1]
        v = self.up(x).view(b, s, self.heads, self.d).transpose(1, 2)          # (b, h, s, d)
        out = torch.zeros_like(v)
        state = torch.zeros_like(v[:, :, 0])
        for i in range(s):
            state = state * 0.5 + v[:, :, i]
            out[:, :, i] = state.sin()
        return self.down(out.transpose(1, 2).reshape(b, s, self.heads * self.d))


def _written_into_a_buffer():
    from autotp.testing import equivalence_errors

    torch.manual_seed(0)
    model = _TokensWrittenIntoABuffer().double()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    pm = autotp.parallelize(model, 2, example_inputs=(x,), layout={"up.weight": "column", "down.weight": "row"})
    model.eval(), pm.eval()   # another program, planned by replaying the first one's plan op by op
    errors = equivalence_errors(model, pm, {"x": torch.randn(3, 3, 8, dtype=torch.float64)})
    assert len(pm._programs) == 2   # the training call's, the eval call's
    return max(errors.values()), [c.kind for c in pm._programs[-1].plan.comms]


def test_a_replayed_plan_keeps_a_buffer_split_where_its_writes_take_the_split(cluster_of):
    # A plan replayed op by op for another program (a generation step, an eval call) made every
    # tensor written later through a view whole, not looking ahead to the writes: the split
    # outputs were all-gathered into it (Qwen3-Next's decode step, each token's output by head).
    # Now it stays split where each view keeps the split and each write is a copy_.
    from autotp.capture import capture
    from autotp.planner import build_plan

    cap = capture(_TokensWrittenIntoABuffer(), example_kwargs={"x": torch.randn(2, 3, 8)})
    plan, _, _ = build_plan(cap, 2, batch=2, seq=3, profile="cpu-gloo",
                            layout={"up.weight": "column", "down.weight": "row"})
    replayed, _, prop = build_plan(cap, 2, batch=2, seq=3, profile="cpu-gloo", plan=plan)
    assert sorted(c.kind for c in replayed.comms) == ["f", "g"], replayed.comms
    copies = [s for n, s in prop.chosen.items() if n.target is torch.ops.aten.copy_.default]
    assert len(copies) == 3 and all(isinstance(s.output, Shard) for s in copies), copies
    for worst, kinds in cluster_of(2).run(_written_into_a_buffer):
        assert worst < 1e-12, worst
        assert "all_gather" not in kinds, kinds


class _KeysWrittenIntoAnEmpty(torch.nn.Module):
    """DeepSeek-V3's MLA keys: a ``new_empty`` written through two slices (each head's own part and
    the rotary part shared by every head), then read whole by attention split by head."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(8, 4 * 10, bias=False)
        self.v = torch.nn.Linear(8, 4 * 10, bias=False)
        self.nope = torch.nn.Linear(8, 4 * 6, bias=False)
        self.rot = torch.nn.Linear(8, 4, bias=False)
        self.out = torch.nn.Linear(4 * 10, 8, bias=False)

    def forward(self, x):                                          # x: (b, s, 8)
        b, s = x.shape[:2]
        q = self.q(x).view(b, s, 4, 10).transpose(1, 2)
        v = self.v(x).view(b, s, 4, 10).transpose(1, 2)
        nope = self.nope(x).view(b, s, 4, 6).transpose(1, 2)
        rot = self.rot(x).view(b, 1, s, 4).expand(-1, 4, -1, -1)
        keys = nope.new_empty(b, 4, s, 10)
        keys[..., :6].copy_(nope)
        keys[..., 6:].copy_(rot)
        y = torch.nn.functional.scaled_dot_product_attention(q, keys, v)
        return self.out(y.transpose(1, 2).reshape(b, s, 40))


def _keys_written_into_an_empty():
    from autotp.testing import equivalence_errors

    torch.manual_seed(0)
    model = _KeysWrittenIntoAnEmpty().double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    pm = autotp.parallelize(model, 2, example_inputs=(x,), layout={
        "q.weight": "column", "v.weight": "column", "out.weight": "row", "nope.weight": "replicate"})
    errors = equivalence_errors(model, pm, {"x": torch.randn(3, 5, 8, dtype=torch.float64)})
    empties = sum(n.target is torch.ops.aten.new_empty.default for n in pm.graph_module.graph.nodes)
    return max(errors.values()), empties, [c.kind for c in pm.plan.comms]


def test_a_factory_written_in_place_is_sliced_not_made_again_at_the_ranks_size(cluster_of):
    # A conversion of a factory's output to a shard is the factory made again at the rank's size
    # (a recurrent state's zeros buffer), which is right only before anything writes it: the keys
    # written into a new_empty and then split by head for attention were made again, empty,
    # and attention read uninitialized keys (DeepSeek-V3 at tp 2: logits off by 2e-3, MLA's
    # gradients by 1). Now a factory written before the conversion is sliced.
    for worst, empties, kinds in cluster_of(2).run(_keys_written_into_an_empty):
        assert "scatter" in kinds, kinds   # the keys are split after the writes
        assert empties == 1, empties
        assert worst < 1e-12, worst
