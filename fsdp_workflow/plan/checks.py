"""Every check a config gets before anything is written: the config stage's rules, the container's, the data's.

Config sits below container in the stages (config <- container <- plan), so
:func:`fsdp_workflow.config.validate.validate` cannot call the container
stage's rule itself; this is the one place that runs both, and every caller
that is about to write or submit (the CLI, each point of a sweep) asks it::

    report = check(cfg)
    report.raise_if_errors()   # one ConfigError listing every problem
"""

from __future__ import annotations

from fsdp_workflow.config.errors import ValidationReport
from fsdp_workflow.config.device_defaults import settle_compile
from fsdp_workflow.config.model_dir import resolve_model
from fsdp_workflow.config.path_keys import make_paths_absolute, path_issues
from fsdp_workflow.config.schema import WorkflowConfig
from fsdp_workflow.config.validate import validate
from fsdp_workflow.container.image_checks import check_container_steps
from fsdp_workflow.data import plan_checks as data_checks
from fsdp_workflow.data.rules_path import check_data_paths
from fsdp_workflow.plan.inputs import check_eval_data
from fsdp_workflow.plan.resume_changes import check_resume


def check(cfg: WorkflowConfig) -> ValidationReport:
    """All errors and warnings of ``cfg``: config rules, then images, binds and ``--nv``, then the data format.

    First every path key is made absolute (:mod:`fsdp_workflow.config.path_keys`, whose
    refusals of paths that cannot work join the report), and ``cfg.model`` is made to describe the model that will train (its directory's
    ``config.json``: :func:`fsdp_workflow.config.model_dir.resolve_model`); what that
    replaced comes back as the report's notes, as does ``train.compile``'s default
(:func:`fsdp_workflow.config.device_defaults.settle_compile`). ``cfg`` is changed in place, so what
    is written and run is what was checked.
    """
    make_paths_absolute(cfg)  # against the working directory: config.yaml means the same files from anywhere
    notes = resolve_model(cfg) + settle_compile(cfg)  # what the run will do, before the rules judge it
    report = validate(cfg, extra_rules=[check_container_steps, check_data_paths, *data_checks.RULES, check_eval_data,
                                          check_resume])
    report.notes[:0] = notes
    report.errors.extend(path_issues(cfg))
    return report
