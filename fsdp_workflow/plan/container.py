"""Container wrapping for the planner; the code lives in :mod:`fsdp_workflow.container`."""

from fsdp_workflow.container import bind_paths, container_issues, srun_container_args, wrap_argv

__all__ = ["bind_paths", "container_issues", "srun_container_args", "wrap_argv"]
