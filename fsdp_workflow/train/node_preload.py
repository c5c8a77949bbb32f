"""What the node launcher's forkserver imports once, before it forks the ranks (``cluster.rank_start``).

Imported only inside that server (``multiprocessing.set_forkserver_preload`` in
:mod:`fsdp_workflow.train.node`): the modules every rank needs before its first step,
none of which touches CUDA, so each forked rank starts with them imported instead of
spending about 6.5 CPU-seconds importing them itself.

The server also stops dying of the signals a scheduler or the local launcher sends to
the node launcher's whole process group (SIGTERM, SIGHUP, SIGQUIT, SIGUSR2; SIGINT it
ignores already): it must outlive the ranks, because the agent learns each rank's
exit code through it, and each rank's parent-death signal fires when it dies. The
ranks set these back to what an exec'd rank has (:func:`fsdp_workflow.train.node.rank_main`).
"""

from __future__ import annotations

import signal

import torch  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401  (DTensor, sympy)
import accelerate  # noqa: F401
import transformers.modeling_utils  # noqa: F401
import transformers.masking_utils  # noqa: F401  (the dynamo every modeling module imports)
import transformers.models.auto.modeling_auto  # noqa: F401
import transformers.tokenization_utils_base  # noqa: F401

import fsdp_workflow.train.__main__  # noqa: F401
import fsdp_workflow.train.loop  # noqa: F401

# Sent to the whole group by Slurm, the local launcher and kill -- -PGID: the agent re-sends them to the ranks.
GROUP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR2)

for _sig in GROUP_SIGNALS:
    signal.signal(_sig, signal.SIG_IGN)
