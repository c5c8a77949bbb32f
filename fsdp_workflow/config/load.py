"""The one place a ``DictConfig`` becomes a typed ``WorkflowConfig``.

The Hydra entry point calls :func:`to_typed` once; everything below it takes
typed objects. The trainer and the Slurm jobs call :func:`load_run_config` on
the resolved ``RUN_DIR/config.yaml`` the planner wrote, so every rank and
every step sees exactly what was validated.
"""

from __future__ import annotations

import dataclasses
import os
import re
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from fsdp_workflow.config.schema import RENAMED_VALUES, WorkflowConfig, field_hints, register_configs
from fsdp_workflow.core.rundir import CONFIG_FILE

if TYPE_CHECKING:
    from fsdp_workflow.config.errors import Issue

PACKAGE_DIR = Path(__file__).resolve().parents[1]
# The Hydra config tree and the shipped sample data travel inside the package, so
# an ordinary (non-editable) ``pip install`` carries them. In a checkout the tree
# sits at the top level (``conf/``, as the README's picture shows) and
# ``fsdp_workflow/conf`` is a relative link to it: editable installs, PYTHONPATH
# and worktrees see one tree, and the wheel build copies it in. Resolved, so Hydra's
# messages and the search path name the real files.
CONF_DIR = (PACKAGE_DIR / "conf").resolve()
ASSETS_DIR = PACKAGE_DIR / "assets"
# The checkout the package was imported from (for ``git describe`` in provenance);
# for an installed package this is site-packages and git simply finds no repository.
PROJECT_ROOT = PACKAGE_DIR.parent


def register_resolvers() -> None:
    """Register ``${fw.assets:}`` (the package's shipped data, e.g. the smoke corpus). Idempotent."""
    if not OmegaConf.has_resolver("fw.assets"):
        OmegaConf.register_new_resolver("fw.assets", lambda: str(ASSETS_DIR))


def to_typed(cfg: DictConfig) -> WorkflowConfig:
    """Resolve interpolations and convert to the typed dataclass tree.

    Raises:
        ConfigError: a key the schema does not know (e.g. added with ``+``).
        omegaconf.errors.OmegaConfBaseException: on a missing mandatory value or a
            type error; the CLI turns these into a message naming the key.
    """
    from fsdp_workflow.config.errors import ConfigError
    from fsdp_workflow.config.keys import composed_key_issues

    register_resolvers()
    unknown = composed_key_issues(cfg)
    if unknown:  # to_object would drop them without a word
        raise ConfigError(unknown)
    refused = _type_renamed_keys(cfg)
    if refused:
        raise ConfigError(refused)
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, WorkflowConfig):  # composed without the schema: merge it in
        merged = OmegaConf.merge(OmegaConf.structured(WorkflowConfig), cfg)
        obj = OmegaConf.to_object(merged)
    assert isinstance(obj, WorkflowConfig)
    return obj


def to_typed_collecting(cfg: DictConfig) -> Tuple[WorkflowConfig, List["Issue"]]:
    """Like :func:`to_typed`, but unknown keys are returned as issues instead of raised.

    The keys are dropped from a copy before the conversion, so every other rule can
    still run on the rest and the user sees every problem in one report: one typo
    must not hide the config's other errors.

    Returns:
        The typed config (without the unknown keys) and one issue per unknown key.

    Raises:
        omegaconf.errors.OmegaConfBaseException: on a missing mandatory value or a type error.
    """
    from omegaconf import open_dict

    from fsdp_workflow.config.keys import composed_key_issues

    register_resolvers()
    unknown = composed_key_issues(cfg)
    if unknown:
        cfg = cfg.copy()
        with open_dict(cfg):
            for issue in unknown:
                parent, _, leaf = issue.key.rpartition(".")
                node = OmegaConf.select(cfg, parent) if parent else cfg
                if isinstance(node, DictConfig) and leaf in node:
                    del node[leaf]
    refused = _type_renamed_keys(cfg, keep_going=True)
    return to_typed(cfg), [*unknown, *refused]


