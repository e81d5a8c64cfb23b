"""A model whose program holds one sequence length: Mamba on CPU.

transformers' Mamba without its kernels runs a Python loop over the sequence; torch.export
unrolls it, so the dim capture asked dynamic comes out a number (``Capture.fixed_dims``). The
call at the captured length must equal serial (float64: loss, logits, every gradient; then an
inference call); a call at another length gets a program traced at its own length and equals
serial too, and so does a left-padded call (its mask has the ids' length: the mask's dim is kept
with them, not given an example length of its own); greedy ``generate`` gives the serial model's
tokens (Mamba's cache is a recurrent state: its conv and SSM states go from step to step as the
plan leaves them; the prompt's program is traced at the prompt's length, each decode step is one
token). One task on a two-rank cluster; the out-projection pinned row-parallel so that the program
runs split compute and a collective, not a replicated model."""
import pytest
import torch

from autotp.testing import TOLERANCE

LENGTH = 6


def fixed_length_calls(sequence_parallel: bool | None = None) -> dict:
    import autotp
    from autotp import zoo
    from autotp.testing import equivalence_errors

    config = zoo.tiny_config("mamba", layers=2, heads=2, head_dim=8, vocab=64)
    model = zoo.build("mamba", config, dtype=torch.float64)
    batch = zoo.example_batch("mamba", config, batch=2, seq=LENGTH)
    pm = autotp.parallelize(model, 2, example_kwargs=batch, layout={"*.out_proj.weight": "row"},
                            sequence_parallel=sequence_parallel)
    out = {"fixed": dict(pm.capture.fixed_dims), "held": sum(p.numel() for p in pm.local_parameters().values()),
           "serial": sum(p.numel() for p in model.parameters())}
    out["train"] = max(equivalence_errors(model, pm, batch).values())
    shorter = {k: v[:, :LENGTH - 2] for k, v in batch.items()}
    out["shorter"] = max(equivalence_errors(model, pm, shorter).values())
    model.eval()
    pm.eval()
    ids = batch["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, :2] = 0   # row 0 left-padded by two
    with torch.no_grad():
        out["infer"] = (pm(input_ids=ids).logits - model(input_ids=ids).logits).abs().max().item()
        out["padded"] = (pm(input_ids=ids, attention_mask=mask).logits
                         - model(input_ids=ids, attention_mask=mask).logits).abs().max().item()
    out["programs"] = len(pm._programs)
    out["generate"] = (pm.generate(ids[:, :3], max_new_tokens=3, eos_token_id=None).tolist(),
                       model.generate(ids[:, :3], max_new_tokens=3, do_sample=False, eos_token_id=None,
                                      pad_token_id=0).tolist())
    out["along_s"] = [((p.step or "call"), tuple(p.capture.fixed_dims.values()),
                       sum(c.kind == "reduce_scatter" and c.dst == "S(1)" for c in p.plan.comms)) for p in pm.programs]
    return out


@pytest.mark.slow   # 22-31 s on two cores; the fast tier runs a fixed-length program against serial on every
#                     call below (sequence parallelism forced) and plans Mamba at tp 8 with its sequence
#                     fixed (tests/passes/test_recurrent_plan.py)
def test_a_program_fixed_to_one_length_equals_serial_there_and_other_lengths_get_their_own(cluster_of):
    results = cluster_of(2).run(fixed_length_calls)
    for r in results:
        assert r["fixed"] == {"input_ids.1": LENGTH, "labels.1": LENGTH}
        assert r["held"] < r["serial"], "the pinned row split must hold a share of out_proj per rank"
        for call in ("train", "shorter", "infer", "padded"):
            assert r[call] <= TOLERANCE[torch.float64], (call, r[call])
        assert r["programs"] == 4   # train at 6, train at 4, inference, inference with a mask
        got, serial = r["generate"]
        assert got == serial


@pytest.mark.slow   # 25-33 s on two cores; the fast tier forces it on a length export fixed, against serial
# (tests/runtime/test_sequence_forced_programs.py)
def test_sequence_parallelism_forced_splits_a_length_the_program_holds_fixed(cluster_of):
    # Mamba's program holds the length as a number: before, sequence_parallel=True found no dynamic
    # sequence dim and planned every program by cost, unsaid (no reduce-scatter along s anywhere).
    # A static length is still a sequence: each layer's residual region runs on the rank's tokens
    # (6 split 3 + 3, the shorter call's 4 split 2 + 2, the 3-token prompt 2 + 1), equal to serial
    results = cluster_of(2).run(fixed_length_calls, True)
    for r in results:
        for call in ("train", "shorter", "infer", "padded"):
            assert r[call] <= TOLERANCE[torch.float64], (call, r[call])
        got, serial = r["generate"]
        assert got == serial
        # train at 6, train at 4, inference, inference with a mask, the prompt's prefill: the two
        # layers' regions each; the decode step (one token a row) none
        assert r["along_s"] == [("call", (6, 6), 2), ("call", (4, 4), 2), ("call", (6,), 2), ("call", (6, 6), 2),
                                ("prefill", (3,), 2), ("decode", (), 0)], r["along_s"]
