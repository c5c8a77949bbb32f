"""The package's shape: stages only look down, no import cycles (inside a package too), run-directory names in one module.

The imports are read from the source (``ast``), function-level ones included:
a lazy import is still a dependency. For the stage order ``if TYPE_CHECKING:``
imports are not counted; for cycles they are: a type-only cycle still means two
modules that cannot be understood, moved or tested apart.

    core  <-  config  <-  container  <-  plan  <-  backends  <-  launch  <-  __main__, api  (<- __init__'s lazy export)
    core  <-  backends' pure parts (base, slurm.queue, slurm.reasons)  <-  report, preflight
                 ^----  data  <-  train ;  consolidate (config and core only)
                 ^----  evaluate (consolidate, train, data)
                 ^----  report (status, model card, curves: above train, consolidate, data, backends)  <-  status (its CLI alias)
    preflight (core, config, plan: the snapshot's hash), run in the training job before torchrun

``backends`` (schedulers behind one protocol) sits above ``plan``: a backend plans, renders
(Slurm's batch scripts and ``submit.sh`` are ``backends/slurm/scripts.py``'s, from ``plan/render.py``'s
shell words) and submits; ``plan/run_dir.write_run_dir`` is handed the backend by its caller. Its pure
parts (:data:`BACKEND_PURE`: the job-state and role vocabulary, Slurm's queue readers and reasons)
import ``core`` alone, so the report stage (job states) and the preflight read them without a loop.
A job's role, which the planner and the container stage name too, is ``core/roles.py``'s: no stage
imports from a floor above it (issue 50). ``report`` may import the whole of
``backends`` (``status`` asks a backend for its jobs' states); nothing below ``report`` imports it.

The run record (``config/record.py``) sits in ``config``: every stage that reads a run
directory may ask it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

import fsdp_workflow
from fsdp_workflow.core import modeldir, rundir

PACKAGE = Path(fsdp_workflow.__file__).parent

# stage -> the stages it may import (besides itself)
ALLOWED: Dict[str, Set[str]] = {
    "core": set(),
    "config": {"core"},
    "container": {"core", "config"},
    "plan": {"core", "config", "container", "data"},  # data: its plan-time rules (data.plan_checks)
    "backends.pure": {"core"},  # BACKEND_PURE: vocabulary and parsers, on core alone
    "backends": {"core", "config", "container", "plan", "backends.pure"},
    "launch": {"core", "config", "plan", "backends", "backends.pure"},
    "data": {"core", "config"},
    "train": {"core", "config", "data"},
    "consolidate": {"core", "config"},
    "evaluate": {"core", "config", "consolidate", "train", "data"},
    # the report stage sits above train and consolidate; nothing below it imports it
    "report": {"core", "config", "data", "train", "consolidate", "backends", "backends.pure"},
    "status": {"report"},  # python -m fsdp_workflow.status: the report stage's status command, where the docs put it
    "__main__": {"core", "config", "container", "plan", "launch", "data", "backends", "backends.pure"},
    "check": {"core", "config", "plan", "launch", "backends", "backends.pure"},  # python -m fsdp_workflow.check
    "replan": {"core", "config", "plan", "launch", "backends", "backends.pure"},  # re-validates an edited run dir
    "api": {"core", "config", "plan", "launch", "backends", "backends.pure"},  # fsdp_workflow.submit, as a function
    "preflight": {"core", "config", "plan", "backends.pure"},  # python -m fsdp_workflow.preflight, in the job
    "__init__": {"api"},  # only the lazy re-export of the Python API
}
RUN_DIR_MODULE = "fsdp_workflow.core.rundir"
# The backends' pure parts: importable from below the backends stage (plan, report), so they import core alone.
BACKEND_PURE = {"fsdp_workflow.backends", "fsdp_workflow.backends.base", "fsdp_workflow.backends.slurm",
                "fsdp_workflow.backends.slurm.queue", "fsdp_workflow.backends.slurm.reasons"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(path: Path, mods: Dict[str, Path], type_only: bool = False, name: str = "") -> Set[str]:
    """The package modules ``path`` imports (module-level and function-level).

    Args:
        path: the module's file.
        mods: every module of the package, by dotted name.
        type_only: count ``if TYPE_CHECKING:`` imports too (the cycle check does).
        name: the module's dotted name (default: from its path in the package).
    """
    name = name or _module_name(path)
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skip = set() if type_only else {id(n) for top in ast.walk(tree) if isinstance(top, ast.If)
                                    and _is_type_checking(top) for n in ast.walk(top)}
    found: Set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            if not base.startswith("fsdp_workflow"):
                continue
            for alias in node.names:  # `from pkg import module` imports the module
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("fsdp_workflow")}
    return {m for m in found if m in mods} - {name}


def _graph(type_only: bool = False) -> Dict[str, Set[str]]:
    mods = _modules()
    return {name: _imports(path, mods, type_only) for name, path in mods.items()}


def _stage(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    if module in BACKEND_PURE:
        return "backends.pure"
    return parts[1]


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def upward_edges(graph: Dict[str, Set[str]]) -> List[Tuple[str, str]]:
    bad = []
    for src, targets in graph.items():
        s = _stage(src)
        for dst in targets:
            d = _stage(dst)
            if d != s and d != "__init__" and d not in ALLOWED[s]:
                bad.append((src, dst))
    return sorted(bad)


def test_every_stage_is_known() -> None:
    assert {_stage(m) for m in _modules()} <= set(ALLOWED), "add the new stage to ALLOWED (and the docs)"


def test_no_import_cycles() -> None:
    """No cycle anywhere, inside a package included, type-only imports counted."""
    assert _cycles(_graph(type_only=True)) == [], "break the cycle: move the shared names to a module both import"


def test_stages_only_look_down() -> None:
    assert upward_edges(_graph()) == [], "an import against the stage order (see this module's docstring)"


def test_the_backends_pure_parts_exist_and_their_packages_import_nothing() -> None:
    """Importing a pure part runs its packages' ``__init__``: those import nothing, so no stage above comes along."""
    mods = _modules()
    assert BACKEND_PURE <= set(mods)
    for pkg in ("fsdp_workflow.backends", "fsdp_workflow.backends.slurm"):
        assert _imports(mods[pkg], mods, type_only=True) == set(), f"{pkg}/__init__.py must import nothing"


