"""torchrun's output on a local run: the ranks' lines to the terminal, torchrun's own traceback to the log only.

torchrun reports a failed rank (or a signal it forwarded) with its own
``ChildFailedError``/``SignalException`` traceback and a failure summary, which
only repeat what the rank already said, and exits 1 whatever the rank's code.
:class:`OutputFilter` keeps those out of the terminal and reads the summary for
the failed rank and its exit code; :mod:`.local` prints one line in their place.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import sys
import termios
from typing import IO, List, Optional, Tuple

# torchrun's own log lines: "W1125 03:54:50.708000 10899 site-packages/torch/distributed/run.py:874] ..."
_TORCHRUN_LOG = re.compile(r"^\[?[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ \S*torch/distributed/")
# The exception that ends torchrun when a rank failed or it was signalled: its traceback repeats that.
_TORCHRUN_END = re.compile(r"^torch\.distributed\.elastic\.\S*(ChildFailedError|SignalException)\b")
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_ROOT_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


class OutputFilter:
    """Pass the ranks' output to the terminal, keep torchrun's chatter and closing traceback in the log only.

    Line by line: torchrun's log lines (``W1125 ... torch/distributed/...``) are
    dropped; a traceback is held until its exception line, then shown unless it is
    torchrun's own ``ChildFailedError``/``SignalException``, after which torchrun
    prints only its failure summary, read here for the failed rank and exit code.
    Partial lines with a carriage return (a progress bar) pass at once.
    """

    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.pending = b""
        self.bar = False  # inside a progress bar's line (carriage returns, no newline yet)
        self.held: List[bytes] = []
        self.swallow = False
        self.in_root_cause = False
        self.root_rank: Optional[int] = None
        self.root_code: Optional[int] = None

    def feed(self, data: bytes) -> None:
        self.pending += data
        if self.bar:  # the rest of a progress bar's line, up to its newline, is the bar's
            head, nl, self.pending = self.pending.partition(b"\n")
            self._emit(head + nl)
            self.bar = not nl
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            self._line(line + b"\n")
        if self.pending and b"\r" in self.pending and not self.held and not self.swallow:
            self._emit(self.pending)
            self.pending = b""
            self.bar = True

    def close(self) -> None:
        if self.pending:
            self._line(self.pending)
            self.pending = b""
        for line in self.held:
            self._emit(line)
        self.held = []

    def _emit(self, data: bytes) -> None:
        try:
            self.out.write(data)
            self.out.flush()
        except OSError:
            pass  # the terminal went away: the log file still has it all

    def _line(self, line: bytes) -> None:
        text = line.decode(errors="replace").rstrip("\r\n")
        if self.swallow:
            self._root_cause(text)
            return
        if _TORCHRUN_LOG.match(text):
            return
        if self.held:
            if text[:1].isspace() or not text:
                self.held.append(line)
                return
            if _TORCHRUN_END.match(text):
                self.held = []
                self.swallow = True
                return
            for held in self.held:
                self._emit(held)
            self.held = []
        if text.startswith("Traceback (most recent call last)"):
            self.held.append(line)
            return
        self._emit(line)

    def _root_cause(self, text: str) -> None:
        if text.startswith("Root Cause"):
            self.in_root_cause = True
        elif self.in_root_cause:
            rank, code = _ROOT_RANK.match(text), _ROOT_CODE.match(text)
            if rank and self.root_rank is None:
                self.root_rank = int(rank.group(1))
            if code and self.root_code is None:
                self.root_code = int(code.group(1))


def output_channel() -> Tuple[int, int]:
    """(read end, write end) for the ranks' output: a pty when our stderr is a terminal, so the
    ranks still draw their progress bar and size it to the window; a pipe otherwise."""
    if not os.isatty(sys.stderr.fileno()):
        return os.pipe()
    reader, writer = pty.openpty()
    attrs = termios.tcgetattr(writer)
    attrs[1] &= ~termios.ONLCR  # no "\r\n" for "\n": the bytes pass through unchanged
    termios.tcsetattr(writer, termios.TCSANOW, attrs)
    try:
        size = fcntl.ioctl(sys.stderr.fileno(), termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(writer, termios.TIOCSWINSZ, size)
    except OSError:
        pass
    return reader, writer


def descendants(pid: int) -> List[int]:
    """Every process below ``pid`` (torchrun and its ranks, which sit in sessions of their own)."""
    children: dict = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            ppid = int(stat[stat.rfind(b")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
