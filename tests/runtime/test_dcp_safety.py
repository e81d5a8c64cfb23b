"""A training checkpoint never loses data and never loads wrong (autotp.runtime.dcp,
autotp.runtime.dcp_safety): damaged, swapped or foreign files are refused on every rank; the
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
    from autotp.runtime import dcp

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
    from autotp.runtime import dcp

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
    from autotp.runtime import dcp

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

    from autotp.runtime import dcp

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

    from autotp.runtime import dcp

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
    from autotp.runtime import dcp

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