def _type_renamed_keys(cfg: DictConfig, keep_going: bool = False) -> List["Issue"]:
    """Type each key composition left untyped (schema.RENAMED_VALUES) as its Enum, in place.

    An earlier version's value is spelled as this version reads it (``false`` is ``none``), as
    the command line's is (:func:`_renamed_value`). A value outside the choices is an issue
    naming the key, the value and the choices; with ``keep_going`` the key takes its default,
    so every other rule still runs and the user sees every problem at once.

    Returns:
        One issue per value outside its Enum's choices.
    """
    import difflib

    from omegaconf import flag_override
    from omegaconf.errors import ValidationError
    from omegaconf.nodes import AnyNode, EnumNode

    from fsdp_workflow.config.errors import Issue

    issues: List[Issue] = []
    for (group, key), mapping in _RENAMED_VALUES.items():
        section = cfg.get(group) if isinstance(cfg, DictConfig) else None
        if not isinstance(section, DictConfig) or not isinstance(section._get_node(key), AnyNode):
            continue  # typed already (a config.yaml merged onto the schema) or not composed here
        cls = field_hints(WorkflowConfig)[group]
        choices = field_hints(cls)[key]
        value = section[key]
        value = mapping[value] if isinstance(value, bool) else value
        try:
            node = EnumNode(enum_type=choices, value=value)
        except ValidationError:
            names = list(choices.__members__)
            close = difflib.get_close_matches(str(value), names, n=1, cutoff=0.5)
            fix = f"{group}.{key}={close[0]} (the closest)" if close else f"{group}.{key}={names[0]} (or another of these)"
            issues.append(Issue(f"{group}.{key}", value, f"not one of {', '.join(names)}", fix))
            if not keep_going:
                continue
            node = EnumNode(enum_type=choices, value=next(f.default for f in dataclasses.fields(cls) if f.name == key))
        with flag_override(section, "readonly", False):
            section[key] = node  # a typed node replaces the untyped one
    return issues


def to_yaml(cfg: WorkflowConfig) -> str:
    """Serialise a typed config back to YAML (enums as their names).

    The bytes are OmegaConf's (``OmegaConf.to_yaml(OmegaConf.structured(cfg))``, with its
    YAML dumper, so ``config.yaml`` and its recorded sha256 are unchanged) but the
    dataclasses are walked directly: building the OmegaConf tree first cost about 50 ms
    per call, and a plan serialises its config two to four times.
    ``tests/config/test_to_yaml.py`` holds the two equal on every experiment.
    """
    import yaml
    from omegaconf._utils import get_omega_conf_dumper

    return yaml.dump(_plain(cfg), Dumper=get_omega_conf_dumper(), default_flow_style=False, allow_unicode=True,
                     sort_keys=False)


