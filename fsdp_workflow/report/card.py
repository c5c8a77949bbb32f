"""``README.md``: a Hugging Face model card for a consolidated model, written by the report stage.

The consolidator writes weights and verification only; the consolidation job then runs

    python -m fsdp_workflow.report.card MODEL_DIR [MODEL_DIR...] --run-dir RUN_DIR

with both paths rendered by the plan (never guessed from where the checkpoint sits).
Without ``--run-dir`` (a model consolidated from another tool's checkpoint) the card says
the training facts are unknown.

The card follows the Hub's conventions (https://huggingface.co/docs/hub/model-cards): YAML
front matter (``base_model``, ``library_name``, ``pipeline_tag``, ``license``, ``datasets``,
``tags``), then Markdown. Its facts come from the run record
(:class:`~fsdp_workflow.config.record.RunRecord`: typed config, provenance, metrics and
evals series, the data cache's sources), from the model's ``verification.json`` and
``config.json``, the base model's own ``README.md`` front matter and the licence files
beside the weights. A fact that cannot be read is left out or says "unknown"; nothing is
estimated. ``loss_curve.png``, drawn by the same function as ``status --plot``
(:func:`fsdp_workflow.report.plot.write_png`, with labelled axes), is linked from the
Training section. A card that cannot be written never fails the job: the command prints
a note and exits 0 (exit 2 only for arguments that name no model or no run).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_workflow.config.record import RunRecord, StepRecords, open_run, read_json_object
from fsdp_workflow.config.schema import DataSource, ModelInit, WorkflowConfig
from fsdp_workflow.consolidate.hf_assets import copy_licenses, licence_files, licence_metadata
from fsdp_workflow.consolidate.layout import step_of
from fsdp_workflow.consolidate.nonfinite import describe as describe_nonfinite
from fsdp_workflow.core.exit_codes import EXIT_USAGE
from fsdp_workflow.core.modeldir import CARD_FILE, CURVE_FILE, VERIFICATION_FILE
from fsdp_workflow.core.rundir import CONFIG_FILE, atomic_write_text
from fsdp_workflow.report.curves import series_of
from fsdp_workflow.report.plot import write_png
from fsdp_workflow.report import run_sources
from fsdp_workflow.report.run_sources import source_lines

TAGS = ["fsdp_workflow"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # any of them: AutoTokenizer loads
# huggingface_hub's cache layout: .../models--ORG--NAME/snapshots/<sha>/ (datasets--ORG--NAME for data)
_HUB_CACHE_RE = re.compile(r"(models|datasets)--([\w.-]+?)--([\w.-]+)")
_REPO_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


@dataclass
class RunFacts:
    """What a run's record says about the training behind the consolidated step(s)."""

    run_dir: Path
    config: WorkflowConfig | None  # None when config.yaml does not load (the card then says less)
    steps: list[int]  # the consolidated steps (several when averaging)
    final_loss: float | None = None  # training loss logged at the last consolidated step
    trained_tokens: int | None = None  # loss-bearing tokens of steps 1..N (None unless every step is logged)
    steps_logged: int = 0  # how many of steps 1..N metrics.jsonl records
    eval_loss: tuple[int, float] | None = None  # (step, held-out loss) logged during training, at or before N
    held_out: dict[str, Any] | None = None  # evals.jsonl's ``ok`` record for step N
    provenance: dict[str, Any] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)  # one line per data source (report.sources)
    # the libraries that trained (train_exit.json), else those the run was planned with (provenance.json)
    versions: dict[str, Any] = field(default_factory=dict)
    versions_from: str = ""
    chat_template: str | None = None  # the template the data was rendered with, named (None: none was)


def consolidated_steps(source_dirs: Sequence[Path]) -> list[int]:
    """The steps of the checkpoint directories a model came from (``step-N``, ``checkpoint-N``...)."""
    return sorted(s for s in (step_of(Path(d).name) for d in source_dirs) if s is not None)


