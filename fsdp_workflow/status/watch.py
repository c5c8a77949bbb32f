"""``status --watch [SECONDS]``: redraw the status every SECONDS until Ctrl-C (which exits 0)."""

from __future__ import annotations

import sys
import time
from typing import Callable

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen (ANSI; every terminal tmux and xterm emulate)
DEFAULT_S = 10.0


def watch(render: Callable[[], str], interval_s: float) -> int:
    """Clear the screen and print ``render()`` every ``interval_s`` seconds; 0 on Ctrl-C."""
    try:
        while True:
            text = render()
            sys.stdout.write(CLEAR + text + f"\n\n(every {interval_s:g} s; Ctrl-C to stop)\n")
            sys.stdout.flush()
            time.sleep(interval_s)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return 0
