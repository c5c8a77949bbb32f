"""What the node launcher imports once, before the forkserver forks the ranks (``cluster.rank_start``).

Imported by :mod:`fsdp_workflow.train.node` before it starts multiprocessing's
forkserver (in the launcher itself, which then forks the server; or, on a Python
whose forkserver internals it does not know, by the spawned server): the modules
every rank needs before its first step, none of which touches CUDA, so each forked
rank starts with them imported instead of spending about 6.5 CPU-seconds importing
them itself. Importing this module has no other effect.
"""

from __future__ import annotations

import torch  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401  (DTensor, sympy)
import accelerate  # noqa: F401
import transformers.modeling_utils  # noqa: F401
import transformers.masking_utils  # noqa: F401  (the dynamo every modeling module imports)
import transformers.models.auto.modeling_auto  # noqa: F401
import transformers.tokenization_utils_base  # noqa: F401

import fsdp_workflow.train.__main__  # noqa: F401
import fsdp_workflow.train.loop  # noqa: F401