def base_model_dirs(reference: Path | None, cfg: WorkflowConfig | None) -> list[Path]:
    """Where the base model's own files (licences, model card) may be, in order of preference.

    Args:
        reference: The run's ``hf_assets/`` (the trainer keeps the base model's licences there).
        cfg: The run's typed config, whose ``model.name_or_path`` is the base model's local
            directory when ``model.init`` is ``pretrained``.

    Returns:
        Existing directories: the reference, then the run's base model directory.
    """
    dirs = [reference] if reference is not None and reference.is_dir() else []
    if cfg is not None and cfg.model.init == ModelInit.pretrained and cfg.model.name_or_path:
        base = Path(cfg.model.name_or_path).expanduser()  # relative: what it meant to the trainer, from the cwd
        if base.is_dir() and base not in dirs:
            dirs.append(base)
    return dirs


def read_run_facts(record: RunRecord, steps: Sequence[int]) -> RunFacts:
    """The run's facts for steps up to ``max(steps)``, from its record.

    The metrics series holds one record per optimizer step (a step redone after a resume
    counts once: the record reader keeps the later line); ``trained_tokens`` there is per
    step, so the total is a sum, given only when every step from 1 to N has a record.

    Args:
        record: The run's record.
        steps: The consolidated steps (empty when unknown).

    Returns:
        The facts found; what cannot be read stays empty.
    """
    meta = run_sources.cache_meta(record) or {}  # through the module: tests stand in for the cache
    facts = RunFacts(record.root, record.config, sorted(steps), provenance=record.provenance or {},
                     sources=source_lines(record, meta), chat_template=_template_name(meta))
    for origin, rec in (("the trainer's, train_exit.json", record.train_exit),
                        ("planned with, provenance.json", facts.provenance)):
        versions = (rec or {}).get("versions")
        if isinstance(versions, dict) and versions:
            facts.versions, facts.versions_from = versions, origin
            break
    if not steps:
        return facts
    last = max(steps)
    metrics: StepRecords = record.metrics.up_to(last)
    facts.steps_logged = len(metrics)
    facts.final_loss = _number((metrics.get(last) or {}).get("loss"))
    tokens = [(metrics.get(s) or {}).get("trained_tokens") for s in range(1, last + 1)]
    if all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        facts.trained_tokens = sum(t for t in tokens if isinstance(t, int))
    known = [(s, v) for s, v in ((s, _number(r.get("eval_loss"))) for s, r in metrics) if v is not None]
    facts.eval_loss = max(known) if known else None
    held = record.evals.get(last)
    facts.held_out = held if held is not None and held.get("status") == "ok" else None
    return facts


def write_card(model_dir: Path, record: RunRecord | None) -> str | None:
    """Write ``model_dir/README.md`` (and ``loss_curve.png`` for a run that logged a loss).

    The base model's licence files are copied beside the weights first when the model lacks
    them (from ``hf_assets/`` or ``model.name_or_path``), so the card's ``license`` can be
    read from them. An existing ``README.md`` is replaced, atomically.

    Args:
        model_dir: A consolidated model directory (its ``verification.json`` names the checkpoints).
        record: The run the model was trained in, or None for a model of another tool.

    Returns:
        None when the card was written; else a note saying why not (or why the image is missing).
    """
    try:
        model_dir = Path(model_dir)
        report = read_json_object(model_dir / VERIFICATION_FILE, []) or {}
        sources = [Path(s) for s in report.get("sources") or [] if isinstance(s, str)]
        steps = consolidated_steps(sources)
        facts = read_run_facts(record, steps) if record is not None else None
        reference = record.layout.hf_assets if record is not None else None
        copy_licenses(base_model_dirs(reference, facts.config if facts else None), model_dir)
        curve_note = _write_curve(model_dir, record, steps)
        text = model_card(model_dir, sources, reference, report, facts)
        atomic_write_text(model_dir / CARD_FILE, text)
    except Exception as exc:  # noqa: BLE001 - a card is a courtesy; it must never fail a verified model
        return f"model card not written: {type(exc).__name__}: {exc}"
    return curve_note