def test_planning_stays_torch_free() -> None:
    """``import fsdp_workflow.plan`` (and the backends that render and submit its scripts) loads no torch: login nodes plan."""
    import subprocess
    import sys

    code = ("import sys, fsdp_workflow.plan.spec, fsdp_workflow.plan.render, fsdp_workflow.backends.base, "
            "fsdp_workflow.backends.registry, fsdp_workflow.backends.slurm.scripts; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_nothing_below_the_report_stage_imports_it() -> None:
    """report sits above train and consolidate: only its CLI alias (status) may name it."""
    assert {s for s, allowed in ALLOWED.items() if "report" in allowed} == {"status"}
    users = sorted(src for src, dsts in _graph(type_only=True).items()
                   if _stage(src) not in ("report", "status") and any(_stage(d) == "report" for d in dsts))
    assert users == []


def test_a_type_only_cycle_inside_a_package_is_caught(tmp_path: Path) -> None:
    """The cycle check reads ``if TYPE_CHECKING:`` imports: a type-only cycle between two siblings fails it."""
    (tmp_path / "a.py").write_text("from fsdp_workflow.report.status import b\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from fsdp_workflow.report.status.a import X\n")
    mods = {"fsdp_workflow.report.status.a": tmp_path / "a.py", "fsdp_workflow.report.status.b": tmp_path / "b.py"}
    graph = {n: _imports(p, mods, type_only=True, name=n) for n, p in mods.items()}
    assert _cycles(graph) == [sorted(mods)]
    assert _imports(tmp_path / "b.py", mods, name="fsdp_workflow.report.status.b") == set()  # the stage order ignores it


def test_the_checks_catch_a_cycle_and_an_upward_edge() -> None:
    """The checks themselves can fail: a made-up graph with both faults."""
    graph = {"fsdp_workflow.config.a": {"fsdp_workflow.config.b"},
             "fsdp_workflow.config.b": {"fsdp_workflow.config.a", "fsdp_workflow.plan.spec"},
             "fsdp_workflow.plan.spec": set()}
    assert _cycles(graph) == [["fsdp_workflow.config.a", "fsdp_workflow.config.b"]]
    assert upward_edges(graph) == [("fsdp_workflow.config.b", "fsdp_workflow.plan.spec")]


# ---------------------------------------------------------------- run-directory names
# CACHE_DIR is left out: ".cache" is XDG's name too (the run's cache is XDG_CACHE_HOME by design).
RUN_DIR_NAMES = {
    value for key, value in vars(rundir).items()
    if key.isupper() and isinstance(value, str) and key != "CACHE_DIR"
    and key.endswith(("_FILE", "_DIR", "_SBATCH", "_SCRIPT", "_HOOK", "_MARKER"))
}
_AS_PATH = re.compile("/(" + "|".join(re.escape(n) for n in sorted(RUN_DIR_NAMES, key=len, reverse=True)) + r")(?![\w.])")


def _string_constants(tree: ast.AST) -> List[Tuple[int, str]]:
    """String constants and f-string pieces, docstrings excluded."""
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def _literal_offences(path: Path) -> List[str]:
    """A run-directory name as a whole string, after a ``/``, or a ``step-`` prefix."""
    found = []
    for line, text in _string_constants(ast.parse(path.read_text())):
        if (text in RUN_DIR_NAMES or text.startswith(rundir.STEP_PREFIX)
                or _AS_PATH.search(text)):
            found.append(f"{path.name}:{line}: {text!r}")
    return found


def test_run_dir_names_live_in_one_module() -> None:
    assert len(RUN_DIR_NAMES) > 15  # the contract is what this test reads
    offences = []
    for name, path in _modules().items():
        if name != RUN_DIR_MODULE:
            offences += [f"{name}: {o}" for o in _literal_offences(path)]
    assert offences == [], "ask fsdp_workflow.core.rundir for these paths:\n" + "\n".join(offences)


# ---------------------------------------------------------------- model-directory names
MODEL_DIR_MODULE = "fsdp_workflow.core.modeldir"
MODEL_DIR_NAMES = {value for key, value in vars(modeldir).items() if key.endswith("_FILE")}


def _model_dir_offences(path: Path) -> List[str]:
    """A model directory's name (``verification.json``...) as a whole string, or after a ``/``."""
    return [f"{path.name}:{line}: {text!r}" for line, text in _string_constants(ast.parse(path.read_text()))
            if text in MODEL_DIR_NAMES or any(text.endswith("/" + n) for n in MODEL_DIR_NAMES)]


def test_model_dir_names_live_in_one_module() -> None:
    assert {"verification.json", "model.safetensors.index.json", "README.md"} <= MODEL_DIR_NAMES
    offences = []
    for name, path in _modules().items():
        if name != MODEL_DIR_MODULE:
            offences += [f"{name}: {o}" for o in _model_dir_offences(path)]
    assert offences == [], "ask fsdp_workflow.core.modeldir for these names:\n" + "\n".join(offences)


@pytest.mark.parametrize("literal", ['CKPT = "checkpoints"', 'p = run_dir / "hf_model"', 'name = f"step-{n}"',
                                     'msg = f"see {run}/logs/train.out"'])
def test_the_literal_check_would_catch(tmp_path: Path, literal: str) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(f'"""A docstring may say checkpoints/step-N."""\n{literal}\n')
    assert len(_literal_offences(bad)) == 1


# ---------------------------------------------------------------- module names
# A name every pluggable package gives its protocol and its registry, read with the package's name
# (container.base, backends.registry): the pattern is the point.
SHARED_BY_DESIGN = {"base", "registry"}


def basename_collisions() -> Dict[str, List[str]]:
    """Module file names (``__init__``/``__main__`` aside) that two or more package modules share.

    A ``strategies/`` package holds one module per strategy in each stage (config's rules,
    train's wrapping): those names repeat across stages by design and are not counted.
    """
    by_name: Dict[str, List[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.stem in ("__init__", "__main__") or path.parent.name == "strategies":
            continue
        by_name.setdefault(path.stem, []).append(path.relative_to(PACKAGE).as_posix())
    return {name: paths for name, paths in by_name.items() if len(paths) > 1}


def test_no_two_modules_share_a_name() -> None:
    """``report/curves.py`` (data) beside ``report/status/curves.py`` (drawing) made every search, traceback
    and import line ambiguous: a module's file name says which one it is."""
    new = {n: p for n, p in basename_collisions().items() if n not in SHARED_BY_DESIGN}
    assert new == {}, f"give each module a name of its own (git mv): {new}"




def test_train_exit_json_has_one_reader() -> None:
    """``train_exit.json`` is written by the trainer (``train/loop.record_exit``) and read by the run record
    alone (``config/record.py``: ``RunRecord.train_exit`` / ``train_exit_since``); the trainer's peer-timeout
    check and the local backend ask it. The rendered train script's ``sed`` is the last other reader
    (issue 50, item 2)."""
    readers = re.compile(r"train_exit\.(read_text|read_bytes|stat|open)\(|open\([^)]*train_exit|TRAIN_EXIT_FILE")
    allowed = {"fsdp_workflow.core.rundir", "fsdp_workflow.config.record",
               "fsdp_workflow.backends.slurm.scripts"}  # the sed in train.sbatch, still to go through a CLI
    found = sorted(name for name, path in _modules().items()
                   if name not in allowed and readers.search(path.read_text()))
    assert found == [], f"modules reading train_exit.json themselves (ask config.record.open_run): {found}"