def _plain(value: object, hint: object = None) -> object:
    """``value`` as OmegaConf's container would hold it: dicts, lists, enum names, floats where declared."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        hints = field_hints(type(value))
        return {f.name: _plain(getattr(value, f.name), hints.get(f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.name
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and hint in (float, Optional[float]):
        return float(value)  # a FloatNode holds a float: 1 is written 1.0
    return value


def load_run_config(path: str | Path) -> WorkflowConfig:
    """Load a resolved ``config.yaml`` (or a run directory holding one) as a typed config."""
    given = Path(path)
    path = given / CONFIG_FILE if given.is_dir() else given
    if not path.is_file():
        raise FileNotFoundError(
            f"{given}: {'not found' if path is given else f'no {CONFIG_FILE} here'}. Pass the run directory written by "
            "`python -m fsdp_workflow ... dry_run=true run_dir=DIR` (or its config.yaml)."
        )
    schema = OmegaConf.structured(WorkflowConfig)
    return to_typed(OmegaConf.merge(schema, _upgrade(OmegaConf.load(path))))


# Values earlier versions took, and what they mean now (schema.RENAMED_VALUES): a run planned before
# selective checkpointing (a bool) still loads for status, replan, evaluate and resume, and an
# experiment file holding the bool composes as the command line does.
_RENAMED_VALUES = RENAMED_VALUES


def _renamed_value(override: str) -> str:
    """``strategy.activation_checkpointing=false`` (or ``=true``, or a sweep of them) as this version spells it.

    A ``config.yaml`` holding the boolean loads (:func:`_upgrade`); the command line takes it too.
    """
    key, sep, value = override.partition("=")
    for (group, name), mapping in _RENAMED_VALUES.items():
        if sep and key.lstrip("+") == f"{group}.{name}":
            words = [w.strip().lower() for w in value.split(",")]
            if all(w in ("true", "false") for w in words):
                return key + sep + ",".join(mapping[w == "true"] for w in words)
    return override


def _upgrade(loaded):
    """A recorded config with each value an earlier version wrote spelled as this version reads it."""
    for (group, key), mapping in _RENAMED_VALUES.items():
        section = loaded.get(group) if hasattr(loaded, "get") else None
        if section is not None and key in section and isinstance(section[key], bool):
            section[key] = mapping[section[key]]
    return loaded


DEFAULT_EXPERIMENT = "smoke"
# Overrides that say where and how to plan, not what to run: a command holding
# only these is still "the bare command" and gets the smoke experiment.
_RUN_LEVEL_KEYS = ("run_dir", "dry_run")


def _names_config(override: str) -> bool:
    """True when an override selects a group or sets a key of the config."""
    from fsdp_workflow.config.keys import override_key

    key = override_key(override)
    return key is not None and not (key.startswith("hydra.") or key == "hydra" or key in _RUN_LEVEL_KEYS)


# A home-relative path as a whole override value, bare or quoted: ~/x, ~user/x, "~/x". Not a sweep (a,b),
# not a list, not a bare ~.
_HOME_VALUE = re.compile(r"""^(?:(?P<path>~[A-Za-z0-9_.-]*/[^,\s'"\[\]{}()=\\]*)"""
                         r"""|(?P<q>['"])(?P<quoted>~[A-Za-z0-9_.-]*/[^'"\\]*)(?P=q))$""")


def expand_home(override: str) -> str:
    """``key=~/x`` with the home directory spelled out, as a shell would for ``run_dir=~/x``.

    Hydra's grammar refuses a bare ``~`` at the start of a value (a lexer error that
    names no key), and a quoted one reaches the config as a literal ``~``: Hydra then
    made a directory named ``~`` in the working directory for ``run_dir="~/x"``, the
    one ``rm -rf ~`` would later be typed to remove. Flags and ``hydra.*`` keys are
    left as they are; so is anything but a single path (a sweep ``a,b``, a list).
    """
    key, sep, value = override.partition("=")
    if not sep or override.startswith("-") or key.lstrip("+~").startswith("hydra"):
        return override
    found = _HOME_VALUE.match(value.strip())
    if found is None:
        return override
    path = found["path"] or found["quoted"]
    expanded = os.path.expanduser(path)
    if expanded == path:  # ~nosuchuser/...: left for Hydra (and the rules) to report
        return override
    from fsdp_workflow.core.commands import hydra_value

    return f"{key}={hydra_value(expanded)}"


def normalize_overrides(overrides: Sequence[str]) -> List[str]:
    """Spell the experiment override one way and pick the default experiment.

    - ``+experiment=X`` and ``experiment=X`` both select an experiment (the root
      defaults list holds an ``experiment`` slot, so Hydra would refuse to append).
    - ``experiment=null`` means no experiment, like ``~experiment``.
    - A bare command (nothing but ``run_dir``/``dry_run``/``hydra.*`` and flags) is
      the smoke run; a command that names any group or key gets the base defaults,
      so smoke's CPU/tiny values never leak into a hand-composed run.
    - ``hydra.mode=MULTIRUN`` is ``--multirun`` (and ``hydra.mode=RUN`` the default), so a
      sweep asked for either way gets the same per-point run directories and checks.
    - A path value starting with ``~/`` is spelled out (:func:`expand_home`).
    """
    out: List[str] = []
    multirun = False
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        mode = value.strip().upper()
        if key == "hydra.mode" and mode in ("RUN", "MULTIRUN"):
            multirun = multirun or mode == "MULTIRUN"
            continue
        if o.startswith("+experiment="):
            o = o[1:]
        if o.startswith("experiment=") and o.split("=", 1)[1].strip().lower() in ("null", "none", "~", ""):
            o = "~experiment"
        out.append(expand_home(_renamed_value(o)))
    if not any(_names_config(o) for o in out):
        out.insert(0, f"experiment={DEFAULT_EXPERIMENT}")  # before any flag: argparse wants overrides together
    if multirun and not any(o in ("-m", "--multirun") for o in out):
        out.insert(0, "--multirun")
    return out


def experiment_selected(overrides: Sequence[str]) -> Optional[str]:
    """The experiment a normalised override list selects, or None for the base defaults."""
    chosen: Optional[str] = None
    for o in overrides:
        if o.startswith("experiment="):
            chosen = o.split("=", 1)[1]
        elif o == "~experiment" or o.startswith("~experiment="):
            chosen = None
    return chosen


def _hydra_compose(overrides: Sequence[str]) -> DictConfig:
    """Hydra's compose API on ``conf/`` with already normalised overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def compose(overrides: Optional[Sequence[str]] = None) -> WorkflowConfig:
    """Compose ``conf/`` with Hydra's compose API and return the typed config.

    For tests and notebooks; the CLI goes through ``@hydra.main``. ``run_dir``
    defaults to ``runs/compose`` here because there is no Hydra runtime.
    """
    ov: List[str] = normalize_overrides(overrides or [])
    if not any(o.startswith("run_dir=") for o in ov):
        ov.append("run_dir=runs/compose")
    return to_typed(_hydra_compose(ov))


def compose_collecting(overrides: Sequence[str]) -> Tuple[WorkflowConfig, List["Issue"]]:
    """Compose like the CLI: unknown keys, given or composed, come back as issues instead of raising.

    An override naming a key the schema does not know is left out of the composition
    (Hydra would stop at the first, naming no valid key) and reported with the rest,
    so the caller can show every problem in one report, as ``python -m fsdp_workflow`` does.

    Args:
        overrides: Hydra overrides, as on the command line (normalised here).

    Returns:
        The typed config and the unknown-key issues, command-line ones first.

    Raises:
        hydra.errors.HydraException: a composition error (no such option, a YAML syntax error).
        omegaconf.errors.OmegaConfBaseException: a missing mandatory value or a type error.
    """
    from fsdp_workflow.config.keys import override_key_issues

    ov = normalize_overrides(overrides)
    given = override_key_issues(ov)
    if given:
        ov = [o for o in ov if not override_key_issues([o])]
    cfg, composed = to_typed_collecting(_hydra_compose(ov))
    return cfg, [*given, *composed]