def _write_curve(model_dir: Path, record: RunRecord | None, steps: list[int]) -> str | None:
    """Draw ``loss_curve.png`` (training and eval loss up to the consolidated step); a note when drawing failed."""
    (model_dir / CURVE_FILE).unlink(missing_ok=True)  # never a curve of another model
    if record is None or not steps:
        return None
    series = series_of(record.metrics).up_to(max(steps))
    if not any(math.isfinite(v) for v in series.loss):
        return None
    try:
        write_png(series, model_dir / CURVE_FILE, title="training loss", loss_only=True)
    except Exception as exc:  # noqa: BLE001 - an image is a courtesy too
        return f"{CURVE_FILE} not drawn: {type(exc).__name__}: {exc}"
    return None


def model_card(model_dir: Path, source_dirs: Sequence[Path], reference: Path | None, report: Mapping[str, Any],
               facts: RunFacts | None) -> str:
    """The text of the model card (see :func:`write_card`)."""
    steps = consolidated_steps(source_dirs)
    cfg = facts.config if facts else None
    ref_config = _read_json(reference / "config.json") if reference is not None else {}
    out_config = _read_json(model_dir / "config.json")
    base_dirs = base_model_dirs(reference, cfg)
    base = _base_model(cfg, ref_config or out_config)  # the written config.json keeps _name_or_path too

    meta: dict[str, Any] = {}
    if base.repo_id:
        meta["base_model"] = base.repo_id
    if out_config:
        meta["library_name"] = "transformers"
    archs = out_config.get("architectures")
    if isinstance(archs, list) and any(str(a).endswith("ForCausalLM") for a in archs):
        meta["pipeline_tag"] = "text-generation"
    meta.update(licence_metadata(model_dir, base_dirs))
    datasets = [d for d in (_hub_id(p, "datasets") for p in _data_paths(cfg)) if d]
    if datasets:
        meta["datasets"] = datasets
    meta["tags"] = list(TAGS)

    name = cfg.name if cfg is not None and cfg.name else model_dir.name
    lines = [f"# {name}", ""]
    lines += _nonfinite_warning(report)
    lines += _summary(base, facts, cfg)
    lines += ["", "## Training", ""] + _table(_training_rows(base, facts, cfg, source_dirs))
    if (model_dir / CURVE_FILE).is_file():
        lines += ["", f"![Training loss by optimizer step (eval loss as dots)]({CURVE_FILE})"]
    lines += ["", "## Weights", ""] + _table(_weight_rows(report, source_dirs, steps, out_config, model_dir))
    lines += ["", "## Licence", ""] + _licence_text(meta, model_dir)
    if out_config:
        lines += ["", "## Use", ""] + _usage(model_dir, model_dir)
    return _front_matter_text(meta) + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m fsdp_workflow.report.card MODEL_DIR... [--run-dir RUN_DIR]``: write each model's card.

    Returns:
        0 (a card that could not be written is a note on stderr), or 2 when a MODEL_DIR is not a
        directory or RUN_DIR holds no run.
    """
    p = argparse.ArgumentParser(prog="python -m fsdp_workflow.report.card", description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="+", type=Path, metavar="MODEL_DIR", help="a consolidated model directory")
    p.add_argument("--run-dir", type=Path, help="the run directory the model was trained in (the plan passes it)")
    args = p.parse_args(argv)
    record = None
    if args.run_dir is not None:
        if not (args.run_dir / CONFIG_FILE).is_file():
            print(f"fsdp_workflow.report.card: --run-dir {args.run_dir}: not a run directory (no {CONFIG_FILE}); "
                  "pass the run_dir= the model was trained in, or leave --run-dir out for a model of another tool",
                  file=sys.stderr)
            return EXIT_USAGE
        record = open_run(args.run_dir)
    missing = [m for m in args.models if not m.is_dir()]
    if missing:
        print(f"fsdp_workflow.report.card: {', '.join(map(str, missing))}: no such model directory; "
              "consolidate first (python -m fsdp_workflow.consolidate CKPT OUT), then name OUT", file=sys.stderr)
        return EXIT_USAGE
    for model in args.models:
        note = write_card(model, record)
        if note:
            print(f"fsdp_workflow.report.card: note: {model}: {note}", file=sys.stderr)
        else:
            print(f"model card: {model / CARD_FILE}")
    return 0


# ---------------------------------------------------------------- the parts of the card
@dataclass(frozen=True)
class _Base:
    repo_id: str | None  # a Hub id, for the front matter
    path: str | None  # as configured (usually a local directory)
    init: str | None  # "pretrained" / "random" (project runs only)


def _base_model(cfg: WorkflowConfig | None, ref_config: Mapping[str, Any]) -> _Base:
    init = cfg.model.init.value if cfg is not None else None
    if init == ModelInit.random.value:
        return _Base(None, None, init)
    path = cfg.model.name_or_path if cfg is not None else None
    if not (isinstance(path, str) and path):
        path = ref_config.get("_name_or_path")  # written by transformers 4 for configs it loaded
    path = path if isinstance(path, str) and path else None
    return _Base(_hub_id(path, "models"), path, init)


def _summary(base: _Base, facts: RunFacts | None, cfg: WorkflowConfig | None) -> list[str]:
    if base.init == "random":
        origin = "trained from random initialisation (`model.init=random`)"
    elif base.path:
        origin = f"fine-tuned from {_base_link(base)}"
    else:
        origin = "from a checkpoint whose base model is unknown"
    how = "full fine-tuning" if base.init != "random" else "training"
    with_what = f" ({how} with {cfg.strategy.name.value})" if facts and cfg is not None else ""
    return [f"A causal language model {origin}{with_what}, consolidated from a sharded checkpoint by fsdp_workflow."]


def _base_link(base: _Base) -> str:
    if base.repo_id:
        return f"[{base.repo_id}](https://huggingface.co/{base.repo_id})"
    return f"`{_code(base.path or 'unknown')}`"


def _training_rows(base: _Base, facts: RunFacts | None, cfg: WorkflowConfig | None,
                   checkpoint_dirs: Sequence[Path]) -> list[tuple[str, str]]:
    rows = [("base model", "none (random initialisation)" if base.init == "random" else
             (_base_link(base) if base.path else "unknown"))]
    if facts is None:
        rows.append(("source checkpoint", ", ".join(f"`{_code(str(d))}`" for d in checkpoint_dirs) or "unknown"))
        rows.append(("training facts", "unknown (no fsdp_workflow run directory was named: --run-dir)"))
        return rows
    rows += _data_rows(cfg, facts.sources)
    if facts.chat_template:
        rows.append(("chat template", facts.chat_template))
    last = max(facts.steps) if facts.steps else None
    planned = f" of `train.max_steps={cfg.train.max_steps}`" if cfg is not None else ""
    rows.append(("steps trained", f"{last}{planned}" if last is not None else "unknown"))
    if facts.trained_tokens is not None:
        tokens = f"{facts.trained_tokens:,} (tokens the loss was computed on, summed over metrics.jsonl)"
    elif last is not None:
        tokens = f"unknown (metrics.jsonl records {facts.steps_logged} of steps 1-{last})"
    else:
        tokens = "unknown"
    rows.append(("tokens trained", tokens))
    rows.append(("final training loss", f"{facts.final_loss:.4f} (step {last})" if facts.final_loss is not None
                 else "unknown"))
    if facts.eval_loss is not None:
        rows.append(("held-out loss during training", f"{facts.eval_loss[1]:.4f} (step {facts.eval_loss[0]})"))
    held = facts.held_out or {}
    ppl, loss = _number(held.get("perplexity")), _number(held.get("loss"))
    if ppl is not None and loss is not None:
        count = held.get("num_tokens")
        over = f", {count:,} tokens" if isinstance(count, int) else ""
        rows.append(("held-out perplexity", f"{ppl:.3f} (loss {loss:.4f}{over}; evals.jsonl, step {last})"))
    rows += _procedure_rows(cfg)
    rows.append(("config", f"`{_code(str(facts.run_dir / CONFIG_FILE))}`"))
    revision = facts.provenance.get("git_revision")
    if isinstance(revision, str) and revision:
        rows.append(("fsdp_workflow revision", f"`{_code(revision)}`"))
    libraries = [f"{name} {version}" for name, version in facts.versions.items() if isinstance(version, str)]
    if libraries:
        rows.append(("libraries", f"{', '.join(libraries)} ({facts.versions_from})"))
    return rows


def _data_paths(cfg: WorkflowConfig | None) -> list[str]:
    """The configured data paths: each source of a mixture, else ``data.path``."""
    if cfg is None or cfg.data.source == DataSource.synthetic:
        return []
    return [s.path for s in cfg.data.sources] if cfg.data.sources else [cfg.data.path] if cfg.data.path else []


def _data_rows(cfg: WorkflowConfig | None, sources: list[str]) -> list[tuple[str, str]]:
    """The data rows: what was read and how, then one row per source with its counts and share."""
    if cfg is None:
        return [("data", "unknown")]
    d = cfg.data
    if d.source == DataSource.synthetic:
        return [("data", "synthetic random token ids (`data.source=synthetic`)")]
    what = f"mixture of {len(d.sources)} sources, mixed by `data.seed`" if d.sources else f"`{_code(d.path or '')}`"
    parts = [f"{what} ({d.source.value}, {d.format.value})"]
    if d.format.value != "text":
        parts.append(f"loss on `{d.train_on.value}` tokens")
    if d.eval_path:
        parts.append(f"held out: `{_code(d.eval_path)}`")
    elif d.eval_fraction:
        parts.append(f"{d.eval_fraction:g} held out")
    rows = [("data", "; ".join(parts))]
    rows += [("data source", line) for line in sources]
    return rows


def _template_name(meta: Mapping[str, Any]) -> str | None:
    """The card's name for the chat template that rendered the data, which the model ships (None: none did)."""
    text = meta.get("chat_template")
    if not isinstance(text, str) or not text:
        return None
    name, key = meta.get("chat_template_name"), meta.get("chat_template_key")
    shipped = "; this model's tokenizer ships it (`chat_template.jinja`)"
    if not isinstance(name, str) or not name:  # a cache prepared before the name was recorded
        return "a Jinja template (the cache's `meta.json` holds it)" + shipped
    if key == "data.fallback_chat_template":
        return f"`{_code(name)}` (`data.fallback_chat_template`: the tokenizer has none of its own)" + shipped
    if key == "data.chat_template":
        return f"`{_code(name)}` (`data.chat_template`)" + shipped
    return name.replace("the tokenizer's own", "the base model's own") + shipped


