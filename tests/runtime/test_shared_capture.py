"""A TP group captures once: rank 0 captures and sends, the others load (or keep what they hold);
a program that cannot be sent is captured by every rank itself (autotp/distributed/captures.py).
And it searches its plans once: rank 0 searches and sends what it chose, the others rebuild the
plan from it; one that does not rebuild is searched by the rank itself (autotp/distributed/plans.py)."""
from tests.helpers import batch, tiny_gpt2


def _exchanges(tp: int) -> dict:
    """The capture exchanges and cache counts of three parallelizes of one structure, then an
    inference call's program, then a parallelize whose capture rank 0 cannot send."""
    import torch

    import autotp
    from autotp.capture import cache as capture_cache
    from autotp.capture import wire
    from autotp.distributed import captures, plans
    from autotp.distributed.mesh import get_mesh
    from autotp.planner import planner

    def counts() -> dict:
        return {**captures.stats(), **{f"cache {k}": v for k, v in capture_cache.stats().items()},
                **{f"plan {k}": v for k, v in plans.stats().items()}}

    def delta(before: dict) -> dict:
        return {k: v - before.get(k, 0) for k, v in counts().items() if k != "cache entries"}

    out = {}
    capture_cache.clear()
    before = counts()
    model = tiny_gpt2(n_layer=1, seed=0)
    pm = autotp.parallelize(model, tp=tp)
    out["first"] = delta(before)
    before = counts()
    autotp.parallelize(tiny_gpt2(n_layer=1, seed=1), tp=tp)
    out["again"] = delta(before)
    before = counts()
    data = batch(100, s=6)
    pm.eval()
    with torch.no_grad():
        got = pm(input_ids=data["input_ids"]).logits
        want = model.eval()(input_ids=data["input_ids"]).logits
    out["inference"] = delta(before)
    out["inference error"] = float((got.full_tensor() if hasattr(got, "full_tensor") else got).sub(want).abs().max())

    real = wire.dumps
    if get_mesh(tp).tp_rank == 0:
        def refuse(cap):
            raise wire.WireError("a program this pickle cannot write")
        wire.dumps = refuse
    try:
        capture_cache.clear()
        before = counts()
        autotp.parallelize(tiny_gpt2(n_layer=2, seed=0), tp=tp)
        out["unsent"] = delta(before)
    finally:
        wire.dumps = real

    # a plan that does not rebuild where it is sent (its digest not the rebuilt one's): every
    # other rank searches its own, and computes what the serial model does all the same
    real = planner.digest
    if get_mesh(tp).tp_rank == 0:
        planner.digest = lambda index, prop: "not the plan's"
    try:
        before = counts()
        model = tiny_gpt2(n_layer=2, seed=2)
        pm = autotp.parallelize(model, tp=tp)
        out["unrebuilt"] = {k: v for k, v in delta(before).items() if k.startswith("plan")}
    finally:
        planner.digest = real
    with torch.no_grad():
        got = pm.eval()(input_ids=data["input_ids"]).logits
        want = model.eval()(input_ids=data["input_ids"]).logits
    out["unrebuilt error"] = float((got.full_tensor() if hasattr(got, "full_tensor") else got).sub(want).abs().max())
    return out


def test_one_rank_captures_and_the_others_load(cluster):
    results = cluster.run(_exchanges, 4)
    for rank, r in enumerate(results):
        # rank 0 searches each plan and sends what it chose; the others rebuild it
        planned = ({"plan sent": 1, "plan rebuilt": 0, "plan made": 0} if rank == 0
                   else {"plan sent": 0, "plan rebuilt": 1, "plan made": 0})
        if rank == 0:
            assert r["first"] == {"sent": 1, "loaded": 0, "made": 0, "held": 0, "cache hits": 0, "cache misses": 1,
                                  **planned}
            assert r["unsent"]["sent"] == 0 and r["unsent"]["cache misses"] == 1
        else:   # loaded rank 0's, exported nothing
            assert r["first"] == {"sent": 0, "loaded": 1, "made": 0, "held": 0, "cache hits": 0, "cache misses": 0,
                                  **planned}
            assert r["unsent"] == {"sent": 0, "loaded": 0, "made": 1, "held": 0, "cache hits": 0, "cache misses": 1,
                                   **planned}
        # the same structure again: every rank holds it, nothing is sent (the plan is searched again)
        assert r["again"] == {"sent": 0, "loaded": 0, "made": 0, "held": 1, "cache hits": 1, "cache misses": 0,
                              **planned}
        # an inference call's program (another capture: the model in eval mode) is sent again, and its plan
        assert r["inference"]["sent" if rank == 0 else "loaded"] == 1, r["inference"]
        assert r["inference"]["plan sent" if rank == 0 else "plan rebuilt"] == 1, r["inference"]
        assert r["inference error"] <= 1e-12
        # a plan sent that does not rebuild: the rank searched its own
        assert r["unrebuilt"] == (planned if rank == 0 else {"plan sent": 0, "plan rebuilt": 0, "plan made": 1})
        assert r["unrebuilt error"] <= 1e-12


def test_the_key_sent_with_a_capture_names_the_devices_with_their_index():
    # a capture traced on cuda:0 holds that device; a rank whose model lies on cuda:1 takes its own
    import torch

    from autotp.distributed.captures import placed

    model = tiny_gpt2(n_layer=1)
    assert placed("k", model) == "k on cpu"
    assert placed("k", model, {"input_ids": torch.ones(2, 3, device="meta"), "use_cache": False}) == "k on cpu,meta"
    assert placed(None, model) is None      # a model the key cannot read is not shared
