"""The local launch: what the generated ``train_node.sh`` tells torchrun about signals, and the CLI's exit code.

The end-to-end signal runs (a real CLI, real ranks) are in tests/train/test_preemption.py.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_workflow.config import compose
from fsdp_workflow.core.rundir import REQUEUE_MARKER
from fsdp_workflow.launch.local import run_local
from fsdp_workflow.plan.run_dir import write_run_dir

# Stands in for torchrun: parses its argv with torchrun's own parser and LaunchConfig,
# and reports what torchrun would forward, how long it would wait, and SIGUSR2's disposition.
FAKE_TORCHRUN = f"""#!{sys.executable}
import json, os, signal, sys
from torch.distributed.run import config_from_args, get_args_parser
config, _, _ = config_from_args(get_args_parser().parse_args(sys.argv[1:]))
json.dump({{"signals": config.signals_to_handle.split(","), "shutdown_timeout_s": config.shutdown_timeout,
           "usr2_ignored": signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN}}, open(os.environ["REPORT"], "w"))
"""


def _bin(tmp_path: Path, name: str, text: str) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    exe = bindir / name
    exe.write_text(text)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return bindir


@pytest.mark.parametrize("experiment,delay_s", [("smoke", 30), ("llama8b_fft", 300)])
def test_train_node_sh_makes_torchrun_forward_usr2_and_term(experiment: str, delay_s: int, tmp_path: Path) -> None:
    """The exact script, read by torchrun's own parser: both signals forwarded, the checkpoint budget waited."""
    cfg = compose([f"+experiment={experiment}", "cluster.partition=gpu", f"run_dir={tmp_path / 'run'}"])
    plan = write_run_dir(cfg)
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TORCH_ELASTIC_"))}
    env.update(PATH=f"{_bin(tmp_path, 'torchrun', FAKE_TORCHRUN)}:{env['PATH']}", REPORT=str(report),
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29999", SLURM_NODEID="0")
    res = subprocess.run(["bash", str(plan.run_dir / "train_node.sh")], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    got = json.loads(report.read_text())
    assert {"SIGUSR2", "SIGTERM"} <= set(got["signals"]), got
    for name in got["signals"]:
        assert isinstance(getattr(signal, name), signal.Signals), name  # torchrun looks them up by name
    assert got["shutdown_timeout_s"] == delay_s == cfg.cluster.signal_delay_s
    # until torchrun installs its handler, an early SIGUSR2 must not kill the launcher
    assert got["usr2_ignored"]


def test_a_stale_requeue_marker_does_not_turn_a_failure_into_75(tmp_path: Path, monkeypatch, caplog) -> None:
    """A marker left by an earlier preempted run in the same directory is forgotten before training."""
    plan = write_run_dir(compose(["+experiment=smoke", f"run_dir={tmp_path / 'run'}"]))
    (plan.run_dir / REQUEUE_MARKER).write_text("step 10\n")
    failing = _bin(tmp_path, "torchrun", "#!/bin/sh\necho 'torchrun: worker failed' >&2\nexit 1\n")
    monkeypatch.setenv("PATH", f"{failing}:{os.environ['PATH']}")
    assert run_local(plan, consolidate=False) == 1
    assert "training failed (exit code 1)" in caplog.text
    assert not (plan.run_dir / REQUEUE_MARKER).exists()
