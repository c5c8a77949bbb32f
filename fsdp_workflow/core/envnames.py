"""What an environment variable's name may be.

``launch.env``, ``container.env`` and ``cluster.nccl_env`` all become
variables of a job's shell; a name outside this grammar would be a shell
syntax error (or worse) in the rendered script, so it is refused when the
config is validated.
"""

from __future__ import annotations

import re

ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
ENV_NAME_RULE = "letters, digits and '_', not starting with a digit"


def is_env_name(name: str) -> bool:
    """True when ``name`` can be exported by a POSIX shell."""
    return bool(ENV_NAME_RE.match(name))
