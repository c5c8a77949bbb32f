"""Gloo ranks for the tests' multi-process helpers, forked from one server that imported torch once.

Some tests run the trainer's pieces on real ranks outside the command (the Ulysses
cases, activation checkpointing's equivalence, the consolidation tests' FSDP2 run).
Started by ``torchrun`` or ``mp.spawn``, each rank is a fresh interpreter importing
torch, DCP and transformers: about 8 CPU-seconds a rank on the CI machine. Here they
are forked from multiprocessing's ``forkserver`` preloaded with the node launcher's
modules (:mod:`fsdp_workflow.train.node_preload`) and the helper's own, as the node
launcher starts the trainer's ranks; each rank gets the environment torchrun would
give it (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) and one intra-op thread.

    from tests.forked_ranks import run
    run(main, (out, overrides), world=2, preload=[__name__])  # main(out, overrides) on 2 ranks
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence, Tuple

from fsdp_workflow.backends.local import free_port


def _rank(index: int, world: int, port: int, fn: Callable[..., Any], args: Tuple[Any, ...]) -> None:
    import torch

    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the ranks share the machine's cores, as OMP_NUM_THREADS=1 under torchrun
    fn(*args)


def run(fn: Callable[..., Any], args: Tuple[Any, ...], world: int, preload: Sequence[str] = ()) -> None:
    """``fn(*args)`` on ``world`` ranks (a module-level function of an importable module); returns
    when all have, raises ``torch.multiprocessing``'s ``ProcessRaisedException`` /
    ``ProcessExitedException`` when one fails. The server is stopped before returning."""
    import multiprocessing
    from multiprocessing import forkserver

    import torch.multiprocessing as mp

    from fsdp_workflow.train.node import stop_helper

    multiprocessing.set_forkserver_preload([*preload, "fsdp_workflow.train.node_preload"])
    try:
        mp.start_processes(_rank, args=(world, free_port(), fn, tuple(args)), nprocs=world, join=True,
                           start_method="forkserver")
    finally:
        stop_helper(forkserver._forkserver)
