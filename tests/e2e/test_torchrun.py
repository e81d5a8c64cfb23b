"""The examples run under torchrun too (its environment, not autotp's local launcher)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_main_job_under_torchrun_matches_serial_on_two_ranks():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "gpt2_tp.py"), "--tp", "2", "--layers", "1", "--seq", "8"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "PASS: the parallel model computes what the serial one does" in done.stdout
    assert done.stdout.count("[ok <=") == 2


@pytest.mark.slow   # 40 s; tests/e2e/test_training.py checks dp 2 x tp 2 AdamW steps against serial in the fast tier
def test_training_example_under_torchrun_follows_the_serial_loss_curve():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "examples" / "train_gpt2.py"), "--tp", "2", "--steps", "3"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "world 4 = dp 2 x tp 2" in done.stdout
    assert "PASS: the loss curves agree" in done.stdout


@pytest.mark.slow
def test_pipeline_training_example_under_torchrun_follows_the_serial_loss_curve():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "examples" / "train_gpt2.py"), "--tp", "2", "--pp", "2", "--layers", "4", "--steps", "3"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "world 4 = dp 1 x pp 2 x tp 2" in done.stdout
    assert "PASS: the loss curves agree" in done.stdout