def _procedure_rows(cfg: WorkflowConfig | None) -> list[tuple[str, str]]:
    if cfg is None:
        return []
    c, o, t = cfg.cluster, cfg.optimizer, cfg.train
    rows = [("strategy", f"{cfg.strategy.name.value}, {c.nodes} node(s) x {c.processes_per_node} processes")]
    opt = [o.name.value, f"lr {o.lr:g}", f"{o.scheduler.value} schedule"]
    if o.warmup_steps:
        opt.append(f"{o.warmup_steps} warm-up steps")
    rows.append(("optimizer", ", ".join(opt)))
    if t.global_batch_size is not None:
        rows.append(("batch", f"{t.global_batch_size} sequences of up to {t.seq_len} tokens per step"))
    else:
        rows.append(("sequence length", f"{t.seq_len} tokens"))
    rows.append(("precision", t.mixed_precision.value))
    return rows


def _weight_rows(report: Mapping[str, Any], checkpoint_dirs: Sequence[Path], steps: list[int],
                 out_config: Mapping[str, Any], out_dir: Path) -> list[tuple[str, str]]:
    rows = []
    archs = out_config.get("architectures")
    if isinstance(archs, list) and archs:
        rows.append(("architecture", ", ".join(f"`{_code(str(a))}`" for a in archs)))
    if isinstance(report.get("dtype"), str):
        rows.append(("dtype", str(report["dtype"])))
    files = sorted(out_dir.glob("*.safetensors"))
    if files:
        count = _count_parameters(files)
        if count is not None:
            rows.append(("parameters", f"{count:,} (tensor elements written; a tied embedding counted once)"))
        rows.append(("files", f"{len(files)} safetensors file(s)"))
    if len(checkpoint_dirs) > 1:
        which = (f"steps {', '.join(str(s) for s in steps)}" if len(steps) == len(checkpoint_dirs)
                 else f"{len(checkpoint_dirs)} checkpoints")
        rows.append(("averaged", f"weights averaged over {which}"))
    elif steps:
        rows.append(("checkpoint", f"step {steps[0]}"))
    if isinstance(report.get("layout"), str):
        rows.append(("source layout", str(report["layout"])))
    if "ok" in report:
        checked = "checked" if report.get("tensors") else "recorded (checks off)"
        rows.append(("verification", f"{checked}, ok: {str(bool(report['ok'])).lower()} (verification.json)"))
    bad = (report.get("nonfinite") or {}).get("tensors") or {}
    if bad:
        rows.append(("non-finite values", f"NaN/inf in {len(bad)} tensor(s), written on purpose (--allow-nonfinite)"))
    return rows


