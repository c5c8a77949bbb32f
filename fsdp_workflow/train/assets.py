"""``RUN_DIR/hf_assets``: what the consolidator needs besides the weights, written once by rank 0.

``config.json`` (with ``architectures`` set), ``generation_config.json``, the
tokenizer files and, for a pretrained base, its licence files and README.md, so the consolidated model loads with ``from_pretrained`` and
``AutoTokenizer.from_pretrained``. Written into a temporary directory and
renamed, so the consolidator never sees half of it.

The tokenizer is saved with the chat template the data was rendered with (the
prepared cache's ``meta.json``), so what trained is what ``hf_model/`` ships: the
directory's own, the one ``data.chat_template`` names, or a template given to a
tokenizer without one (``data.fallback_chat_template``).
"""

from __future__ import annotations

import json
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
    template = trained_template(run)
    own = getattr(tokenizer, "chat_template", None)
    if template is not None:
        tokenizer.chat_template = template  # what trained ships, not the tokenizer's own
    try:
        tokenizer.save_pretrained(tmp)
    finally:
        tokenizer.chat_template = own
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


def trained_template(run: RunDir) -> Optional[str]:
    """The chat template the run's data was rendered with (its cache's ``meta.json``); None: none was.

    None too for synthetic data, plain text, or a cache that cannot be read here (the
    trainer has opened it already, so that does not happen in a run).
    """
    from fsdp_workflow.data.cache import META_FILE

    try:
        pointer = json.loads(run.data_pointer.read_text())
        meta = json.loads((Path(pointer["cache"]) / META_FILE).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    template = meta.get("chat_template") if isinstance(meta, dict) else None
    return template if isinstance(template, str) and template else None
