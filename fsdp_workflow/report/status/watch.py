"""``status --watch [SECONDS]``: redraw the status every SECONDS until the chain ends, or Ctrl-C.

The watch ends by itself when the chain is finished (exit 0), has failed (the failed
job's exit code, else 1), or can never progress (2: a pending reason that means never);
see :func:`fsdp_workflow.report.status.collect.chain_outcome`. Ctrl-C exits 0.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, Tuple

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen (ANSI; every terminal tmux and xterm emulate)
DEFAULT_S = 10.0


def watch(render: Callable[[], Tuple[str, Optional[int]]], interval_s: float) -> int:
    """Clear the screen and print ``render()``'s text every ``interval_s`` seconds.

    Args:
        render: returns the report and the chain's exit code once it can no longer change (None while live).
        interval_s: seconds between redraws.

    Returns:
        The chain's exit code when it ended; 0 on Ctrl-C.
    """
    try:
        while True:
            text, code = render()
            if code is not None:
                sys.stdout.write(CLEAR + text + f"\n\n(the chain has ended: exit {code})\n")
                sys.stdout.flush()
                return code
            sys.stdout.write(CLEAR + text + f"\n\n(every {interval_s:g} s; Ctrl-C to stop)\n")
            sys.stdout.flush()
            time.sleep(interval_s)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return 0
