"""A short GPT-2 training run on a DP x TP mesh, logged step by step beside the serial run.

    python examples/train_gpt2.py                              # 4 local gloo ranks: dp 2 x tp 2
    python examples/train_gpt2.py --world 2 --tp 2 --steps 20
    python examples/train_gpt2.py --world 8 --tp 2 --pp 2 --layers 4   # PTD-P: dp 2 x pp 2 x tp 2
    torchrun --nproc-per-node 4 examples/train_gpt2.py --tp 2  # under torchrun

Every rank builds the same randomly initialized GPT-2 (a small config: no hub needed) and
parallelizes it with ``autotp.parallelize(model, tp)``; the world's other factor is data
parallelism. Each step draws one global batch of random tokens, each DP rank trains on its
slice, and AdamW updates the local shards (gradients are averaged over the DP group). Every
rank also trains the serial model on the whole batch, so rank 0 can print both loss curves;
with dropout off they agree to rounding. ``--pp 2`` also cuts the layers into two pipeline
stages (``pm.step`` runs the 1F1B schedule on ``--microbatches`` micro-batches: the loss is their
mean, the serial loss's when they count the same tokens). ``--dropout 0.1`` trains with dropout: the curves
then differ (different masks), and replicated parameters still stay identical across TP ranks.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def train(args: argparse.Namespace) -> list[dict]:
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    import autotp
    from autotp.testing import keep_loss_precision

    hf_logging.set_verbosity_error()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_head=args.heads, n_embd=args.heads * 16, vocab_size=args.vocab,
                        n_positions=args.seq, resid_pdrop=args.dropout, embd_pdrop=args.dropout,
                        attn_pdrop=args.dropout)
    serial = GPT2LMHeadModel(config).to(dtype)
    if dtype == torch.float64:
        keep_loss_precision(serial)   # HF's loss would otherwise run in float32
    piped = args.pp > 1
    pm = autotp.parallelize(serial, tp=args.tp, gather_logits=False,
                            **({"pp": args.pp, "microbatches": args.microbatches} if piped else {}))
    dp, dp_rank = pm.mesh.dp, pm.mesh.dp_rank
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr, weight_decay=0.01)
    serial_opt = torch.optim.AdamW(serial.parameters(), lr=args.lr, weight_decay=0.01)
    log = []
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, args.vocab, (args.batch * dp, args.seq), generator=gen)
        mine = ids[dp_rank * args.batch:(dp_rank + 1) * args.batch]
        start = time.perf_counter()
        opt.zero_grad()
        if piped:    # forward and backward over the pipeline's micro-batches
            loss = pm.step(input_ids=mine, labels=mine)
        else:
            loss = pm(input_ids=mine, labels=mine).loss
            loss.backward()
        opt.step()
        seconds = time.perf_counter() - start
        mean = loss.detach().clone()
        if pm.mesh.dp_group is not None:   # the global batch's loss: the mean of the DP ranks'
            dist.all_reduce(mean, group=pm.mesh.dp_group)
            mean /= dp
        serial_opt.zero_grad()
        serial_loss = serial(input_ids=ids, labels=ids).loss
        serial_loss.backward()
        serial_opt.step()
        log.append({"step": step, "loss": mean.item(), "serial": serial_loss.item(), "seconds": seconds})
    return log


def report(logs: list[list[dict]], args: argparse.Namespace) -> int:
    log = logs[0]
    bound = {"float64": 1e-9, "float32": 1e-4}[args.dtype] * 100   # rounding grows over the steps
    stages = f"pp {args.pp} x " if args.pp > 1 else ""
    print(f"GPT-2 ({args.layers} layers, {args.heads} heads), world {args.world} = dp {args.world // (args.tp * args.pp)} x "
          f"{stages}tp {args.tp}, batch {args.batch} per DP rank, seq {args.seq}, {args.dtype}, dropout {args.dropout}")
    print(f"{'step':>4}  {'parallel loss':>14}  {'serial loss':>12}  {'rel diff':>9}  {'step s':>7}")
    worst = 0.0
    for row in log:
        diff = abs(row["loss"] - row["serial"]) / abs(row["serial"])
        worst = max(worst, diff)
        print(f"{row['step']:>4}  {row['loss']:>14.6f}  {row['serial']:>12.6f}  {diff:>9.1e}  {row['seconds']:>7.2f}")
    if args.dropout > 0:
        print("dropout on: the parallel run draws its own masks, so the curves differ by design")
        return 0
    ok = worst <= bound
    print(f"{'PASS' if ok else 'FAIL'}: the loss curves agree (worst relative difference {worst:.1e}, bound {bound:.0e})")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4, help="local ranks to start (ignored under torchrun)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (PTD-P)")
    parser.add_argument("--microbatches", type=int, default=2, help="micro-batches per step under --pp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    args = parser.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:      # under torchrun
        import torch.distributed as dist

        from autotp.distributed.mesh import init_from_env

        init_from_env()
        args.world = dist.get_world_size()
        log = train(args)
        rank = dist.get_rank()
        dist.destroy_process_group()   # every rank leaves the group before any exits
        code = report([log], args) if rank == 0 else 0
        # The job is done and reported. Skip the interpreter's C++ teardown: under torchrun a rank
        # aborted in a static destructor after this point in 2 of 6-8 runs ("terminate called
        # without an active exception", exit -6, so torchrun failed a passed job); not reproduced
        # by a bare gloo job with an export, cause not found yet.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    from autotp.testing import launch

    return report(launch(train, args.world, args, timeout=900.0), args)


if __name__ == "__main__":
    sys.exit(main())
