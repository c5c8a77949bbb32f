"""Shared by the golden-file tests (tests/plan/test_render.py, tests/container/test_wrap.py).

Without an image the scripts name the planning interpreter, and torch's console scripts
when they sit beside it (``plan.spec.console_script``): :func:`fix_interpreter` fixes both,
so the golden files agree on every machine.

``config.yaml``'s sha256 is rendered into every job script. The config holds absolute
paths of the checkout (smoke's tiny data) and every new key changes it, so golden files
hold a placeholder; tests/plan/test_render.py checks the real value separately.
"""

from __future__ import annotations

import re

_HASH_LINE = re.compile(r"^CONFIG_SHA256=[0-9a-f]{64}$", re.MULTILINE)


def mask_config_hash(text: str) -> str:
    """``text`` with the planned config hash replaced by a placeholder."""
    return _HASH_LINE.sub("CONFIG_SHA256=<sha256 of config.yaml as planned>", text)


def fix_interpreter(monkeypatch) -> None:
    """Plan as from ``/opt/venv/bin/python``, a venv that holds ``torchrun`` and ``accelerate``."""
    import sys

    from fsdp_workflow.plan import spec

    monkeypatch.setattr(sys, "executable", "/opt/venv/bin/python")
    monkeypatch.setattr(spec, "beside_interpreter", lambda name: True)
