"""Which versions of the libraries we stand on are installed, and whether they are the tested ones.

    python -m fsdp_workflow --version

The project's behaviour rests on a few libraries whose releases change it without a
word (Accelerate 1.16 changed its FSDP2 mixed-precision policy; transformers 5.25
broke the compiled, checkpointed layer). ``pyproject.toml`` declares the ranges the
suite has run on, and ``requirements/`` locks the exact set CI installs
(docs/contributing.md, "Dependencies"). This module answers, without importing any of
those libraries (planning stays fast and torch-free):

* :func:`installed`: the version of each library that matters, or None;
* :func:`outside_tested`: each installed library outside its declared range;
* :func:`report`: the lines ``--version`` prints.

``provenance.json`` (the planning environment), ``train_exit.json`` (the trainer's) and
the model card (what trained the model) record :func:`installed`.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path
from typing import Dict, List, Optional

# The libraries whose version changes what a run does, in the order --version prints them.
# Distribution names (as pip knows them), not module names.
LIBRARIES = ("torch", "transformers", "accelerate", "safetensors", "tokenizers", "huggingface_hub", "kernels",
             "datasets", "hydra-core", "omegaconf", "submitit", "deepspeed", "torchao")
# Of those, the ones a release of which needs a GPU build or an extra (tools/check_newest.sh --unbounded leaves them)
BUILDS = ("torch", "deepspeed", "torchao")

DIST = "fsdp_workflow"
LOCK_DIR = "requirements"  # beside pyproject.toml: cpu.txt, cuda.txt, common.txt


def installed(names: tuple = LIBRARIES) -> Dict[str, Optional[str]]:
    """Each library's installed version (None when it is not installed)."""
    out: Dict[str, Optional[str]] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _pyproject() -> Optional[Path]:
    """The checkout's ``pyproject.toml`` when the package runs from one (editable, PYTHONPATH, snapshot)."""
    path = Path(__file__).resolve().parents[2] / "pyproject.toml"
    return path if path.is_file() else None


def declared() -> Dict[str, str]:
    """The ranges this fsdp_workflow declares for its libraries: ``{name: specifier}``.

    From the checkout's ``pyproject.toml`` when the package runs from one (editable, a
    PYTHONPATH run), else from the installed distribution's metadata (a wheel, a code
    snapshot). Extras count too (deepspeed, torchao). Empty when neither can be read.
    """
    pyproject = _pyproject()
    if pyproject is not None:  # a checkout: its own file, even if an older install's metadata lingers
        requires = _pyproject_requirements(pyproject.read_text())
    else:
        try:
            requires = metadata.requires(DIST) or []
        except metadata.PackageNotFoundError:
            requires = []
    ranges: Dict[str, str] = {}
    for line in requires:
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(\[[^\]]*\])?\s*([^;]*)", line)
        if m and _norm(m.group(1)) in {_norm(n) for n in LIBRARIES}:
            name = next(n for n in LIBRARIES if _norm(n) == _norm(m.group(1)))
            ranges.setdefault(name, m.group(3).strip())
    return ranges


def _pyproject_requirements(text: str) -> List[str]:
    """The quoted requirement strings of ``pyproject.toml``'s dependency lists (no TOML parser on 3.10)."""
    return re.findall(r'"([A-Za-z0-9_.\-]+(?:\[[^\]]*\])?\s*[<>=!~][^"]*)"', text)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def outside_tested(versions: Optional[Dict[str, Optional[str]]] = None,
                   ranges: Optional[Dict[str, str]] = None) -> List[str]:
    """One line per installed library outside the range this fsdp_workflow declares (tested)."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    versions = installed() if versions is None else versions
    out = []
    for name, spec in (declared() if ranges is None else ranges).items():
        found = versions.get(name)
        if not found or not spec:
            continue
        try:
            # a local build tag (+cpu, +cu130) is the same release
            ok = Version(found.split("+")[0]) in SpecifierSet(spec)
        except (InvalidSpecifier, InvalidVersion):
            continue
        if not ok:
            out.append(f"{name} {found} is outside the tested range {spec}")
    return out


def report() -> str:
    """What ``python -m fsdp_workflow --version`` prints: our version, each library's, and any untested one."""
    try:
        ours = metadata.version(DIST)
    except metadata.PackageNotFoundError:
        ours = "(not installed: run from a checkout)"
    ranges, found = declared(), installed()
    lines = [f"fsdp_workflow {ours}"]
    for name, version in found.items():
        if version is None and name in ("deepspeed", "torchao"):
            continue  # optional extras, not installed
        spec = ranges.get(name)
        lines.append(f"  {name:<16} {version or 'not installed':<16}" + (f" tested: {spec}" if spec else ""))
    problems = outside_tested(found, ranges)
    if problems:
        lines.append("untested versions (docs/contributing.md, 'Dependencies'; bash tools/install.sh installs "
                     "the tested set):")
        lines += [f"  {p}" for p in problems]
    else:
        lines.append("every library is inside the tested ranges (the exact set CI ran: requirements/)")
    return "\n".join(lines)


__all__ = ["BUILDS", "LIBRARIES", "declared", "installed", "outside_tested", "report"]
