"""``RUN_DIR/hf_assets``: what the consolidator needs besides the weights, written once by rank 0.

``config.json`` (with ``architectures`` set), ``generation_config.json``, the
tokenizer files and, for a pretrained base, its licence files and README.md, so the consolidated model loads with ``from_pretrained`` and
``AutoTokenizer.from_pretrained``. Written into a temporary directory and
renamed, so the consolidator never sees half of it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

from fsdp_workflow.core import rundir
from fsdp_workflow.core.licences import licence_files
from fsdp_workflow.core.modeldir import CARD_FILE
from fsdp_workflow.core.rundir import RunDir

HF_CONFIG_FILE = "config.json"  # transformers' name; its presence means the assets are complete


def save_hf_assets(run: RunDir, config: Any, generation_config: Optional[Any], tokenizer: Any,
                   base_dir: Optional[str] = None) -> Path:
    """Write the model's config, generation config and tokenizer to ``RUN_DIR/hf_assets`` once.

    Call on rank 0 only.

    Args:
        run: the run directory.
        config: the model's ``PretrainedConfig`` (from the unwrapped build).
        generation_config: the model's ``GenerationConfig``; None derives one from ``config``.
        tokenizer: the tokenizer training used.
        base_dir: the pretrained model's directory (``model.name_or_path`` with ``init=pretrained``):
            its licence files and README.md (whose front matter declares the licence) are kept
            too, since the base model's terms must travel with derivatives and the directory may
            not exist where the consolidation job runs.

    Returns:
        The ``hf_assets`` directory.
    """
    from transformers import GenerationConfig

    dest = run.hf_assets
    if (dest / HF_CONFIG_FILE).is_file():
        return dest
    tmp = dest.with_name(dest.name + rundir.TMP_SUFFIX)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    use_cache = getattr(config, "use_cache", None)
    config.use_cache = True  # the inference default, for the consolidated model
    try:
        config.save_pretrained(tmp)
    finally:
        config.use_cache = use_cache
    (generation_config or GenerationConfig.from_model_config(config)).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    base = Path(base_dir) if base_dir else None
    if base is not None and base.is_dir():
        for src in [*licence_files(base), base / CARD_FILE]:
            if src.is_file():
                shutil.copy2(src, tmp / src.name)
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    rundir.fsync_dir(dest.parent)
    return dest
