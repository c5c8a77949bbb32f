"""Hydra's composition errors as one message naming the file (and line), for exit code 2.

Hydra reports a YAML syntax error in an experiment file with a 95-line
traceback, and an unknown group option with its whole search path. Both are
the user's config, not a crash: the CLI lets Hydra raise them
(``HYDRA_FULL_ERROR=1`` inside), and :func:`describe` turns them into the
lines printed under ``fsdp_workflow: invalid config``. The traceback is shown
only when the user asked for it (``log_level=DEBUG`` or ``HYDRA_FULL_ERROR=1``).
"""

from __future__ import annotations

import difflib
import errno
import os
import re
from typing import List, Optional

_HIDDEN_OPTION_SUFFIX = "_schema"  # the typed schemas registered in each group: not something to select


def _chain(err: BaseException) -> List[BaseException]:
    """``err`` and its causes / contexts, outermost first (cycles cut)."""
    out: List[BaseException] = []
    cur: Optional[BaseException] = err
    while cur is not None and cur not in out:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _yaml_message(err: BaseException) -> str:
    """``FILE, line L, column C: YAML syntax error: problem (context at line L')`` from a marked YAML error."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    if mark is None:
        return f"YAML syntax error: {problem}"
    out = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: YAML syntax error: {problem}"
    context, ctx = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and ctx is not None and ctx is not mark:
        out += f" ({context} at line {ctx.line + 1}, column {ctx.column + 1})"
    return out


def _missing_option_message(text: str) -> str:
    """Hydra's "Could not find 'group/option'" without the search path, and without the schema entries."""
    lines = text.split("\n")
    if "Config search path:" in lines:
        at = lines.index("Config search path:")
        paths = [ln.strip().split("path=", 1)[-1] for ln in lines[at + 1:] if "path=" in ln]
        lines = lines[:at]
        user = [p for p in paths if p.startswith("file://")]
        if user:
            lines.append("searched (as group/option.yaml): " + ", ".join(user))
    lines = [ln for ln in lines if not (ln.startswith("\t") and ln.strip().endswith(_HIDDEN_OPTION_SUFFIX))]
    return "\n".join(ln.replace("\t", "  ") for ln in lines if ln.strip())


def _config_file(err: BaseException) -> Optional[str]:
    """``In 'experiment/x'``: the config file Hydra names when composing it failed; None for an override."""
    first = str(err).strip().split("\n", 1)[0]
    return first.split(":", 1)[0] if first.startswith("In '") else None


def _unknown_key_message(err: BaseException, chain: List[BaseException]) -> Optional[str]:
    """An unknown key in a config file, as the command line's is reported: the key, why, the likely fix."""
    from omegaconf.errors import ConfigKeyError

    from fsdp_workflow.config.keys import check_key

    for e in chain:
        key = getattr(e, "full_key", None)
        if isinstance(e, ConfigKeyError) and key:
            issue = check_key(str(key))
            if issue is None:
                return None
            where = _config_file(err) or "In a config file"
            return f"{where}: {issue.key}\n  why: {issue.why}\n  fix: {issue.fix} (in that file)"
    return None


_CONVERT = re.compile(r"Value '(?P<value>.*)' of type '\w+' could not be converted to (?P<kind>\w+)")
_CHOICE = re.compile(r"Invalid value '(?P<value>.*)', expected one of \[(?P<options>.*)\]")


def _bad_choice_message(chain: List[BaseException]) -> Optional[str]:
    """A value outside an enum's options (``strategy.name=fsdp3``): the key, the options, the closest one."""
    for e in chain:
        key = getattr(e, "full_key", None)
        found = _CHOICE.search(str(e))
        if key and found and found["value"] != "$VALUE":
            options = [o.strip() for o in found["options"].split(",") if o.strip()]
            close = difflib.get_close_matches(found["value"], options, n=1, cutoff=0.5)
            fix = f"{key}={close[0]} (the closest)" if close else f"{key}={options[0]} (or another of these)"
            return f"{key} = {found['value']!r}\n  why: not one of {', '.join(options)}\n  fix: {fix}"
        found = _CONVERT.search(str(e))
        if key and found and found["value"] != "$VALUE":
            kind = found["kind"].lower()
            return (f"{key} = {found['value']!r}\n  why: not {'an' if kind[0] in 'aeiou' else 'a'} {kind}\n"
                    f"  fix: {key}=<{kind}>")
    return None


_TOKEN = re.compile(r"token recognition error at: '(?P<char>.+?)'|mismatched input '(?P<input>.+?)'")


