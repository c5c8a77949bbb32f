"""The status report as terminal text (``format_text``); the data comes from :mod:`.collect`."""

from __future__ import annotations

from fsdp_workflow.config.record import open_run
from fsdp_workflow.report.curves import series_of
from fsdp_workflow.report.status.collect import RunStatus
from fsdp_workflow.report.status.text_curves import curve_block
from fsdp_workflow.report.status.eta import progress_lines


def format_text(rs: RunStatus, width: int = 80) -> str:
    """The report; the progress lines and the curves (``width`` columns) come after the fixed lines."""
    lines = [f"run: {rs.run_dir}", f"state: {rs.state}" + (f" ({rs.state_detail})" if rs.state_detail else "")]
    lines += [f"broken record: {p}" for p in rs.problems]
    if rs.config_changed:
        lines.append(f"warning: {rs.config_changed}")
    lines += [f"left behind: {d} (staging nothing will finish; safe to remove)" for d in rs.debris]
    for j in rs.jobs:
        extra = [f"slurm {j.slurm_state}" if j.slurm_state else "", f"reason {j.reason}" if j.reason else "",
                 f"exit {j.exit_code}" if j.exit_code and j.status in ("done", "failed", "cancelled") else "",
                 f"restarts {j.restarts}" if j.restarts else ""]
        if j.restarts and j.max_requeues is not None:
            extra[-1] += f" (cluster.max_requeues={j.max_requeues})"
        detail = ", ".join(x for x in extra if x) or j.source
        lines.append(f"  {j.role:<12} {j.job_id:>8}  {j.status:<10} ({detail})")
        if j.log:
            lines.append(f"  {'':<12} {'':>8}  log: {j.log}")
        if j.message:
            lines.append(f"  {'':<12} {'':>8}  {j.message}")
        pad = f"  {'':<12} {'':>8}  "
        if j.reason_words:
            lines.append(f"{pad}{j.reason_words}")
        if j.why:
            w = j.why
            lines.append(f"{pad}why: " + (f"exit {w['exit_code']}: " if w.get("exit_code") is not None else "") + w["reason"])
            if w.get("line"):
                lines.append(f"{pad}log says: {w['line']}")
            if w.get("fix"):
                lines.append(f"{pad}fix: {w['fix']}")
        if j.role == "train" and j.status == "cancelled":
            step = rs.latest_checkpoint_step
            lines.append(f"{pad}cancelled; " + (f"checkpoint it reached: step {step}" if step is not None
                                                else "no checkpoint reached: a resubmission starts over"))
    if rs.train_exit is not None:
        te = rs.train_exit
        lines.append(f"trainer exit: {te.get('exit_code')} ({te['meaning']})"
                     + (f": {te['reason']}" if te.get("reason") else "")
                     + (f" at step {te['step']}" if te.get("step") is not None else ""))
        if te.get("checkpoint"):
            lines.append(f"  checkpoint it reached: {te['checkpoint']}")
    if rs.code is not None:
        c = rs.code
        dirty = {True: ", uncommitted changes", False: "", None: ""}.get(c.get("git_dirty"), "")
        lines.append((f"code: snapshot {c['snapshot_sha256'][:12]} ({c['snapshot_path']})" if c.get("snapshot_sha256")
                      else "code: no snapshot (cluster.code_snapshot=false): jobs import the installed package")
                     + f"; git {c.get('git_revision')}{dirty}")
    step = rs.latest_checkpoint_step
    lines.append(f"latest checkpoint: {'step ' + str(step) if step is not None else 'none yet'}"
                 + ("  (.requeue marker present: stopped on a signal)" if rs.requeue_marker else "")
                 + (": resume with the command below" if rs.requeue_marker and rs.resume_command else ""))
    for bad in rs.skipped_checkpoints:
        lines.append(f"checkpoint step {bad['step']}: resume will skip it: {bad['problem']}")
    for path in rs.quarantined:
        lines.append(f"set aside as corrupt: {path}")
    if rs.data is not None:
        train = rs.data.get("train") or {}
        counts = (f"{train.get('samples')} samples, {train.get('tokens')} tokens, {train.get('trained_tokens')} trained"
                  if train else rs.data.get("note", ""))
        lines.append(f"data: {counts}" + (f" ({rs.data['cache']})" if rs.data.get("cache") else ""))
        lines += [f"data source: {line}" for line in rs.data.get("sources") or []]
    lines.append(f"consolidated model: {rs.consolidated} ({rs.consolidated_dir})")
    if rs.consolidated_ema_dir:
        lines.append(f"consolidated EMA:   {rs.consolidated_ema} ({rs.consolidated_ema_dir})")
    if rs.last_eval:
        lines.append("last evaluation: " + ", ".join(f"{k}={v}" for k, v in rs.last_eval.items()))
    lines += [f"note: {n}" for n in rs.notes]
    if rs.resume_command:
        lines.append(f"resume with: {rs.resume_command}")
    if rs.consolidate_command:
        lines.append(f"consolidate the newest checkpoint with: {rs.consolidate_command}")
    lines += progress_lines(rs.progress)
    if rs.progress is not None and rs.progress.step is not None:
        lines += [""] + curve_block(series_of(open_run(rs.run_dir).metrics), width)
    return "\n".join(lines)
