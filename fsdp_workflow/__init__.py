"""fsdp_workflow: a YAML experiment in, a verified Hugging Face model out.

Pipeline stages, each a subpackage, each importing only the ones above it in this list
(``tests/test_imports.py``):

* ``core``        - the run-directory contract, exit codes, sizes, allow-list unpickling
* ``config``      - typed schema, cross-field validation, the Accelerate environment, and the
                    run record (``config.record``): the one read side of a run directory
* ``container``   - one class per container runtime (Apptainer, pyxis, Charliecloud, none): checks,
                    binds, environment filtering, wrapping of each step, as data
* ``plan``        - the launch built as data and rendered (sbatch, submit.sh, launcher)
* ``launch``      - run the plan locally or submit it to Slurm (``api``: ``fsdp_workflow.submit``,
                    the same path as a function returning submitit job handles)
* ``preflight``   - run by the training job before torchrun, one task per node
* ``train``       - the per-rank trainer (Accelerate + FSDP/DeepSpeed, DCP checkpoints)
* ``consolidate`` - stream sharded checkpoints into safetensors and verify them
* ``evaluate``    - one checkpoint: consolidate it, measure held-out perplexity
* ``report``      - status, the model card, curves and plots, all read from the run record;
                    above train and consolidate, and nothing below imports it
                    (``fsdp_workflow.status`` is its status command's entry point)

``data`` feeds ``train``; ``train`` and ``consolidate`` rest on ``config`` and ``core`` only.
"""

__version__ = "0.1.0"

# The Python API (fsdp_workflow/api.py), imported on first use: `import fsdp_workflow`
# stays free of Hydra and Slurm for the trainer's ranks and the consolidator.
__all__ = ["Chain", "SubmitError", "submit"]


def __getattr__(name: str) -> object:
    """``fsdp_workflow.submit`` and friends, loaded from :mod:`fsdp_workflow.api` when first asked for."""
    if name in __all__:
        from fsdp_workflow import api

        return getattr(api, name)
    raise AttributeError(f"module 'fsdp_workflow' has no attribute {name!r}")
