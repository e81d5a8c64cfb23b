"""Arguments checked at the door (autotp.arguments, the CLI, a call's inputs, generate's
lengths, gather_to_hf's config): each was a probe that was accepted (negative costs printed, a
CLI exit 0), raised a raw ValueError/TypeError or traceback, or failed late with a misleading
CaptureError before."""
import json

import pytest
import torch

import autotp
from autotp.errors import ConfigError
from tests.helpers import tiny_gpt2

VOCAB = 16


@pytest.fixture(scope="module")
def meta_gpt2():
    return tiny_gpt2(n_layer=1, n_head=2, head_dim=4, vocab=VOCAB, device="meta")


@pytest.mark.parametrize("name, value", [("batch", 0), ("batch", -4), ("batch", 2.5), ("batch", True),
                                         ("batch", "8"), ("seq", 0), ("seq", -1), ("seq", 2.5)])
def test_planning_sizes_that_are_not_positive_integers_are_refused(meta_gpt2, name, value):
    with pytest.raises(ConfigError, match=f"{name}={value!r}: {name} must be a positive integer"):
        autotp.plan(meta_gpt2, tp=2, **{name: value})


def test_planning_sizes_are_checked_by_parallelize_before_it_looks_for_ranks(meta_gpt2):
    with pytest.raises(ConfigError, match="batch=0: batch must be a positive integer"):
        autotp.parallelize(tiny_gpt2(n_layer=1, n_head=2, head_dim=4, vocab=VOCAB), tp=2, batch=0)


def test_a_layout_that_is_not_a_mapping_is_a_config_error(meta_gpt2):
    with pytest.raises(ConfigError, match=r"layout must be a mapping from parameter-name globs to roles"):
        autotp.plan(meta_gpt2, tp=2, layout=[("*.c_attn.weight", "column")])


@pytest.mark.parametrize("limit", ["1GB", -1, 0, float("nan")])
def test_a_memory_limit_that_is_not_a_positive_number_is_a_config_error(meta_gpt2, limit):
    with pytest.raises(ConfigError, match="memory_limit is a positive number of bytes per rank"):
        autotp.plan(meta_gpt2, tp=2, memory_limit=limit)


@pytest.mark.parametrize("value", ["False", 0, None])
def test_host_reads_that_is_not_a_bool_is_a_config_error(meta_gpt2, value):
    # "False" is truthy: read as a bool it would allow the reads it was meant to forbid
    with pytest.raises(ConfigError, match=r"host_reads=.*: host_reads is True or False"):
        autotp.plan(meta_gpt2, tp=2, host_reads=value)
    if value is None:   # parallelize's None: the plan's, or without one True (autotp/plan/arguments.py)
        return
    with pytest.raises(ConfigError, match=r"host_reads=.*: host_reads is True or False"):
        autotp.parallelize(tiny_gpt2(n_layer=1, n_head=2, head_dim=4, vocab=VOCAB), tp=2, host_reads=value)


# ---------------------------------------------------------------- the CLI

@pytest.mark.parametrize("argv", [["check", "gpt2", "--tp", "2", "--layers", "0"],
                                  ["plan", "gpt2", "--tp", "2", "--batch", "0"],
                                  ["plan", "gpt2", "--tp", "2", "--seq", "-1"],
                                  ["plan", "gpt2", "--tp", "0"],
                                  ["plan", "gpt2", "--tp", "2", "--memory-limit", "-3"]])
def test_cli_sizes_that_are_not_positive_are_one_line_and_exit_2(argv, capsys):
    from autotp.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert len(err.strip().splitlines()) == 1 and "must be positive" in err, err


def test_cli_broken_config_json_is_one_line_and_exit_2(tmp_path, capsys):
    from autotp.cli import main

    (tmp_path / "config.json").write_text('{"model_type": "gpt2", ')
    assert main(["plan", str(tmp_path), "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "config.json" in err and "Traceback" not in err, err


# ---------------------------------------------------------------- a call's inputs

def _bad_inputs() -> dict:
    from tests.helpers import batch

    pm = autotp.parallelize(tiny_gpt2(n_layer=1, n_head=2, head_dim=4, vocab=VOCAB, n_positions=16), tp=2)
    pm.eval()
    ids = batch(VOCAB, b=2, s=6)["input_ids"]
    found = {}
    for name, kwargs in {"float mask": {"input_ids": ids, "attention_mask": torch.ones(2, 6)},
                         "short mask": {"input_ids": ids, "attention_mask": torch.ones(2, 4, dtype=torch.long)},
                         "1-D ids": {"input_ids": ids[0]}}.items():
        try:
            pm(**kwargs)
            found[name] = ("ok", "")
        except Exception as exc:
            found[name] = (type(exc).__name__, str(exc))
    found["after"] = tuple(pm(input_ids=ids).logits.shape)     # the module goes on
    try:
        pm.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)   # 6 + 12 - 1 > 16 positions
        found["generate"] = ("ok", "")
    except Exception as exc:
        found["generate"] = (type(exc).__name__, str(exc))
    found["programs"] = len(pm._programs)     # the refused generate built no program
    found["short"] = tuple(pm.generate(ids, max_new_tokens=11, do_sample=False, pad_token_id=0).shape)
    return found


@pytest.fixture(scope="module")
def bad_inputs(cluster_of):
    return cluster_of(2).run(_bad_inputs)


@pytest.mark.parametrize("case, words", [
    ("float mask", ["attention_mask", "float32", "integer"]),
    ("short mask", ["attention_mask", "(2, 4)", "(2, 6)"]),
    ("1-D ids", ["input_ids", "1 dim", "2"]),
])
def test_a_mask_or_ids_of_the_wrong_kind_are_an_input_error_on_every_rank(bad_inputs, case, words):
    # before: a CaptureError that said "make the forward traceable"
    for r in bad_inputs:
        kind, message = r[case]
        assert kind == "InputError", r[case]
        assert all(w in message for w in words), message
        assert r["after"] == (2, 6, VOCAB)


def test_generate_past_the_models_positions_is_refused_before_the_first_token(bad_inputs):
    for r in bad_inputs:
        kind, message = r["generate"]
        assert kind == "InputError" and "max_new_tokens=12" in message and "16 positions" in message, r["generate"]
        assert r["short"] == (2, 17)


# ---------------------------------------------------------------- gather_to_hf's config

def _gather_without_config(folder: str) -> float | None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from autotp.runtime.checkpoint import gather_to_hf
    from tests.helpers import batch, whole

    model = tiny_gpt2(n_layer=1, n_head=2, head_dim=4, vocab=VOCAB, seed=3)
    pm = autotp.parallelize(model, tp=2)
    gather_to_hf(pm, folder)
    dist.barrier()
    inputs = batch(VOCAB)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    return (loaded(**inputs).logits - whole(pm(**inputs).logits)).abs().max().item()


def test_gather_to_hf_without_config_writes_the_models_own(cluster_of, tmp_path):
    # before: no config.json, a folder transformers cannot load
    for worst in cluster_of(2).run(_gather_without_config, str(tmp_path / "hf")):
        assert worst < 1e-12
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