def _override_message(err: BaseException, chain: List[BaseException]) -> Optional[str]:
    """An override Hydra's grammar cannot read (``run_dir=/runs/é``): the character, and the quoting that reads it.

    Hydra reads an unquoted value only in its own grammar (ASCII letters and digits, ``/ . - _ : ~``...):
    a non-ASCII directory name, or brackets in one, stops its lexer. Quoted for Hydra, and the
    quotes quoted for the shell, the same value is read as it is (issue 49).
    """
    from hydra.errors import OverrideParseException

    from fsdp_workflow.core.commands import hydra_value, shell

    parse = next((e for e in chain if isinstance(e, OverrideParseException)), None)
    override = getattr(parse, "override", None)
    if parse is None or not isinstance(override, str) or "=" not in override:
        return None
    key, value = override.split("=", 1)
    if value[:1] in ("'", '"') or value.startswith(("[", "{")):
        return None  # already quoted, or a list or dict: Hydra's own message says where it broke
    found = next((m for m in (_TOKEN.search(str(e)) for e in chain) if m), None)
    what = (f"{found['char']!r} is not one of them" if found and found["char"] else
            f"its grammar stops at {found['input']!r}" if found else "this value is not")
    quoted = f"{key}={hydra_value(value)}"
    # "key='value'" reads best; shlex's form where double quotes would expand or end something
    typed = f'"{quoted}"' if not set('$`"\\!') & set(quoted) else shell([quoted])
    return (f"{override}\n  why: Hydra reads an unquoted value only when it is plain ASCII letters, digits and "
            f"/ . - _ : ~ + @ and a few more; {what}, so its lexer stops there\n"
            f"  fix: quote the value for Hydra, and those quotes for the shell: {typed}")


_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def unwritable_run_dir(err: BaseException, cwd: str) -> Optional[str]:
    """Hydra could not create the run directory (a read-only or foreign working directory): the lines saying so.

    With no ``run_dir=``, Hydra makes ``runs/NAME/TIME`` below the working directory before
    anything of ours runs; from a read-only one (a container's image, a shared checkout) that
    failed as an "invalid config" quoting ``[Errno 30]``. Nothing is wrong with the config: the
    message names the directory and the two ways out (issue 49).

    Returns:
        ``run_dir = ...`` / why / fix lines, or None when ``err`` is not that.
    """
    chain = _chain(err)
    found = next((e for e in chain if isinstance(e, OSError) and e.errno in _UNWRITABLE), None)
    if found is None:
        return None
    # makedirs fails on the first level it cannot create; the chain's other errors name the whole path
    names = [str(e.filename) for e in chain if isinstance(e, OSError) and e.filename]
    target = os.path.abspath(os.path.join(cwd, max(names, key=len))) if names else cwd
    refused = os.path.abspath(os.path.join(cwd, str(found.filename))) if found.filename else cwd
    return (f"run_dir = {target!r} (where a run without run_dir= goes: below the working directory {cwd})\n"
            f"  why: cannot create {refused}: {found.strerror}; nothing is wrong with the config\n"
            f"  fix: run from a writable directory (cd to your project, or ~), or name one: run_dir=/writable/path/RUN")


def describe(err: BaseException) -> str:
    """The lines (without a heading) that say what is wrong with the composed config and where.

    Args:
        err: what Hydra raised before the task ran.

    Returns:
        One message: for a YAML error its file, line and column; for an unknown group
        option the group, the option and the options there are; otherwise Hydra's own
        message followed by its cause's first lines (the key and the value).
    """
    import yaml
    from hydra.errors import MissingConfigException

    chain = _chain(err)
    for e in chain:
        if isinstance(e, yaml.YAMLError):
            return _yaml_message(e)
    if isinstance(err, MissingConfigException):
        return _missing_option_message(str(err))
    override = _override_message(err, chain)
    if override is not None:
        return override
    choice = _bad_choice_message(chain)
    if choice is not None:
        where = _config_file(err)
        return f"{where}: {choice}" if where else choice
    unknown = _unknown_key_message(err, chain)
    if unknown is not None:
        return unknown
    parts = [str(err).strip()]
    for e in chain[1:]:
        text = "\n".join(ln for ln in str(e).strip().split("\n")
                         if not ln.strip().startswith(("reference_type=", "object_type="))
                         and "$VALUE" not in ln and "$KEY" not in ln)  # OmegaConf's unformatted templates
        if text and text not in parts[-1]:
            parts.append(text)
    return "\n".join(parts)
