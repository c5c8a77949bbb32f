"""Train one run on this rank.

Run on every rank, with ``RUN_DIR/launch.env`` exported::

    set -a; . RUN_DIR/launch.env; set +a
    torchrun --nproc_per_node 2 --standalone -m fsdp_workflow.train RUN_DIR

Exit codes: 0 done, 2 bad config, a resume the config cannot apply (another
optimizer or model shape than the checkpoint's; train_exit.json records it), or the
run directory in use by another process (message printed, nothing written), 65 the loss or gradient norm became NaN/inf
(nothing saved from that step), 74 disk full during a save, 75 preempted or
Ctrl-C after a checkpoint (requeue), 76 a collective timed out (a rank stopped
answering; the message names it), 1 unexpected error.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from fsdp_workflow.core.exit_codes import EXIT_PEER_TIMEOUT, EXIT_USAGE
from fsdp_workflow.core.logs import recorded_log_level, report_user_error, setup_logging

log = logging.getLogger("fsdp_workflow.train")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return EXIT_USAGE
    from fsdp_workflow.train.failures import usage_errors
    from fsdp_workflow.train.loop import main as train
    from fsdp_workflow.train.runlock import RunLocked

    setup_logging(recorded_log_level(args[0]))
    _log_placement()
    import fsdp_workflow

    # Which copy of the package runs: RUN_DIR/code (cluster.code_snapshot) or the installed one.
    log.info("code: %s", Path(fsdp_workflow.__file__).resolve().parent)
    try:
        code = train(args[0])
    except RunLocked as e:  # one line on every rank, nothing written into the run
        log.error("fsdp_workflow.train [rank %s]: %s", os.environ.get("RANK", "0"), e)
        return EXIT_USAGE
    except usage_errors() as e:  # rank 0 recorded it in train_exit.json (loop.refusals_recorded)
        rank = os.environ.get("RANK", "0")
        report_user_error(log, f"fsdp_workflow.train [rank {rank}]: error: {e}", e)
        return EXIT_USAGE
    if code == EXIT_PEER_TIMEOUT:
        # The process group's threads may still wait on the rank that stopped answering:
        # leave now rather than in interpreter shutdown (the reason is already recorded).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _log_placement() -> None:
    """One line per rank: its host and pid, and where it meets the others (multi-node debugging).

    Written directly, not through logging: every rank's line is wanted, whatever
    the level, and ``tests/multinode`` and ``status`` read its fixed form.
    """
    import socket

    env = os.environ
    line = (
        f"[fsdp_workflow] rank {env.get('RANK', '0')} of {env.get('WORLD_SIZE', '1')} "
        f"(node {env.get('GROUP_RANK', '0')}, local rank {env.get('LOCAL_RANK', '0')}) "
        f"host {socket.gethostname()} pid {os.getpid()} "
        f"master {env.get('MASTER_ADDR', '-')}:{env.get('MASTER_PORT', '-')}\n"
    )
    # One write with its newline: ranks share the log, and print() writes the text and
    # the newline separately, so two ranks' lines could run together.
    os.write(sys.stderr.fileno(), line.encode())


def _die_with_the_agent() -> None:
    """A rank that torchrun's agent started (``torchrun -m``) gets SIGKILL when the agent dies.

    The agent stops its ranks on every signal it handles; killed itself (``kill -9``, the OOM
    killer), it would leave them training with nobody to stop them (issue 49, item 4). Only
    under an agent (its ``TORCHELASTIC_RESTART_COUNT``): a trainer run by hand from a shell
    must outlive that shell as any program does. A rank forked by ``fsdp_workflow.train.node``
    arms the same for its forkserver there.
    """
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        import signal

        from fsdp_workflow.core.lifeline import arm

        arm(signal.SIGKILL, os.getppid())


if __name__ == "__main__":
    from fsdp_workflow.train.signals import install_early

    _die_with_the_agent()
    install_early()  # a Ctrl-C while torch imports stops after the first step, without a traceback
    sys.exit(main())
