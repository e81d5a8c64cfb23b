"""Main job: parallelize GPT-2 (124M config) over 4 local gloo ranks and check it.

    python3 dev.py main                                   # via the repo's venv, local ranks
    python examples/gpt2_tp.py --tp 4                     # same, already in the venv
    torchrun --nproc-per-node 4 examples/gpt2_tp.py       # under torchrun

Every rank builds the same randomly initialized GPT2LMHeadModel (no hub needed), calls
``autotp.parallelize(model, tp)``, runs one forward and backward on the same batch as the serial
model, and compares loss, logits and every parameter's gradient. Rank 0 prints the plan, the
errors and each rank's parameter bytes next to the serial model's.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def run(args: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    import autotp
    from autotp.testing import TOLERANCE, equivalence_errors

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).to(getattr(torch, args.dtype))
    gen = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen),
              "labels": torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen)}
    start = time.perf_counter()
    pm = autotp.parallelize(model, tp=args.tp, profile=args.profile)
    setup_s = time.perf_counter() - start
    errors = equivalence_errors(model, pm, inputs)
    local_bytes = sum(p.numel() * p.element_size() for p in pm.local_parameters().values())
    serial_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    worst = max(errors, key=errors.get)
    result = {"rank": dist.get_rank(), "tp_rank": pm.mesh.tp_rank, "loss_err": errors["loss"],
              "logits_err": errors["logits"], "worst": worst, "worst_err": errors[worst],
              "local_bytes": local_bytes, "serial_bytes": serial_bytes, "setup_s": setup_s,
              "bound": TOLERANCE[getattr(torch, args.dtype)]}
    if dist.get_rank() == 0:
        result["plan"] = str(pm.plan)
        result["code"] = "\n".join(l for l in pm.graph_module.code.splitlines()
                                   if any(k in l for k in ("self.f_", "self.g_", "all_gather", "vocab_parallel")))
    return result


def report(results: list[dict], args: argparse.Namespace) -> int:
    first = results[0]
    print(first["plan"])
    print("comm nodes in rank 0's rewritten graph (print(pm.graph_module.code) shows them all):")
    print("\n".join(first["code"].splitlines()[:12]), "\n    ...")
    print(f"\nchecked against the serial model (dtype {args.dtype}, batch {args.batch}, seq {args.seq}):")
    ok = True
    for r in results:
        good = r["worst_err"] <= r["bound"]
        ok &= good
        print(f"  rank {r['rank']} (tp rank {r['tp_rank']}): loss rel err {r['loss_err']:.2e}, logits {r['logits_err']:.2e}, "
              f"worst grad {r['worst']} {r['worst_err']:.2e}  [{'ok' if good else 'FAIL'} <= {r['bound']:.0e}]  "
              f"params {r['local_bytes'] / 1e6:.1f} MB vs serial {r['serial_bytes'] / 1e6:.1f} MB "
              f"({r['local_bytes'] / r['serial_bytes']:.1%})  setup {r['setup_s']:.1f} s")
    print("\nPASS: the parallel model computes what the serial one does" if ok else "\nFAIL")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--profile", default=None, help="device profile the planner prices with")
    args = parser.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:      # under torchrun
        from autotp.distributed.mesh import init_from_env

        init_from_env()
        result = run(args)
        import torch.distributed as dist

        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        rank = dist.get_rank()
        dist.destroy_process_group()   # every rank leaves the group before any exits
        code = report(results, args) if rank == 0 else 0
        # The job is done and reported. Skip the interpreter's C++ teardown: under torchrun a rank
        # aborted in a static destructor after this point in 2 of 6-8 runs ("terminate called
        # without an active exception", exit -6, so torchrun failed a passed job); not reproduced
        # by a bare gloo job with an export, cause not found yet.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    from autotp.testing import launch, preload

    # the ranks fork from one process that has imported these, instead of each importing them
    preload("transformers", "transformers.models.gpt2.modeling_gpt2")
    return report(launch(run, args.tp, args, timeout=900.0), args)


if __name__ == "__main__":
    sys.exit(main())
