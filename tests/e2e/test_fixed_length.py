"""A model whose program holds one sequence length: Mamba on CPU.

transformers' Mamba without its kernels runs a Python loop over the sequence; torch.export
unrolls it, so the dim capture asked dynamic comes out a number (``Capture.fixed_dims``). The
call at the captured length must equal serial (float64: loss, logits, every gradient; then an
inference call), a call at another length is an autotp ``InputError`` naming both lengths and
the fix, and ``generate`` an autotp ``ConfigError`` (Mamba's cache is a recurrent state). One
task on a two-rank cluster; the out-projection pinned row-parallel so that the program runs
split compute and a collective, not a replicated model."""
import pytest
import torch

from autotp.testing import TOLERANCE

LENGTH = 6


def fixed_length_calls() -> dict:
    import autotp
    from autotp import zoo
    from autotp.testing import equivalence_errors

    config = zoo.tiny_config("mamba", layers=2, heads=2, head_dim=8, vocab=64)
    model = zoo.build("mamba", config, dtype=torch.float64)
    batch = zoo.example_batch("mamba", config, batch=2, seq=LENGTH)
    pm = autotp.parallelize(model, 2, example_kwargs=batch, layout={"*.out_proj.weight": "row"})
    out = {"fixed": dict(pm.capture.fixed_dims), "held": sum(p.numel() for p in pm.local_parameters().values()),
           "serial": sum(p.numel() for p in model.parameters())}
    out["train"] = max(equivalence_errors(model, pm, batch).values())
    model.eval()
    pm.eval()
    with torch.no_grad():
        out["infer"] = (pm(input_ids=batch["input_ids"]).logits - model(input_ids=batch["input_ids"]).logits).abs().max().item()
    refused = {}
    for name, call in {"shorter": lambda: pm(input_ids=batch["input_ids"][:, :LENGTH - 1]),
                       "generate": lambda: pm.generate(batch["input_ids"][:1, :3], max_new_tokens=2)}.items():
        try:
            call()
            refused[name] = None
        except Exception as exc:   # the test asserts which class: any other is a failure
            refused[name] = (type(exc).__name__, isinstance(exc, autotp.AutotpError), str(exc))
    out["refused"] = refused
    return out


def test_a_program_fixed_to_one_length_equals_serial_there_and_refuses_others(cluster_of):
    results = cluster_of(2).run(fixed_length_calls)
    for r in results:
        assert r["fixed"] == {"input_ids.1": LENGTH, "labels.1": LENGTH}
        assert r["held"] < r["serial"], "the pinned row split must hold a share of out_proj per rank"
        assert r["train"] <= TOLERANCE[torch.float64]
        assert r["infer"] <= TOLERANCE[torch.float64]
        kind, ours, text = r["refused"]["shorter"]
        assert (kind, ours) == ("InputError", True)
        assert f"{LENGTH - 1} elements in dim 1" in text and f"captured at {LENGTH}" in text and "Pad input_ids" in text
        kind, ours, text = r["refused"]["generate"]
        assert (kind, ours) == ("ConfigError", True)
        assert "recurrent state" in text and "LinearAttentionLayer" in text
