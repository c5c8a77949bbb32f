"""The docs' tables of config groups and experiments list exactly what ``--help`` lists.

README.md ("Config groups") and docs/configuration.md ("Groups and experiments") each
name every option of every group; a group option added or removed without them must fail
here, not mislead a reader (issue 41, item 2: `mixture` and `charliecloud` were missing).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Set

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `(\w+)` \| (.*?) \|")


def _help_groups() -> Dict[str, Set[str]]:
    """The groups and options ``python -m fsdp_workflow --help`` prints, without the ``*_schema`` entries."""
    out = subprocess.run([sys.executable, "-m", "fsdp_workflow", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    section = out.split("== Configuration groups ==", 1)[1].split("== Config ==", 1)[0]
    groups: Dict[str, Set[str]] = {}
    for line in section.splitlines():
        name, sep, rest = line.partition(": ")
        if sep and re.fullmatch(r"\w+", name):
            groups[name] = {o.strip() for o in rest.split(",") if o.strip() and not o.strip().endswith("_schema")}
    assert {"model", "data", "strategy", "experiment"} <= set(groups), out  # the help's layout still parses
    return groups


def _options(cell: str) -> Set[str]:
    """The backquoted options of a table cell; asides in parentheses left out, `a_zero1/2/3` spelled out."""
    cell = re.sub(r"\([^()]*\)", "", cell)
    found: Set[str] = set()
    for word in re.findall(r"`([^`]+)`", cell):
        stem = re.fullmatch(r"(\w*?)(\d+(?:/\d+)+)", word)
        found |= {stem[1] + n for n in stem[2].split("/")} if stem else {word}
    return found


def _table(text: str, heading: str) -> Dict[str, Set[str]]:
    """The first table under ``heading``: its first column's name -> the options of its second."""
    body = text.split(heading, 1)[1]
    rows: Dict[str, Set[str]] = {}
    for line in body.splitlines()[1:]:
        if line.startswith("#"):
            break
        match = ROW.match(line)
        if match:
            rows[match[1]] = _options(match[2])
        elif rows and not line.startswith("|"):
            break
    return rows


def test_the_readme_and_configuration_tables_list_every_group_option_of_help() -> None:
    groups = _help_groups()
    readme = _table((ROOT / "README.md").read_text(), "## Config groups")
    config_page = (ROOT / "docs" / "configuration.md").read_text()
    configuration = _table(config_page, "## Groups and experiments")
    experiments = set(_table(config_page, "| experiment | what |"))
    wrong = []
    for name, options in groups.items():
        if name != "experiment" and configuration.get(name) != options:
            wrong.append(f"docs/configuration.md, group {name}: {sorted(configuration.get(name, ()))}; --help: {sorted(options)}")
        if readme.get(name) != options:
            wrong.append(f"README.md, group {name}: {sorted(readme.get(name, ()))}; --help: {sorted(options)}")
    if experiments != groups["experiment"]:
        wrong.append(f"docs/configuration.md, experiments: {sorted(experiments)}; --help: {sorted(groups['experiment'])}")
    assert not wrong, "the docs' group tables and --help disagree:\n" + "\n".join(wrong)
