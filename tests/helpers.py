"""Small GPT-2 builders shared by the tests (random weights, real HF classes, no hub), and one rank
of a world on torch's fake backend."""
from __future__ import annotations

import contextlib

import torch


def tiny_gpt2(n_layer: int = 2, n_head: int = 4, head_dim: int = 8, vocab: int = 100, n_positions: int = 32,
              dtype: torch.dtype = torch.float64, seed: int = 0, device: str | None = None):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_head * head_dim, vocab_size=vocab,
                        n_positions=n_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if device == "meta":
        with torch.device("meta"):
            return GPT2LMHeadModel(config).to(dtype)
    return GPT2LMHeadModel(config).to(dtype)


def batch(vocab: int, b: int = 2, s: int = 7, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, vocab, (b, s), generator=gen),
            "labels": torch.randint(0, vocab, (b, s), generator=gen)}


def whole(t: torch.Tensor) -> torch.Tensor:
    """A parallel model's output whole: logits kept split come back as a DTensor (a call with
    labels, by default), gathered here."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def outcome(fn, *args) -> str:
    """What ``fn`` did on this rank: ``returned``, or ``Type: message``."""
    try:
        fn(*args)
        return "returned"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def call_while_another_runs(pm, first, second) -> tuple[str, object]:
    """``first()`` in another thread, held inside ``pm``'s call until ``second()`` (this thread)
    has run: (what ``second`` did, :func:`outcome`; what ``first`` returned)."""
    import threading

    inside, release = threading.Event(), threading.Event()
    run, results = pm._run, []

    def held(*args, **kwargs):   # the first call stays inside until released
        inside.set()
        assert release.wait(60)
        return run(*args, **kwargs)

    pm._run = held
    thread = threading.Thread(target=lambda: results.append(first()))
    thread.start()
    try:
        assert inside.wait(60)
        done = outcome(second)
    finally:
        release.set()
        thread.join(60)
    return done, results[0]


def expert_runs(experts: int, tp: int) -> tuple[tuple[int, int], ...]:
    """Each rank's run of ``experts`` dealt over ``tp`` ranks: (first expert, count), (0, 0)
    for a rank with none."""
    from autotp.placements import Shard, local_ranges

    out = []
    for r in range(tp):
        ((start, stop),) = local_ranges(experts, Shard(0), tp, r) or ((0, 0),)
        out.append((start, stop - start))
    return tuple(out)


class AtenOps:
    """The ATen ops run while active (forward and the autograd engine's backward calls):
    ``names`` as ``sum``, ``_c10d_functional.all_to_all_single``; ``seen`` as (the op's short
    name, the largest first dim of its tensor arguments)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        names, seen = self.names, self.seen = [], []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                names.append(str(func.overloadpacket).replace("aten::", "").removeprefix("aten."))
                rows = [a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.ndim]
                seen.append((func.overloadpacket.__name__, max(rows, default=0)))
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


#: a Mixtral-like model's layout with its experts split whole (expert parallelism) and everything
#: before the router replicated: no g whose fake all-reduce would leave a fake-backend rank only
#: its part, so the rank routes exactly as serial does (its experts' rows countable against serial)
EXPERTS_ALONE_SPLIT = {"*.experts.gate_up_proj": "expert", "*.experts.down_proj": "expert",
                       "model.embed_tokens.weight": "replicate", "*self_attn.*": "replicate"}


@contextlib.contextmanager
def fake_process_group(tp: int, rank: int = 0):
    """Rank ``rank`` of a tp-``tp`` world on torch's ``fake`` backend, in this process (its group
    yielded): collectives return at once, so a rank's program runs, and is counted, at its own
    size. A world already initialized is destroyed first; this one is on leaving."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=tp, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
