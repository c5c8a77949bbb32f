"""Shell words: quoting, ``launch.env``, and the container's env filter, for every backend's scripts.

Every value that came from the config is quoted with :func:`shlex.quote`;
only :class:`~fsdp_workflow.plan.jobs.Expand` arguments, which this package
builds from constants, are left for the job's shell to expand. The batch scripts
themselves (``train.sbatch``, ``submit.sh``...) are rendered by their scheduler's
backend (:mod:`fsdp_workflow.backends.slurm.scripts`) from these words; nothing
else concatenates shell.
"""

from __future__ import annotations

import shlex
from typing import Iterable, List, Mapping

from fsdp_workflow.container.base import ContainerCommand, EnvFilter
from fsdp_workflow.core.envnames import ENV_NAME_RULE, is_env_name
from fsdp_workflow.core.rundir import LAUNCH_ENV_FILE
from fsdp_workflow.plan.jobs import Expand

LAUNCH_ENV_HEADER = (
    "# Environment read by Accelerate on every rank; written by fsdp_workflow.\n"
    "# Load it with:  source launch.env   (each line exports one variable)\n"
)
ENV_FILTER_ARGV0 = "fsdp_workflow-container-env"  # $0 of the env filter, shown by ps


# ---------------------------------------------------------------- words
def shell_word(arg: str) -> str:
    """Quote one argument; runtime expansions are double-quoted so they still expand."""
    if isinstance(arg, Expand):
        return f'"{arg}"'
    return shlex.quote(str(arg))


def shell_join(argv: Iterable[str]) -> str:
    return " ".join(shell_word(a) for a in argv)


def exports(env: Mapping[str, str]) -> List[str]:
    """``export NAME=value`` lines; every value quoted, so nothing is expanded.

    Raises:
        ValueError: a name no shell can export, a value that is not a string or holds a NUL byte.
    """
    lines = []
    for key, value in env.items():
        if not is_env_name(key):
            raise ValueError(f"{key!r} is not a valid environment variable name ({ENV_NAME_RULE})")
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {type(value).__name__}")
        if "\0" in value:
            raise ValueError(f"{key} holds a NUL byte, which no process environment can carry")
        lines.append(f"export {key}={shlex.quote(value)}")
    return lines


def render_launch_env(env: Mapping[str, str]) -> str:
    """``launch.env``: one ``export NAME='value'`` per variable, for ``set -a; . launch.env``.

    Spaces, quotes, ``$``, ``;`` and newlines reach the program unchanged;
    :func:`fsdp_workflow.config.accelerate_env.read_launch_env` parses it back.

    Raises:
        ValueError: see :func:`exports`; the message is prefixed with ``launch.env``.
    """
    try:
        return LAUNCH_ENV_HEADER + "".join(line + "\n" for line in exports(env))
    except ValueError as err:
        raise ValueError(f"{LAUNCH_ENV_FILE}: {err}") from None


# ---------------------------------------------------------------- containers
def env_filter_program(f: EnvFilter) -> str:
    """A constant bash program that lets only the runtime's pass-through variables into the image.

    Built from the runtime's :class:`~fsdp_workflow.container.base.EnvFilter`, never
    from a config value. Apptainer's re-exports each passing variable as
    ``APPTAINERENV_<NAME>`` (honoured under ``--cleanenv``) after dropping any such
    variable the user's shell had; Charliecloud's (``drop_rest``) unsets every
    variable but the passing ones and those ``ch-run`` needs on the host.
    """
    cases = []
    if f.drop_prefixes:
        cases.append("|".join(f"{p}*" for p in f.drop_prefixes) + ') unset "$n";; ')
    keep = "|".join([f"{p}*" for p in f.pass_prefixes] + list(f.pass_names))
    if f.export_prefix:
        cases.append(f'{keep}) export "{f.export_prefix}$n=${{!n}}";; ')
    else:
        cases.append(f"{keep}) ;; ")
    if f.drop_rest:
        cases.append("|".join(f.keep_host) + ") ;; " if f.keep_host else "")
        cases.append('*) unset "$n";; ')
    return 'for n in $(compgen -e); do case "$n" in ' + "".join(cases) + 'esac; done; exec "$@"'


def wrapped_argv(cmd: ContainerCommand, argv: List[str]) -> List[str]:
    """A step's argv inside the image: env filter (if the runtime has one), runtime, in-image ``env``, the step."""
    head = ["bash", "-c", env_filter_program(cmd.env_filter), ENV_FILTER_ARGV0] if cmd.env_filter else []
    return head + list(cmd.prefix) + list(argv)


def runtime_argv(argv: List[str]) -> List[str]:
    """A step's argv without the env filter :func:`wrapped_argv` puts in front (unchanged when it has none):
    the runtime's command line (``apptainer exec ... python -m ...``), for a user to read."""
    return argv[argv.index(ENV_FILTER_ARGV0) + 1:] if ENV_FILTER_ARGV0 in argv else list(argv)
