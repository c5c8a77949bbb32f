"""fsdp_workflow: a YAML experiment in, a verified Hugging Face model out.

Pipeline stages, each a subpackage:

* ``config``      - typed schema, cross-field validation, the Accelerate environment
* ``plan``        - the launch built as data and rendered (sbatch, submit.sh, launcher)
* ``launch``      - run the plan locally or submit it to Slurm
* ``train``       - the per-rank trainer (Accelerate + FSDP/DeepSpeed, DCP checkpoints)
* ``consolidate`` - stream sharded checkpoints into safetensors and verify them
"""

__version__ = "0.1.0"
