"""The one place a ``DictConfig`` becomes a typed ``WorkflowConfig``.

The Hydra entry point calls :func:`to_typed` once; everything below it takes
typed objects. The trainer and the Slurm jobs call :func:`load_run_config` on
the resolved ``RUN_DIR/config.yaml`` the planner wrote, so every rank and
every step sees exactly what was validated.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from fsdp_workflow.config.schema import WorkflowConfig, register_configs

PACKAGE_DIR = Path(__file__).resolve().parents[1]
# The Hydra config tree and the shipped sample data live inside the package, so
# an ordinary (non-editable) ``pip install`` carries them.
CONF_DIR = PACKAGE_DIR / "conf"
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
        omegaconf.errors.OmegaConfBaseException: on a missing mandatory value or a
            type error; the CLI turns these into a message naming the key.
    """
    register_resolvers()
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, WorkflowConfig):  # composed without the schema: merge it in
        merged = OmegaConf.merge(OmegaConf.structured(WorkflowConfig), cfg)
        obj = OmegaConf.to_object(merged)
    assert isinstance(obj, WorkflowConfig)
    return obj


def to_yaml(cfg: WorkflowConfig) -> str:
    """Serialise a typed config back to YAML (enums as their names)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def load_run_config(path: str | Path) -> WorkflowConfig:
    """Load a resolved ``config.yaml`` (or a run directory holding one) as a typed config."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no config.yaml here. Pass the run directory written by "
            "`python -m fsdp_workflow ... dry_run=true run_dir=DIR` (or its config.yaml)."
        )
    schema = OmegaConf.structured(WorkflowConfig)
    return to_typed(OmegaConf.merge(schema, OmegaConf.load(path)))


def normalize_overrides(overrides: Sequence[str]) -> List[str]:
    """``+experiment=X`` and ``experiment=X`` both select an experiment.

    The root config's defaults list holds ``experiment: smoke`` so that a bare
    command is the smoke run; Hydra would refuse to *append* a second one.
    """
    return ["experiment=" + o.split("=", 1)[1] if o.startswith("+experiment=") else o for o in overrides]


def compose(overrides: Optional[Sequence[str]] = None) -> WorkflowConfig:
    """Compose ``conf/`` with Hydra's compose API and return the typed config.

    For tests and notebooks; the CLI goes through ``@hydra.main``. ``run_dir``
    defaults to ``runs/compose`` here because there is no Hydra runtime.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    register_resolvers()
    ov: List[str] = normalize_overrides(overrides or [])
    if not any(o.startswith("run_dir=") for o in ov):
        ov.append("run_dir=runs/compose")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=ov)
    return to_typed(cfg)
