"""``README.md``: a Hugging Face model card for the consolidated model.

The card follows the Hub's conventions (https://huggingface.co/docs/hub/model-cards): YAML
front matter (``base_model``, ``library_name``, ``pipeline_tag``, ``license``, ``tags``),
then Markdown. Its facts come from the run directory when the checkpoint sits in one
(``config.yaml``, ``metrics.jsonl``, ``evals.jsonl``, ``provenance.json``, read as plain
YAML/JSON), from the reference ``config.json``, from the base model's own ``README.md``
front matter and from the licence files copied beside the weights. A fact that cannot be
read is left out or says "unknown"; nothing is estimated, and a card that cannot be
written never fails a consolidation (:func:`write_model_card` returns a note instead).
``loss_curve.png`` (:func:`write_loss_curve`), drawn beside it when the run logged a loss, is
linked from the Training section.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_workflow.core.curves import read_series
from fsdp_workflow.core.pngplot import loss_png
from fsdp_workflow.core.rundir import RunDir

from .hf_assets import CARD_FILE, licence_files, licence_metadata
from .layout import step_of
from .nonfinite import describe as describe_nonfinite

TAGS = ["fsdp_workflow"]
CURVE_FILE = "loss_curve.png"  # beside README.md, drawn from metrics.jsonl
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # any of them: AutoTokenizer loads
# huggingface_hub's cache layout: .../models--ORG--NAME/snapshots/<sha>/ (datasets--ORG--NAME for data)
_HUB_CACHE_RE = re.compile(r"(models|datasets)--([\w.-]+?)--([\w.-]+)")
_REPO_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


@dataclass
class RunFacts:
    """What a project run directory says about the training behind the consolidated step(s)."""

    run_dir: Path
    config: dict[str, Any]  # config.yaml as plain YAML ({} when unreadable)
    steps: list[int]  # the consolidated steps (several when averaging)
    final_loss: float | None = None  # training loss logged at the last consolidated step
    trained_tokens: int | None = None  # loss-bearing tokens of steps 1..N (None unless every step is logged)
    steps_logged: int = 0  # how many of steps 1..N metrics.jsonl records
    eval_loss: tuple[int, float] | None = None  # (step, held-out loss) logged during training, at or before N
    held_out: dict[str, Any] | None = None  # evals.jsonl's ``ok`` line for step N
    provenance: dict[str, Any] = field(default_factory=dict)


def find_run_dir(checkpoint_dirs: Sequence[Path]) -> Path | None:
    """The project run directory the (last) checkpoint belongs to, if it sits in one.

    A run directory is a directory with ``config.yaml`` whose ``checkpoints/`` (or
    ``evals/``, for an evaluation's snapshot) holds the checkpoint.

    Args:
        checkpoint_dirs: The consolidated checkpoint directories (``Source.dirs``).

    Returns:
        The run directory, or None for checkpoints of other tools or moved out of a run.
    """
    if not checkpoint_dirs:
        return None
    ckpt = Path(checkpoint_dirs[-1]).absolute()
    for parent in list(ckpt.parents)[:4]:
        run = RunDir(parent)
        if run.config.is_file() and any(_inside(ckpt, d) for d in (run.checkpoints, run.evals)):
            return run.root
    return None


def base_model_dirs(reference: Path | None, run_dir: Path | None) -> list[Path]:
    """Where the base model's own files (licences, model card) may be, in order of preference.

    Args:
        reference: The reference directory the config came from (``hf_assets/``, ``--reference``).
        run_dir: The project run directory, whose ``model.name_or_path`` is the base model's
            local directory when ``model.init`` is ``pretrained``.

    Returns:
        Existing directories: the reference, then the run's base model directory.
    """
    dirs = [reference] if reference is not None and reference.is_dir() else []
    if run_dir is not None:
        model = _section(_read_yaml(RunDir(run_dir).config), "model")
        path = model.get("name_or_path")
        if model.get("init", "pretrained") == "pretrained" and isinstance(path, str) and path:
            base = Path(path).expanduser()  # a relative path means what it meant to the trainer: from the cwd
            if base.is_dir() and base not in dirs:
                dirs.append(base)
    return dirs


def read_run_facts(run_dir: Path, steps: Sequence[int]) -> RunFacts:
    """Read config.yaml, metrics.jsonl, evals.jsonl and provenance.json of a run for steps up to ``max(steps)``.

    metrics.jsonl holds one line per optimizer step (a step redone after a resume appears
    twice: the last line counts); ``trained_tokens`` there is per step, so the total is a sum,
    given only when every step from 1 to N has a line.

    Args:
        run_dir: The project run directory.
        steps: The consolidated steps (empty when unknown).

    Returns:
        The facts found; unreadable files leave their fields empty.
    """
    run = RunDir.recorded(run_dir)
    facts = RunFacts(run.root, _read_yaml(run.config), sorted(steps), provenance=_read_json(run.provenance))
    if not steps:
        return facts
    last = max(steps)
    records = {s: r for s, r in _last_per_step(_read_jsonl(run.metrics)).items() if s <= last}
    facts.steps_logged = len(records)
    final = records.get(last, {})
    facts.final_loss = _number(final.get("loss"))
    tokens = [records[s].get("trained_tokens") if s in records else None for s in range(1, last + 1)]
    if all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        facts.trained_tokens = sum(t for t in tokens if isinstance(t, int))
    evals = [(s, _number(r.get("eval_loss"))) for s, r in records.items()]
    known = [(s, v) for s, v in evals if v is not None]
    facts.eval_loss = max(known) if known else None
    held = _last_per_step(r for r in _read_jsonl(run.evals_file) if r.get("status") == "ok").get(last)
    facts.held_out = held
    return facts


def write_model_card(out_dir: Path, checkpoint_dirs: Sequence[Path], reference: Path | None,
                     report: Mapping[str, Any], *, final_dir: Path | None = None) -> str | None:
    """Write ``out_dir/README.md``, a model card with what is known about the model.

    Call it after the licence files were copied (:func:`.hf_assets.copy_licenses`), so the
    card's ``license`` can be read from them (:func:`.hf_assets.licence_metadata`). An existing ``README.md`` is replaced.

    Args:
        out_dir: The model directory (the staging directory during a consolidation).
        checkpoint_dirs: The consolidated checkpoint directories (``Source.dirs``).
        reference: The reference directory (``Source.reference.path``), or None.
        report: verification.json's content (``dtype``, ``layout``, ``ok``, ``tensors``...).
        final_dir: Where the model will live (``OUT``), for its name and the loading example;
            default ``out_dir``.

    Returns:
        None when the card was written; else a note saying why not (the consolidation goes on).
    """
    curve_note = write_loss_curve(out_dir, checkpoint_dirs)
    try:
        text = model_card(out_dir, checkpoint_dirs, reference, report, final_dir=final_dir)
        (out_dir / CARD_FILE).write_text(text, encoding="utf-8")
    except Exception as exc:  # noqa: BLE001 - a card is a courtesy; it must never fail a verified model
        return f"model card not written: {type(exc).__name__}: {exc}"
    return curve_note


def write_loss_curve(out_dir: Path, checkpoint_dirs: Sequence[Path]) -> str | None:
    """Draw ``out_dir/loss_curve.png`` (training and eval loss up to the consolidated step) for the card.

    Only for a checkpoint of a project run whose metrics.jsonl has a finite loss. Drawn with
    the standard library (:mod:`fsdp_workflow.core.pngplot`, milliseconds): matplotlib would
    cost the consolidator about a second and 50 MB.

    Returns:
        None, or a note when drawing failed (the card is still written, without the image).
    """
    run_dir = find_run_dir(checkpoint_dirs)
    steps = [s for s in (step_of(Path(d).name) for d in checkpoint_dirs) if s is not None]
    if run_dir is None or not steps:
        return None
    metrics = RunDir.recorded(run_dir).metrics
    try:
        series = read_series(metrics).up_to(max(steps))
        if any(math.isfinite(v) for v in series.loss):
            loss_png(series, out_dir / CURVE_FILE)
    except Exception as exc:  # noqa: BLE001 - an image is a courtesy too
        return f"{CURVE_FILE} not drawn: {type(exc).__name__}: {exc}"
    return None


def model_card(out_dir: Path, checkpoint_dirs: Sequence[Path], reference: Path | None,
               report: Mapping[str, Any], *, final_dir: Path | None = None) -> str:
    """The text of the model card (see :func:`write_model_card`)."""
    final = Path(final_dir) if final_dir is not None else Path(out_dir)
    steps = sorted(s for s in (step_of(Path(d).name) for d in checkpoint_dirs) if s is not None)
    run_dir = find_run_dir(checkpoint_dirs)
    facts = read_run_facts(run_dir, steps) if run_dir is not None else None
    cfg = facts.config if facts else {}
    ref_config = _read_json(reference / "config.json") if reference is not None else {}
    out_config = _read_json(out_dir / "config.json")
    base_dirs = base_model_dirs(reference, run_dir)
    base = _base_model(cfg, ref_config)

    meta: dict[str, Any] = {}
    if base.repo_id:
        meta["base_model"] = base.repo_id
    if out_config:
        meta["library_name"] = "transformers"
    archs = out_config.get("architectures")
    if isinstance(archs, list) and any(str(a).endswith("ForCausalLM") for a in archs):
        meta["pipeline_tag"] = "text-generation"
    meta.update(licence_metadata(out_dir, base_dirs))
    dataset = _hub_id(_section(cfg, "data").get("path"), "datasets")
    if dataset:
        meta["datasets"] = [dataset]
    meta["tags"] = list(TAGS)

    name = cfg.get("name") if isinstance(cfg.get("name"), str) and cfg.get("name") else final.name
    lines = [f"# {name}", ""]
    lines += _nonfinite_warning(report)
    lines += _summary(base, facts, cfg)
    lines += ["", "## Training", ""] + _table(_training_rows(base, facts, cfg, checkpoint_dirs))
    if (out_dir / CURVE_FILE).is_file():
        lines += ["", f"![Training loss by step (eval loss as dots)]({CURVE_FILE})"]
    lines += ["", "## Weights", ""] + _table(_weight_rows(report, checkpoint_dirs, steps, out_config, out_dir))
    lines += ["", "## Licence", ""] + _licence_text(meta, out_dir)
    if out_config:
        lines += ["", "## Use", ""] + _usage(final, out_dir)
    return _front_matter_text(meta) + "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the parts of the card
@dataclass(frozen=True)
class _Base:
    repo_id: str | None  # a Hub id, for the front matter
    path: str | None  # as configured (usually a local directory)
    init: str | None  # "pretrained" / "random" (project runs only)


def _base_model(cfg: Mapping[str, Any], ref_config: Mapping[str, Any]) -> _Base:
    model = _section(cfg, "model")
    init = model.get("init") if isinstance(model.get("init"), str) else None
    if init == "random":
        return _Base(None, None, init)
    path = model.get("name_or_path")
    if not (isinstance(path, str) and path):
        path = ref_config.get("_name_or_path")  # written by transformers 4 for configs it loaded
    path = path if isinstance(path, str) and path else None
    return _Base(_hub_id(path, "models"), path, init)


def _summary(base: _Base, facts: RunFacts | None, cfg: Mapping[str, Any]) -> list[str]:
    if base.init == "random":
        origin = "trained from random initialisation (`model.init=random`)"
    elif base.path:
        origin = f"fine-tuned from {_base_link(base)}"
    else:
        origin = "from a checkpoint whose base model is unknown"
    how = "full fine-tuning" if base.init != "random" else "training"
    strategy = _section(cfg, "strategy").get("name")
    with_what = f" ({how} with {strategy})" if facts and isinstance(strategy, str) else ""
    return [f"A causal language model {origin}{with_what}, consolidated from a sharded checkpoint by fsdp_workflow."]


def _base_link(base: _Base) -> str:
    if base.repo_id:
        return f"[{base.repo_id}](https://huggingface.co/{base.repo_id})"
    return f"`{_code(base.path or 'unknown')}`"


def _training_rows(base: _Base, facts: RunFacts | None, cfg: Mapping[str, Any],
                   checkpoint_dirs: Sequence[Path]) -> list[tuple[str, str]]:
    rows = [("base model", "none (random initialisation)" if base.init == "random" else
             (_base_link(base) if base.path else "unknown"))]
    if facts is None:
        rows.append(("source checkpoint", ", ".join(f"`{_code(str(d))}`" for d in checkpoint_dirs) or "unknown"))
        rows.append(("training facts", "unknown (the checkpoint is not in an fsdp_workflow run directory)"))
        return rows
    rows.append(("data", _data_text(_section(cfg, "data"))))
    last = max(facts.steps) if facts.steps else None
    max_steps = _section(cfg, "train").get("max_steps")
    planned = f" of `train.max_steps={max_steps}`" if isinstance(max_steps, int) else ""
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
    rows.append(("config", f"`{_code(str(RunDir(facts.run_dir).config))}`"))
    revision = facts.provenance.get("git_revision")
    if isinstance(revision, str) and revision:
        rows.append(("fsdp_workflow revision", f"`{_code(revision)}`"))
    return rows


def _data_text(data: Mapping[str, Any]) -> str:
    source = data.get("source")
    if source == "synthetic":
        return "synthetic random token ids (`data.source=synthetic`)"
    if not isinstance(source, str):
        return "unknown"
    path = f"`{_code(data['path'])}`" if isinstance(data.get("path"), str) else "path unknown"
    kind = ", ".join(str(v) for v in (source, data.get("format")) if isinstance(v, str))
    parts = [f"{path} ({kind})"]
    if data.get("format") not in (None, "text") and isinstance(data.get("train_on"), str):
        parts.append(f"loss on `{data['train_on']}` tokens")
    if isinstance(data.get("eval_path"), str) and data["eval_path"]:
        parts.append(f"held out: `{_code(data['eval_path'])}`")
    elif isinstance(data.get("eval_fraction"), (int, float)) and data["eval_fraction"]:
        parts.append(f"{data['eval_fraction']:g} held out")
    return "; ".join(parts)


def _procedure_rows(cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    strategy, cluster = _section(cfg, "strategy"), _section(cfg, "cluster")
    optimizer, train = _section(cfg, "optimizer"), _section(cfg, "train")
    rows = []
    if isinstance(strategy.get("name"), str):
        where = (f", {cluster['nodes']} node(s) x {cluster['processes_per_node']} processes"
                 if isinstance(cluster.get("nodes"), int) and isinstance(cluster.get("processes_per_node"), int) else "")
        rows.append(("strategy", f"{strategy['name']}{where}"))
    if isinstance(optimizer.get("name"), str):
        opt = [str(optimizer["name"])]
        if _number(optimizer.get("lr")) is not None:
            opt.append(f"lr {optimizer['lr']:g}")
        if isinstance(optimizer.get("scheduler"), str):
            opt.append(f"{optimizer['scheduler']} schedule")
        if isinstance(optimizer.get("warmup_steps"), int):
            opt.append(f"{optimizer['warmup_steps']} warm-up steps")
        rows.append(("optimizer", ", ".join(opt)))
    if isinstance(train.get("global_batch_size"), int) and isinstance(train.get("seq_len"), int):
        rows.append(("batch", f"{train['global_batch_size']} sequences of up to {train['seq_len']} tokens per step"))
    if isinstance(train.get("mixed_precision"), str):
        rows.append(("precision", train["mixed_precision"]))
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


def _inside(path: Path, directory: Path) -> bool:
    try:
        path.relative_to(directory)
    except ValueError:
        return False
    return True


def _section(cfg: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = cfg.get(key)
    return value if isinstance(value, dict) else {}


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    data = _yaml_load(text)
    return data if isinstance(data, dict) else {}


def _yaml_load(text: str) -> Any:
    """Plain YAML (``safe_load``); None when it does not parse."""
    import yaml  # type: ignore[import-untyped]

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON object lines of ``path``; a torn or foreign line (a crash mid-write) is skipped."""
    out = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    out.append(record)
    except OSError:
        return []
    return out


def _last_per_step(records: Any) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for r in records:
        step = r.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            out[step] = r
    return out


__all__ = ["CARD_FILE", "CURVE_FILE", "RunFacts", "base_model_dirs", "find_run_dir", "model_card", "read_run_facts",
           "write_loss_curve", "write_model_card"]
