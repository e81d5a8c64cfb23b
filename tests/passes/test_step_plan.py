"""A generation step's plan: generate runs every step under ``torch.no_grad()``, so the step is
planned as it runs, forward only (one process, a tiny model on the meta device)."""
import torch

import autotp
from autotp import zoo
from autotp.generation import StepSpec, capture_step
from autotp.passes.propagate import grad_nodes
from autotp.planner.planner import build_plan


def test_a_generation_step_is_priced_forward_only_and_places_no_f():
    # Before, a step was priced as if trained: an f's backward all-reduce (of a gradient never
    # computed) made a decode step of Mamba with Megatron's layout all-gather its split SSM state
    # for ``ssm_state @ C`` rather than keep it split (docs/architecture.md, "Recurrent states")
    config = zoo.tiny_config("llama", layers=1, heads=4, kv_heads=4, head_dim=8, vocab=64)
    model = zoo.build("llama", config, device="meta").eval()
    plan = autotp.plan(model, tp=2, layout={"*q_proj.weight": "column", "*k_proj.weight": "column",
                                            "*v_proj.weight": "column", "*o_proj.weight": "row"})
    ids = torch.ones(2, 5, dtype=torch.long)
    spec = StepSpec({"input_ids": ids})
    cap = capture_step(model, spec)
    assert not cap.differentiable and grad_nodes(cap) == frozenset()
    step, *_ = build_plan(cap, 2, batch=8, seq=64, plan=plan, gather_logits=True, keep_split=spec.keep_split(cap))
    assert step.comms and all(c.kind not in ("f", "all_gather_f") and c.bwd_bytes == 0 for c in step.comms), step.comms