def _nonfinite_warning(report: Mapping[str, Any]) -> list[str]:
    """A warning at the top of the card naming every tensor written with NaN or inf (``--allow-nonfinite``)."""
    bad = (report.get("nonfinite") or {}).get("tensors") or {}
    if not bad:
        return []
    lines = [f"> **Warning: this model holds non-finite weights.** It was consolidated with `--allow-nonfinite`, "
             f"and {len(bad)} tensor(s) hold NaN or inf values (verification.json, `nonfinite`):", ">"]
    lines += [f"> - {_cell(describe_nonfinite(n, c))}" for n, c in bad.items()]
    return lines + [""]


def _licence_text(meta: Mapping[str, Any], out_dir: Path) -> list[str]:
    copied = [p.name for p in licence_files(out_dir)]
    licence = meta.get("license")
    if licence and licence != "other":
        head = f"`{licence}`, the base model's licence."
    elif licence == "other":
        head = f"The base model's own licence{' (' + str(meta['license_name']) + ')' if meta.get('license_name') else ''}."
    else:
        head = "Unknown: no licence was found with the base model's files. Check the base model's terms before sharing."
    if copied:
        head += " Its terms travel with the weights: " + ", ".join(f"[{n}]({n})" for n in copied) + "."
    return [head]


def _usage(final: Path, out_dir: Path) -> list[str]:
    has_tokenizer = any((out_dir / n).is_file() for n in TOKENIZER_FILES)
    lines = ["```python", "from transformers import AutoModelForCausalLM" + (", AutoTokenizer" if has_tokenizer else ""),
             "", f"model = AutoModelForCausalLM.from_pretrained({json.dumps(str(final))})"]
    if has_tokenizer:
        lines.append(f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(str(final))})")
    return lines + ["```"]


