"""Shared test helpers. Stage-specific fixtures live in each tests/<stage>/conftest.py."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

@pytest.fixture(autouse=True)
def _root_handlers_as_found():
    """Each test leaves the root logger's handlers as it found them.

    A command run in-process (``fsdp_workflow.__main__``'s Hydra job logging) puts a console
    handler on the root logger bound to that test's captured stderr, which pytest closes after
    the test; a later test in the same worker that logs (a stage's ``main``) then prints
    "--- Logging error ---" and a traceback into what it checks. pytest's own capture handlers
    come and go with each phase and are left to it.
    """
    root = logging.getLogger()
    before = set(root.handlers)
    yield
    for handler in [h for h in root.handlers if h not in before and not type(h).__module__.startswith("_pytest")]:
        root.removeHandler(handler)
        handler.close()


# Session fixtures that train something: every test that uses one runs on the same
# pytest-xdist worker, so the run happens once per suite, not once per worker.
SHARED_RUNS = ("trained", "straight_run", "ema_run")


@pytest.hookimpl(wrapper=True)  # runs before every other implementation, xdist's (which reads the groups) included
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    """Give every test an ``xdist_group``: its module, or the shared run it uses.

    A hook wrapper, so the groups exist before xdist's own hook turns them into node
    ids. (pytest 9.2 dropped the ``Item._nodeid`` that xdist 3.8 writes: groups are then
    ignored and modules split across workers, hence ``pytest<9.2`` in the dev extra.)

    The suite runs on two workers (``-n 2 --dist loadgroup`` in pyproject.toml): a
    module stays on one worker, so its module-scoped runs (the tensor-parallel
    module's four launches, say) are not repeated, and the two workers overlap one
    test's waiting (Slurm queues, timeouts being proven) with another's computing.
    """
    groups: dict[str, str] = {}
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark is not None:
            groups[item.nodeid] = str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
            continue
        shared = [name for name in SHARED_RUNS if name in getattr(item, "fixturenames", ())]
        groups[item.nodeid] = f"run:{shared[0]}" if shared else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    # Groups with slow tests first (order inside a group kept): the workers share the long
    # runs from the start instead of one finishing the suite alone on the last of them.
    # Among those, groups that mostly wait (on Slurm's queue: a `slurm` or `multinode` test)
    # alternate with groups that compute, so that the two workers seldom wait at once.
    # (xdist keeps this order only under --no-loadscope-reorder, in pyproject.toml's addopts.)
    slow_groups = {groups[i.nodeid] for i in items if i.get_closest_marker("slow") is not None}
    waiting = {groups[i.nodeid] for i in items if i.get_closest_marker("slurm") or i.get_closest_marker("multinode")}
    slow = list(dict.fromkeys(groups[i.nodeid] for i in items if groups[i.nodeid] in slow_groups))
    computes, waits = [g for g in slow if g not in waiting], [g for g in slow if g in waiting]
    order = [g for pair in itertools.zip_longest(computes, waits) for g in pair if g is not None]
    rank = {g: n for n, g in enumerate(order)}
    items.sort(key=lambda i: rank.get(groups[i.nodeid], len(rank)))
    return (yield)

# The run with an EMA of the weights and a held-out split (session fixture ``ema_run``):
# 6 steps, a checkpoint every step (async saves), all kept. tests/train/test_ema.py checks
# the EMA rule, its layout, resume and consolidation on it; tests/evaluate its evaluation.
EMA_DECAY, EMA_EVERY, EMA_START, EMA_STEPS = 0.7, 2, 1, 6
EMA_RUN = [f"train.max_steps={EMA_STEPS}", "checkpoint.every_steps=1", "checkpoint.keep_last=0",
           "checkpoint.async_save=true", "optimizer.lr=3e-3", f"train.ema_decay={EMA_DECAY}",
           f"train.ema_every_steps={EMA_EVERY}", f"train.ema_start_step={EMA_START}", "data.eval_fraction=0.05"]


@pytest.fixture(scope="session")
def ema_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.train.runner import launched, make_run_dir

    return launched(make_run_dir(tmp_path_factory.mktemp("ema") / "run", EMA_RUN))


# Started in the background (`nohup python -m pytest &`, a non-interactive shell's `&`), the
# suite inherits SIGINT ignored, and so would every process it starts: the Ctrl-C tests would
# then prove nothing but that. Python's own handler here makes a started process default again.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Tests never reach a model hub: everything is built from small configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Paths that break naive shell quoting (spaces, quotes, ;, $, backticks, a newline).
WEIRD_NAMES = [
    "plain",
    "with space",
    "quote'single",
    'quote"double',
    "semi;colon && rm -rf nothing",
    "dollar$HOME`id`",
    "new\nline",
]


@pytest.fixture(params=WEIRD_NAMES, ids=lambda n: n.encode("unicode_escape").decode()[:20])
def weird_dir(request, tmp_path: Path) -> Path:
    """A fresh directory whose name is hostile to shell scripts."""
    d = tmp_path / request.param
    d.mkdir()
    return d


@pytest.fixture
def small_fs(request, tmp_path: Path):
    """A real size-limited tmpfs under ``tmp_path`` (as root; CI runs as root), unmounted afterwards.

    The size comes from ``@pytest.mark.fs_size("3200k")`` on the test (default 64k): a
    filesystem that fills up for real, with the kernel's own ENOSPC.
    """
    import subprocess

    marker = request.node.get_closest_marker("fs_size")
    size = marker.args[0] if marker else "64k"
    mnt = tmp_path / "small_fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def python() -> str:
    return sys.executable
