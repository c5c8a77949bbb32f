"""A stand-in for ``apptainer exec`` built on bubblewrap (Apptainer cannot be installed on CI).

Usage (as the ``apptainer`` found on PATH): ``apptainer exec [--cleanenv] [--no-home] [--nv]
[--pwd DIR] [--bind SRC[:DST[:ro|rw]]]... IMAGE CMD...``.

It honours what the real runtime does with the options ``fsdp_workflow.container.wrap``
emits: a new mount namespace holding only the image (here: the host's /usr, /lib*, /bin,
/etc, the Python prefix and the project, read-only) plus the ``--bind`` paths; with
``--cleanenv`` an empty environment plus the ``APPTAINERENV_*`` variables (prefix
stripped); ``--pwd`` as the working directory. A missing bind source or image fails
before the step starts, with Apptainer's FATAL wording. ``--nv`` is accepted and ignored
(no GPU here).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List

import fsdp_workflow

PROJECT = str(Path(fsdp_workflow.__file__).resolve().parents[1])
SYSTEM_DIRS = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc"]


def image_args() -> List[str]:
    """Read-only system dirs + Python + project: what the image would provide."""
    args: List[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    # The private /tmp first: binds below it (a venv or checkout under /tmp) must stay visible.
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    for d in sorted({sys.base_prefix, sys.prefix, PROJECT}):
        args += ["--ro-bind", d, d]
    return args


def fatal(message: str) -> None:
    print(f"FATAL:   {message}", file=sys.stderr)
    raise SystemExit(255)


def main(argv: List[str]) -> None:
    if not argv or argv[0] != "exec":
        fatal(f"fake apptainer only implements exec, got {argv[:1]}")
    args = argv[1:]
    cleanenv, pwd, binds = False, None, []
    while args and args[0].startswith("-"):
        flag = args.pop(0)
        if flag in ("--cleanenv", "-e"):
            cleanenv = True
        elif flag in ("--no-home", "--nv"):
            pass
        elif flag == "--pwd":
            pwd = args.pop(0)
        elif flag in ("--bind", "-B"):
            binds.append(args.pop(0))
        else:
            fatal(f"fake apptainer does not know {flag}")
    image, command = args[0], args[1:]
    if not os.path.exists(image):
        fatal(f"could not open image {image}: failed to retrieve path for {image}: no such file or directory")
    bwrap = ["bwrap", "--die-with-parent", "--unshare-pid", *image_args()]
    for spec in binds:
        src, dst, opt = (spec.split(":") + ["", ""])[:3]
        dst = dst or src
        if not os.path.exists(src):
            fatal(f"container creation failed: mount hook function failure: mount {src}->{dst} error: "
                  f"while mounting {src}: mount source {src} doesn't exist")
        bwrap += ["--ro-bind" if opt == "ro" else "--bind", src, dst]
    if cleanenv:
        bwrap.append("--clearenv")
        env = {k[len("APPTAINERENV_"):]: v for k, v in os.environ.items() if k.startswith("APPTAINERENV_")}
        env.setdefault("PATH", f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin")
        for key, value in sorted(env.items()):
            bwrap += ["--setenv", key, value]
    if pwd:
        bwrap += ["--chdir", pwd]
    os.execvp("bwrap", bwrap + ["--", *command])


if __name__ == "__main__":
    main(sys.argv[1:])
