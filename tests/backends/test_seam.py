"""The scheduler seam: Slurm's commands are spoken in ``backends/slurm/`` alone, ``is_slurm`` in the registry alone.

What is banned, read from the source (``ast``): a string constant or f-string piece that
uses ``sbatch``, ``squeue``, ``scontrol``, ``sacct`` or ``scancel`` *as a command*, that
is an argv element (the whole string is the word) or the word starting a shell command
(at the start of the text, or after ``$(``, a pipe, ``;``, ``&&``, ``||``, a backtick,
``then``/``do``/``!``), followed by a space or the end. Why: a second scheduler must not
have to find Slurm calls all over the package. Docstrings, comments and prose in
messages (``sbatch refused the training job``, ``(scontrol and sacctmgr on PATH)``) and
file names (``train.sbatch``) may mention the words: they run nothing.

``is_slurm`` (a name, a definition, an import) lives in ``backends/registry.py`` only:
callers ask :func:`fsdp_workflow.backends.registry.backend_for` and the backend instead.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import List, Set

import pytest

import fsdp_workflow

PACKAGE = Path(fsdp_workflow.__file__).parent
SLURM_DIR = PACKAGE / "backends" / "slurm"
REGISTRY = PACKAGE / "backends" / "registry.py"
COMMANDS = ("sbatch", "squeue", "scontrol", "sacct", "scancel")
_AS_COMMAND = re.compile(r"(?:^\s*|\$\(\s*|[|;`!]\s*|&&\s*|\bthen\s+|\bdo\s+)(" + "|".join(COMMANDS) + r")(?=\s|$)",
                         re.MULTILINE)

# Files outside backends/slurm still allowed to speak Slurm, each of which must still offend (the
# list only shrinks). Empty: the batch scripts' renderer and sbatch_argv moved to backends/slurm/scripts.py.
NOT_YET_MOVED: Set[str] = set()
# What moved in, and would offend anywhere else: the proof that the ban above is not vacuous.
MOVED_IN = ("scripts.py", "submit.py", "queue.py")


def _strings(tree: ast.AST) -> List[ast.Constant]:
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def command_offences(source: str) -> List[str]:
    """Lines where a Slurm command is used as a command (see the module docstring)."""
    return [f"{n.lineno}: {n.value[:80]!r}" for n in _strings(ast.parse(source))
            if n.value.strip() in COMMANDS or _AS_COMMAND.search(n.value)]


def is_slurm_offences(source: str) -> List[str]:
    out = []
    for n in ast.walk(ast.parse(source)):
        names = []
        if isinstance(n, ast.Name):
            names = [n.id]
        elif isinstance(n, ast.Attribute):
            names = [n.attr]
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [n.name]
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names = [a.asname or a.name for a in n.names]
        if "is_slurm" in names:
            out.append(f"{n.lineno}: is_slurm")
    return out


def _outside(root: Path) -> List[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if root not in p.parents]


def test_slurm_commands_only_in_the_slurm_backend() -> None:
    offences = []
    for path in _outside(SLURM_DIR):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel not in NOT_YET_MOVED:
            offences += [f"{rel}:{o}" for o in command_offences(path.read_text())]
    assert offences == [], "ask the backend (fsdp_workflow.backends.registry.backend_for) instead:\n" + "\n".join(offences)


def test_the_not_yet_moved_list_only_shrinks() -> None:
    """Each exception still speaks Slurm (else it goes from the list), and none is in backends/slurm already."""
    for rel in sorted(NOT_YET_MOVED):
        assert not (PACKAGE / rel).is_relative_to(SLURM_DIR), f"{rel} is in backends/slurm: drop it from NOT_YET_MOVED"
        assert command_offences((PACKAGE / rel).read_text()), f"{rel} speaks no Slurm any more: drop it from NOT_YET_MOVED"


@pytest.mark.parametrize("name", MOVED_IN)
def test_what_moved_in_would_be_caught_outside(name: str) -> None:
    """The renderer (sbatch, squeue, scancel, scontrol in submit.sh and the batch scripts), the submitter and the
    queue reader each offend by the rule: put back outside backends/slurm, the ban above would fail."""
    assert command_offences((SLURM_DIR / name).read_text()), f"backends/slurm/{name} no longer speaks Slurm"


def test_is_slurm_only_in_the_registry() -> None:
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != REGISTRY:
            offences += [f"{path.relative_to(PACKAGE)}:{o}" for o in is_slurm_offences(path.read_text())]
    assert offences == [], "ask fsdp_workflow.backends.registry (backend_for(cfg).queued) instead:\n" + "\n".join(offences)


@pytest.mark.parametrize("line, bad", [
    ('argv = ["scancel", job_id]', True),
    ('cmd = f"squeue -h -j {ids}"', True),
    ('x = "  out=$(squeue -h -j \\"$ids\\")"', True),
    ('x = "MASTER_ADDR=$(scontrol show hostnames \\"$L\\" | head -n 1)"', True),
    ('x = "a; sacct -n"', True),
    ('msg = f"sbatch refused the {what} job"', True),  # opening with the word reads as a command line: reworded in backends
    ('msg = "run this where scontrol and sacctmgr answer"', False),
    ('name = "train.sbatch"', False),
    ('"""A docstring may say: scancel 123."""', False),
])
def test_the_rule_catches_commands_not_prose(line: str, bad: bool) -> None:
    assert bool(command_offences(line)) is bad