def _count_parameters(files: Sequence[Path]) -> int | None:
    """Elements of every tensor in the safetensors files, from their headers (no data read)."""
    total = 0
    for path in files:
        try:
            with open(path, "rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return None
        for key, entry in header.items():
            if key != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("shape"), list):
                total += math.prod(int(d) for d in entry["shape"])
    return total


# ---------------------------------------------------------------- helpers
def _front_matter_text(meta: Mapping[str, Any]) -> str:
    import yaml  # type: ignore[import-untyped]  # imported here: the copy path never needs it

    return "---\n" + yaml.safe_dump(dict(meta), sort_keys=False, allow_unicode=True) + "---\n\n"


def _table(rows: list[tuple[str, str]]) -> list[str]:
    return ["| | |", "|---|---|"] + [f"| {_cell(k)} | {_cell(v)} |" for k, v in rows]


def _cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _code(text: str) -> str:
    return text.replace("`", "'")


def _hub_id(path: object, kind: str) -> str | None:
    """A Hub repository id for ``path``: a huggingface_hub cache path, or an id that is not a local path."""
    if not isinstance(path, str) or not path:
        return None
    for part in Path(path).parts:
        m = _HUB_CACHE_RE.fullmatch(part)
        if m and m.group(1) == kind:
            return f"{m.group(2)}/{m.group(3)}"
    if _REPO_ID_RE.fullmatch(path) and not Path(path).exists():
        return path
    return None


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


__all__ = ["RunFacts", "base_model_dirs", "consolidated_steps", "main", "model_card",
           "read_run_facts", "write_card"]


if __name__ == "__main__":
    raise SystemExit(main())
