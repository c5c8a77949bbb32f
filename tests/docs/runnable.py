"""Find the code blocks of the docs marked runnable, and run one: the harness of test_runnable_docs.py.

The marker is an HTML comment on the line right above a fence (invisible on GitHub);
docs/contributing.md#runnable-docs documents it::

    <!-- runnable: exit=0 expect="dry run: wrote" lines=1,3-4 sub="RUN_DIR=>run" timeout=300 session=smoke -->
    ```bash
    ...
    ```

Keys (values quoted as in a shell; every key optional):

- ``exit=N``: the expected exit status of the block (default 0). The block runs under
  ``bash -e -o pipefail``, so it stops at the first command that fails, with its code.
- ``expect="..."``: a fragment that must appear in the output (stdout and stderr
  together); repeat it for several fragments.
- ``lines=1,3-4``: run only these lines of the block (1-based), e.g. to leave out a
  command that needs Slurm or a GPU; default every line. In a console transcript (lines
  that start with ``$ ``) only the prompted lines run, without their ``$ ``.
- ``sub="OLD=>NEW"``: replace OLD by NEW in the block's text first (repeatable), for the
  docs' placeholders (``RUN_DIR``) and absolute paths (``/tmp/plan``); NEW may use ``$WORK``.
- ``timeout=S``: seconds before the block counts as failed (default 120).
- ``session=NAME``: blocks of one file with the same session share a working directory and
  run in the file's order (an earlier block's run directory is a later block's input);
  without it each block gets a fresh one.
- ``run="..."``: for a block that shows output, the command (named in the prose) that
  prints it: it runs instead of the block's text.
- ``setup="..."``: a command run first in the working directory, not checked but required
  to succeed (a run directory for a block that reads one). Slow blocks outside a session
  that name the same setup (a training run) share one directory where it ran once: they
  must only read that run or write names of their own into it.
- ``slow``: a long block (a training run): the test is marked ``slow``.
- ``skip="why"``: documented as runnable but not on this machine (a GPU): skipped, with why.

The block runs with bash in its working directory (``$WORK``), the repository on
``PYTHONPATH`` (``$REPO`` names it), this interpreter first on ``PATH`` as ``python``,
and the Hugging Face hub offline.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*runnable:(.*?)-->\s*$")
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
_KEYS = {"exit", "expect", "lines", "sub", "timeout", "session", "slow", "skip", "run", "setup"}


@dataclass
class Block:
    """One marked code block."""

    path: Path
    line: int  # 1-based line of its opening fence
    text: str  # the block's lines, as the doc shows them
    exit: int = 0
    expect: List[str] = field(default_factory=list)
    lines: Optional[List[int]] = None
    subs: List[Tuple[str, str]] = field(default_factory=list)
    timeout_s: float = 120.0
    session: str = ""
    slow: bool = False
    skip: str = ""
    run: str = ""
    setup: str = ""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    def script(self) -> str:
        """The text bash runs: the chosen lines, placeholders replaced."""
        rows = [self.run] if self.run else self.text.splitlines()
        if not self.run and any(r.startswith("$ ") for r in rows):
            rows = [r[2:] for r in rows if r.startswith("$ ")]
        if self.lines is not None:
            rows = [rows[i - 1] for i in self.lines]
        text = "\n".join(rows) + "\n"
        for old, new in self.subs:
            text = text.replace(old, new)
        return text


def _line_numbers(spec: str) -> List[int]:
    out: List[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def parse_marker(body: str, block: Block) -> Block:
    """Fill ``block`` from the marker's ``key=value`` words; an unknown key or a bad value raises ValueError."""
    for word in shlex.split(body):
        key, sep, value = word.partition("=")
        if key not in _KEYS:
            raise ValueError(f"{block.where}: unknown runnable key {key!r}; known: {', '.join(sorted(_KEYS))}")
        if key == "exit":
            block.exit = int(value)
        elif key == "expect":
            block.expect.append(value)
        elif key == "lines":
            block.lines = _line_numbers(value)
        elif key == "sub":
            old, arrow, new = value.partition("=>")
            if not arrow or not old:
                raise ValueError(f"{block.where}: sub={value!r}: write sub=\"OLD=>NEW\"")
            block.subs.append((old, new))
        elif key == "timeout":
            block.timeout_s = float(value)
        elif key == "session":
            block.session = value
        elif key == "run":
            block.run = value
        elif key == "setup":
            block.setup = value
        elif key == "slow":
            block.slow = True
        elif key == "skip":
            block.skip = value or "skipped"
        if key not in ("slow",) and not sep:
            raise ValueError(f"{block.where}: runnable key {key!r} needs a value ({key}=...)")
    return block


def find_blocks(paths: List[Path] = DOCS) -> List[Block]:
    """Every marked block of ``paths``, in order; several marker lines above one fence check it several ways.

    Raises:
        ValueError: a marker not followed by a fence, or a bad key.
    """
    blocks: List[Block] = []
    for path in paths:
        rows = path.read_text().splitlines()
        i = 0
        while i < len(rows):
            bodies = []
            while i < len(rows) and MARKER.match(rows[i]):
                bodies.append(MARKER.match(rows[i]).group(1))
                i += 1
            if not bodies:
                i += 1
                continue
            fence = FENCE.match(rows[i]) if i < len(rows) else None
            if fence is None:
                raise ValueError(f"{path.relative_to(REPO)}:{i + 1}: a runnable marker must sit right above a fence")
            end = next(j for j in range(i + 1, len(rows)) if rows[j].startswith(fence.group(1)))
            for body in bodies:
                blocks.append(parse_marker(body, Block(path=path, line=i + 1, text="\n".join(rows[i + 1:end]))))
            i = end + 1
    return blocks


def environment(work: Path) -> Dict[str, str]:
    """What a block runs with: this interpreter as ``python``, the repo importable, no hub."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "SLURM_"))}
    env.update(WORK=str(work), REPO=str(REPO), PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    return env


def run_setup(block: Block, work: Path) -> subprocess.CompletedProcess:
    """The block's ``setup`` command, with bash in ``work``."""
    return subprocess.run(["bash", "-e", "-c", block.setup], cwd=work, env=environment(work), capture_output=True,
                          text=True, timeout=block.timeout_s)


def run_block(block: Block, work: Path) -> subprocess.CompletedProcess:
    """Run the block with bash in ``work``; past its timeout the whole process group is killed (exit 124)."""
    if block.setup:
        done = run_setup(block, work)
        if done.returncode != 0:
            return subprocess.CompletedProcess(["setup"], -1, done.stdout, done.stderr + f"\n[setup failed: {block.setup}]")
    argv = ["bash", "-e", "-o", "pipefail", "-c", block.script()]
    proc = subprocess.Popen(argv, cwd=work, env=environment(work), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=block.timeout_s)
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(argv, 124, out, err + f"\n[timed out after {block.timeout_s:g} s]")


def verdict(block: Block, proc: subprocess.CompletedProcess) -> Optional[str]:
    """None when the block did what its marker says; else why not, with the output's tail."""
    output = proc.stdout + proc.stderr
    wrong = []
    if proc.returncode != block.exit:
        wrong.append(f"exit {proc.returncode}, the doc says {block.exit}")
    wrong += [f"no {frag!r} in the output" for frag in block.expect if frag not in output]
    if not wrong:
        return None
    tail = "\n".join(output.splitlines()[-25:])
    return f"{block.where}: {'; '.join(wrong)}\n--- ran:\n{block.script()}--- output (tail):\n{tail}"
