"""A training checkpoint never loses data and never loads wrong (autotp.runtime.dcp,
autotp.runtime.checkpoint.dcp_safety): damaged, swapped or foreign files are refused on every rank; the
retired per-rank save_sharded/load_sharded go the same way; concurrent saves are serialized; a
checkpoint of another depth, a file at the path and a save cut short between its renames get a
clear CheckpointError; DCP's own errors come with the reason first. Each test was a probe that
failed (loaded silently, hung, or raised a raw error) before."""
import os

import pytest
import torch

import autotp

VOCAB = 16
#: Megatron's layout pinned: at these sizes the cost model would replicate everything, and
#: swapped rank files of replicated weights would be the same bytes
LAYOUT = {"*.c_attn.weight": "column", "*.mlp.c_fc.weight": "column", "*.attn.c_proj.weight": "row",
          "*.mlp.c_proj.weight": "row", "lm_head.weight": "vocab"}


def _model(seed: int, layers: int = 1):
    from tests.helpers import tiny_gpt2

    return tiny_gpt2(n_layer=layers, n_head=4, head_dim=2, vocab=VOCAB, seed=seed)


def _full(pm) -> dict:
    return {n: p.full_tensor().clone() for n, p in pm.named_parameters()}


def _outcome(fn) -> tuple:
    """("ok", value) or (error type, message): a rank's own result, every rank's compared."""
    try:
        return ("ok", fn())
    except BaseException as exc:  # CheckpointException is a BaseException
        return (type(exc).__name__, str(exc))


def _data_files(folder: str) -> list[str]:
    """The tensor files of a checkpoint (the retired format's or DCP's), largest first."""
    names = [f for f in os.listdir(folder) if f.endswith((".safetensors", ".distcp"))]
    return sorted(names, key=lambda f: (-os.path.getsize(os.path.join(folder, f)), f))


def _damage(root: str) -> dict:
    """Save a model with the retired save_sharded (now DCP), then load copies damaged four ways."""
    import shutil
    import warnings

    import torch.distributed as dist

    from autotp.runtime.checkpoint import load_sharded, save_sharded

    warnings.simplefilter("ignore", FutureWarning)
    saved = autotp.parallelize(_model(1), tp=2, layout=LAYOUT)
    other = autotp.parallelize(_model(2), tp=2, layout=LAYOUT)      # another model under the same plan
    save_sharded(saved, f"{root}/good")
    save_sharded(other, f"{root}/other")
    dist.barrier()      # the retired save_sharded returned before the other ranks had written
    kinds = ("swapped", "foreign", "bit flip", "truncated")
    if dist.get_rank() == 0:
        for kind in kinds:
            copy = f"{root}/{kind}"
            shutil.copytree(f"{root}/good", copy)
            a, b = _data_files(copy)[:2]
            if kind == "swapped":          # two ranks' files trade places
                os.rename(f"{copy}/{a}", f"{copy}/tmp")
                os.rename(f"{copy}/{b}", f"{copy}/{a}")
                os.rename(f"{copy}/tmp", f"{copy}/{b}")
            elif kind == "foreign":        # one file from the other model's save
                shutil.copy(f"{root}/other/{a}", f"{copy}/{a}")
            elif kind == "bit flip":       # one bit of a stored float
                with open(f"{copy}/{a}", "r+b") as f:
                    f.seek(os.path.getsize(f"{copy}/{a}") // 2)
                    byte = f.read(1)[0]
                    f.seek(-1, 1)
                    f.write(bytes([byte ^ 0x40]))
            else:                          # a file cut short
                with open(f"{copy}/{a}", "r+b") as f:
                    f.truncate(os.path.getsize(f"{copy}/{a}") - 16)
    dist.barrier()
    want = _full(saved)
    results = {}
    for kind in (*kinds, "good"):
        loading = autotp.parallelize(_model(3), tp=2, layout=LAYOUT)

        def load(path=f"{root}/{kind}"):
            load_sharded(loading, path)
            got = _full(loading)
            return max((got[n] - want[n]).abs().max().item() for n in want)

        results[kind] = _outcome(load)
    return results


@pytest.fixture(scope="module")
def damaged(cluster, tmp_path_factory):
    return cluster.run(_damage, str(tmp_path_factory.mktemp("damage")))


def test_the_retired_save_sharded_resumes_bit_for_bit(damaged):
    assert all(r["good"] == ("ok", 0.0) for r in damaged)


@pytest.mark.parametrize("kind", ["swapped", "foreign", "bit flip", "truncated"])
def test_a_damaged_or_mixed_checkpoint_is_refused_on_every_rank_naming_the_file(damaged, kind):
    # before: swapped rank files, another model's file and a flipped bit loaded silently (a bit
    # flip gave NaN logits); a truncated file failed on its own rank only
    outcomes = [r[kind] for r in damaged]
    assert all(kind == "CheckpointError" for kind, _ in outcomes), outcomes
    assert len({message for _, message in outcomes}) == 1, outcomes      # the same error everywhere
    message = outcomes[0][1]
    assert "the checkpoint is damaged and is not loaded" in message
    assert any(name in message for name in (".distcp", ".metadata")), message


def _two_async_saves(root: str) -> dict:
    from autotp.runtime.checkpoint import dcp

    pm = autotp.parallelize(_model(1), tp=2)
    first = _full(pm)
    earlier = dcp.async_save(pm, f"{root}/a")
    with torch.no_grad():
        for p in pm.parameters():
            p.to_local().add_(1.0)
    second = _full(pm)
    later = dcp.async_save(pm, f"{root}/b")      # while the first may still be writing
    earlier.result()
    later.result()
    dcp.save(pm, f"{root}/b")                    # a plain save after an async one, same path
    back = {}
    for name in ("a", "b"):
        fresh = autotp.parallelize(_model(4), tp=2)
        dcp.load(fresh, f"{root}/{name}")
        back[name] = _full(fresh)
    return {"a": all(torch.equal(back["a"][n], first[n]) for n in first),
            "b": all(torch.equal(back["b"][n], second[n]) for n in second),
            "folders": sorted(os.listdir(root))}


def test_concurrent_async_saves_are_serialized_and_both_checkpoints_load(cluster, tmp_path):
    # before: the second async_save hung both and left both folders .partial
    for r in cluster.run(_two_async_saves, str(tmp_path)):
        assert r["a"] and r["b"]
        assert r["folders"] == ["a", "b"]


def _async_then_save_same_path(path: str) -> bool:
    from autotp.runtime.checkpoint import dcp

    pm = autotp.parallelize(_model(1), tp=2)
    writing = dcp.async_save(pm, path)
    with torch.no_grad():
        for p in pm.parameters():
            p.to_local().mul_(2.0)
    want = _full(pm)
    dcp.save(pm, path)           # waits for the async save in flight, then replaces it
    writing.result()
    fresh = autotp.parallelize(_model(4), tp=2)
    dcp.load(fresh, path)
    got = _full(fresh)
    return all(torch.equal(got[n], want[n]) for n in want)


def test_a_save_while_an_async_save_to_the_same_path_is_in_flight_waits_for_it(cluster, tmp_path):
    # before: hung until the collective timeout
    assert all(cluster.run(_async_then_save_same_path, str(tmp_path / "ckpt")))


def _deeper_checkpoint(path: str) -> dict:
    from autotp.runtime.checkpoint import dcp

    deep = autotp.parallelize(_model(1, layers=2), tp=2)
    dcp.save(deep, path)
    shallow = autotp.parallelize(_model(2, layers=1), tp=2)
    strict = _outcome(lambda: dcp.load(shallow, path))
    dcp.load(shallow, path, strict=False)
    a, b = _full(deep), _full(shallow)
    return {"strict": strict, "loose": all(torch.equal(b[n], a[n]) for n in b)}


def test_a_checkpoint_with_keys_the_module_lacks_is_refused_unless_strict_is_false(cluster, tmp_path):
    # before: a 2-layer checkpoint loaded into a 1-layer module without a word
    for r in cluster.run(_deeper_checkpoint, str(tmp_path / "ckpt")):
        kind, message = r["strict"]
        assert kind == "CheckpointError", r["strict"]
        assert "the checkpoint holds" in message and "transformer.h.1." in message and "strict=False" in message
        assert r["loose"]


def _file_at_the_path(root: str) -> dict:
    import torch.distributed as dist

    from autotp.runtime.checkpoint import dcp

    pm = autotp.parallelize(_model(1), tp=2)
    if dist.get_rank() == 0:
        with open(f"{root}/notes", "w") as f:
            f.write("mine")
        os.makedirs(f"{root}/home")
        with open(f"{root}/home/thesis.txt", "w") as f:
            f.write("mine too")
    dist.barrier()
    file = _outcome(lambda: dcp.save(pm, f"{root}/notes"))
    folder = _outcome(lambda: dcp.save(pm, f"{root}/home"))
    dcp.save(pm, f"{root}/ckpt")
    dcp.save(pm, f"{root}/ckpt")       # later saves work
    return {"file": file, "folder": folder, "kept": open(f"{root}/notes").read() == "mine"
            and os.path.isfile(f"{root}/home/thesis.txt"), "listing": sorted(os.listdir(root))}


def test_a_path_that_is_not_a_checkpoint_folder_is_refused_and_left_alone(cluster, tmp_path):
    # before: the file was moved to <path>.old and every later save to the path failed
    for r in cluster.run(_file_at_the_path, str(tmp_path)):
        assert r["file"][0] == "CheckpointError" and "is a file, not a checkpoint folder" in r["file"][1]
        assert r["folder"][0] == "CheckpointError" and "holds files but no DCP checkpoint" in r["folder"][1]
        assert r["kept"] and r["listing"] == ["ckpt", "home", "notes"]


def _cut_between_renames(path: str) -> dict:
    import torch.distributed as dist

    from autotp.runtime.checkpoint import dcp

    pm = autotp.parallelize(_model(1), tp=2)
    dcp.save(pm, path)
    first = _full(pm)
    if dist.get_rank() == 0:   # what a crash between publish's two renames leaves
        os.rename(path, f"{path}.old")
        os.makedirs(f"{path}.partial")
    dist.barrier()
    refused = _outcome(lambda: dcp.load(autotp.parallelize(_model(2), tp=2), path))
    fresh = autotp.parallelize(_model(2), tp=2)
    dcp.load(fresh, f"{path}.old")                      # the folder the message names
    old = _full(fresh)
    with torch.no_grad():
        for p in pm.parameters():
            p.to_local().add_(1.0)
    dcp.save(pm, path)                                  # the next save publishes over it
    again = autotp.parallelize(_model(2), tp=2)
    dcp.load(again, path)
    new, want = _full(again), _full(pm)
    return {"refused": refused, "old": all(torch.equal(old[n], first[n]) for n in first),
            "new": all(torch.equal(new[n], want[n]) for n in want),
            "listing": sorted(os.listdir(os.path.dirname(path)))}


def test_a_save_cut_short_between_its_renames_points_at_the_complete_old_folder(cluster, tmp_path):
    # before: the error named only <path>.partial, never loaded, and not the complete <path>.old
    for r in cluster.run(_cut_between_renames, str(tmp_path / "ckpt")):
        kind, message = r["refused"]
        assert kind == "CheckpointError"
        assert "ckpt.old is the previous checkpoint, complete" in message, message
        assert r["old"] and r["new"]
        assert r["listing"] == ["ckpt"]


def _dcp_error(root: str) -> tuple:
    from autotp.runtime.checkpoint import dcp

    pm = autotp.parallelize(_model(1), tp=2)
    with open(f"{root}/file", "w") as f:
        f.write("x")
    return _outcome(lambda: dcp.save(pm, f"{root}/file/ckpt"))


def test_dcp_errors_start_with_the_reason_and_name_the_ranks(cluster, tmp_path):
    # before: "CheckpointException ranks:dict_keys([0, 1, 2, 3])", the reason on its last line
    for kind, message in cluster.run(_dcp_error, str(tmp_path)):
        assert kind == "CheckpointError", message
        first = message.splitlines()[0]
        assert first.startswith(("NotADirectoryError", "FileExistsError")), message
        assert "(ranks 0, 1, 2, 3)" in first and "save of" in first


# ---------------------------------------------------------------- nothing lost (issue 45)

def _listing(root: str) -> list[str]:
    return sorted(os.listdir(root))


def _save_over_another(root: str) -> dict:
    import torch.distributed as dist

    from autotp.runtime.checkpoint import dcp

    path = f"{root}/ckpt"
    first = autotp.parallelize(_model(1), tp=2, layout=LAYOUT)
    dcp.save(first, path)
    want = _full(first)
    deeper = autotp.parallelize(_model(2, layers=2), tp=2, layout=LAYOUT)       # another model
    another_model = _outcome(lambda: dcp.save(deeper, path))
    rerun = autotp.parallelize(_model(3), tp=2, layout=LAYOUT)                  # this model, another run
    another_run = _outcome(lambda: dcp.save(rerun, path))
    dist.barrier()
    listing = _listing(root)
    kept = autotp.parallelize(_model(4), tp=2, layout=LAYOUT)
    dcp.load(kept, path)                        # the first checkpoint, whole
    untouched = all(torch.equal(_full(kept)[n], want[n]) for n in want)
    dcp.save(kept, path)                        # a module that loaded it goes on with its run
    dcp.save(rerun, path, overwrite=True)       # told to: replaced
    back = autotp.parallelize(_model(4), tp=2, layout=LAYOUT)
    dcp.load(back, path)
    replaced = all(torch.equal(_full(back)[n], _full(rerun)[n]) for n in want)
    return {"model": another_model, "run": another_run, "listing": listing, "untouched": untouched,
            "replaced": replaced}


def test_a_save_onto_another_models_checkpoint_is_refused_unless_told_to_overwrite(cluster, tmp_path):
    # before: both saves replaced the first checkpoint without a word
    results = cluster.run(_save_over_another, str(tmp_path))
    for r in results:
        kind, message = r["model"]
        assert kind == "CheckpointError", r["model"]
        assert "holds the checkpoint of another model" in message and "overwrite=True" in message, message
        assert "transformer.h.1." in message, message            # names a tensor the module lacks
        kind, message = r["run"]
        assert kind == "CheckpointError", r["run"]
        assert "another training run" in message and "autotp.runtime.dcp.load it first" in message, message
        assert r["listing"] == ["ckpt"] and r["untouched"]       # nothing touched: no .partial, no .old
        assert r["replaced"]
    assert len({str(r["model"]) for r in results}) == 1 and len({str(r["run"]) for r in results}) == 1


def _two_threads(root: str) -> dict:
    import threading

    import torch.distributed as dist

    from autotp.runtime.checkpoint import dcp

    pm = autotp.parallelize(_model(1), tp=2)
    outcomes: dict[str, tuple] = {}
    inside = threading.Event()      # the first save has begun (it reads the module's state)
    state_dict = pm.state_dict

    def reading(*args, **kwargs):
        inside.set()
        return state_dict(*args, **kwargs)

    pm.state_dict = reading

    def save(name: str, after: threading.Event | None) -> None:
        if after is not None:
            after.wait()
        outcomes[name] = _outcome(lambda: dcp.save(pm, f"{root}/{name}"))

    threads = [threading.Thread(target=save, args=("a", None)), threading.Thread(target=save, args=("b", inside))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dist.barrier()
    loads, fresh = {}, autotp.parallelize(_model(4), tp=2)
    for name in ("a", "b"):
        if outcomes[name][0] == "ok":
            dcp.load(fresh, f"{root}/{name}")
            loads[name] = all(torch.equal(_full(fresh)[n], _full(pm)[n]) for n in _full(pm))
    return {"outcomes": outcomes, "loads": loads, "listing": _listing(root)}


def test_saves_from_two_threads_at_once_are_serialized(cluster, tmp_path):
    # before: the second thread's collectives interleaved with the first's, and both waited out
    # the collective timeout with raw errors, leaving two .partial folders. Now the second waits
    # for the first (on each rank; ranks that take two threads' saves in different orders are
    # told so by the start's exchange, a DisagreementError, and nothing is written)
    for r in cluster.run(_two_threads, str(tmp_path)):
        assert r["outcomes"] == {"a": ("ok", None), "b": ("ok", None)}, r["outcomes"]
        assert r["listing"] == ["a", "b"] and r["loads"] == {"a": True, "b": True}


def _long_path(root: str) -> dict:
    import torch.distributed as dist

    from autotp.runtime.checkpoint import dcp, dcp_safety

    # 1227 characters in all: folders of 200 (a name may have 255)
    path = root
    while 1227 - len(path) - 1 > 200:
        path = os.path.join(path, "d" * 200)
    path = os.path.join(path, "c" * (1227 - len(path) - 1))
    pm = autotp.parallelize(_model(1), tp=2, layout=LAYOUT)
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(path))
    dist.barrier()
    dcp.save(pm, path)
    fresh = autotp.parallelize(_model(2), tp=2, layout=LAYOUT)
    dcp.load(fresh, path)
    # texts of other lengths per rank, the longest past the first exchange's width
    texts = dcp_safety._exchange("a test", "x" * (3000 * dist.get_rank()) + "é" * dist.get_rank())
    # a last name too long for the <name>.partial beside it: told before anything is written
    named = _outcome(lambda: dcp.save(pm, os.path.join(root, "n" * 250)))
    return {"length": len(path), "equal": all(torch.equal(_full(fresh)[n], _full(pm)[n]) for n in _full(pm)),
            "texts": [len(t) for t in texts], "whole": texts[-1].endswith("é" * (len(texts) - 1)),
            "named": named}


def test_a_checkpoint_path_of_any_legal_length_saves_and_loads(cluster, tmp_path):
    # before: a 1227-character path failed with a raw JSONDecodeError (the start-of-operation
    # exchange cut every rank's text at 1024 bytes)
    for r in cluster.run(_long_path, str(tmp_path)):
        assert r["length"] == 1227 and r["equal"]
        assert r["texts"] == [3001 * i for i in range(4)] and r["whole"]
        kind, message = r["named"]
        assert kind == "CheckpointError" and "choose a name of at most 247 bytes" in message, r["named"]


def _drifted_replica(root: str) -> dict:
    import torch.distributed as dist

    from autotp.runtime.checkpoint import dcp

    pm = autotp.parallelize(_model(1), tp=2, layout=LAYOUT)   # dp 2 x tp 2: TP groups {0, 1} and {2, 3}
    if dist.get_rank() == 3:      # as an optimizer step taken on one rank only would
        with torch.no_grad():
            pm.local_parameter("transformer.h.0.ln_1.weight").add_(1.0)
    refused = _outcome(lambda: dcp.save(pm, f"{root}/ckpt"))
    dist.barrier()
    return {"refused": refused, "listing": _listing(root)}


def test_a_save_of_replicas_that_drifted_apart_is_refused_on_every_rank(cluster, tmp_path):
    # before: saved without a word, keeping one rank's copy of the replicated weight
    results = cluster.run(_drifted_replica, str(tmp_path))
    for r in results:
        kind, message = r["refused"]
        assert kind == "DisagreementError", r["refused"]
        assert "disagree before the save of" in message and "transformer.h.0.ln_1.weight" in message, message
        assert "an optimizer step" in message and "Nothing was written" in message, message
        assert r["listing"] == []
    assert len({r["refused"] for r in results}) == 1      # the other TP group told too


def _foreign_optimizer(root: str) -> dict:
    from autotp.runtime.checkpoint import dcp

    pm = autotp.parallelize(_model(1), tp=2, layout=LAYOUT)
    other = autotp.parallelize(_model(2), tp=2, layout=LAYOUT)
    serial = _model(3)
    out = {"other": _outcome(lambda: dcp.save(pm, f"{root}/a", torch.optim.AdamW(other.parameters()))),
           "serial": _outcome(lambda: dcp.save(pm, f"{root}/b", torch.optim.AdamW(serial.parameters())))}
    dcp.save(pm, f"{root}/c", torch.optim.AdamW(pm.parameters()))
    out["load"] = _outcome(lambda: dcp.load(pm, f"{root}/c", torch.optim.AdamW(other.parameters())))
    out["listing"] = _listing(root)
    return out


def test_a_save_or_load_with_another_modules_optimizer_is_refused_on_every_rank(cluster, tmp_path):
    # before: a raw "KeyError: 0" from torch's get_optimizer_state_dict
    for r in cluster.run(_foreign_optimizer, str(tmp_path)):
        for case in ("other", "serial", "load"):
            kind, message = r[case]
            assert kind == "CheckpointError", (case, r[case])
            assert "that are not this module's" in message and "AdamW(pm.parameters()" in message, message
        assert r["listing"] == ["c"]
