"""Charliecloud: ``ch-run [-b SRC[:DST]...] -c RUN_DIR IMAGE -- env ... argv``.

``ch-run`` (Charliecloud 0.31, Debian's ``charliecloud-runtime``) runs an image
directory (or a SquashFS ``.sqfs``) in unprivileged namespaces. Three things
differ from Apptainer, and this class is where they are handled:

* **Environment.** ``ch-run`` passes the whole host environment on. The env filter
  in front therefore unsets everything but the pass-through variables (and
  ``PATH``/``USER``, which ``ch-run`` itself needs on the host); inside, the
  ``env`` sets a standard ``PATH`` (``container.env.PATH`` overrides it for images
  whose tools live elsewhere) and the explicit variables.
* **Binds.** ``-b SRC[:DST]`` has no read-only option: inputs are bound
  read-write (the image itself is read-only). A bind's destination must already
  exist in the image (``ch-run`` cannot create it in a read-only image), except
  under ``/tmp``, which ``ch-run`` shares with the host; validation checks this
  for a local image directory and prints the ``mkdir -p`` that fixes it.
* **GPU.** ``ch-run`` has no ``--nv``: ``/dev`` is always shared, and the host's
  driver libraries go into the image once with ``ch-fromhost --nvidia IMAGE``.
"""

from __future__ import annotations

import os
import shlex
from typing import List, Optional

from fsdp_workflow.config.errors import Issue
from fsdp_workflow.config.schema import WorkflowConfig, run_layout
from fsdp_workflow.container.base import ContainerCommand, EnvFilter, Issues, Runtime, explicit_env
from fsdp_workflow.container.binds import Bind, bind_list
from fsdp_workflow.core.roles import Role

# The PATH inside unless container.env sets one: the host's would name host directories.
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# ch-run shares the host's /tmp (unless --private-tmp): destinations there exist inside.
SHARED_DIRS = ("/tmp",)
WRITE_FLAGS = ("-w", "--write")  # a writable image lets ch-run create missing destinations


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _parsed_binds(cfg: WorkflowConfig) -> List[Bind]:
    """The binds, or none when one cannot be parsed (validation reports that entry itself)."""
    try:
        return bind_list(cfg)
    except ValueError:
        return []


class Charliecloud(Runtime):
    """``container.runtime=charliecloud``: an image directory run with ``ch-run``."""

    name = "charliecloud"
    image_example = "/shared/images/fsdp_workflow (a directory from ch-convert, or a .sqfs)"
    build_hint = ("docs/containers.md: ch-image build -t fsdp_workflow -f containers/Dockerfile . && "
                  "ch-convert fsdp_workflow /shared/images/fsdp_workflow")
    bind_option = "ch-run -b"
    unbindable_chars = (":",)  # -b splits SRC:DST on ':' only; each bind is one argument
    env_filter = EnvFilter(export_prefix="", drop_prefixes=(), drop_rest=True, keep_host=("PATH", "USER"))

    def bind_arg(self, b: Bind) -> str:
        """``-b`` value: ``src`` for a same-path bind, else ``src:dst`` (no read-only option in 0.31)."""
        return b.src if b.src == b.dst else f"{b.src}:{b.dst}"

    def in_image_env(self, cfg: WorkflowConfig) -> List[str]:
        env = {"PATH": IMAGE_PATH, **explicit_env(cfg)}
        return ["env"] + [f"{k}={v}" for k, v in sorted(env.items())]

    def command(self, cfg: WorkflowConfig, step: Role) -> ContainerCommand:
        # GPU and CPU steps get the same command: ch-run always shares /dev (no --nv to add)
        argv = ["ch-run"]
        for b in bind_list(cfg):
            argv += ["-b", self.bind_arg(b)]
        argv += ["-c", str(run_layout(cfg).root), *cfg.container.extra_args, str(cfg.container.image), "--"]
        return ContainerCommand(self.env_filter, argv + self.in_image_env(cfg))

    def image_path(self, image: str) -> Optional[str]:
        return image if image.startswith("/") else None  # a relative one is refused by issues()

    def issues(self, cfg: WorkflowConfig) -> Issues:
        ct = cfg.container
        errors: List[Issue] = []
        warnings: List[Issue] = []
        image = ct.image or ""
        if image and not image.startswith("/"):
            errors.append(Issue("container.image", image,
                                "ch-run reads a relative path or a ch-image storage name on the node that runs the "
                                "step, where it may name another image", f"container.image={self.image_example}"))
            return errors, warnings
        binds = _parsed_binds(cfg)
        # an explicit ":ro" the user asked for cannot be honoured: say so rather than drop it silently
        warnings += [Issue(b.key, ct.binds[int(b.key[len("container.binds["):-1])],
                           "ch-run (Charliecloud 0.31) has no read-only bind: it is bound read-write",
                           "drop ':ro', or use container=apptainer where read-only matters")
                     for b in binds if b.read_only and b.key.startswith("container.binds[")]
        if not os.path.isdir(image) or any(f in ct.extra_args for f in WRITE_FLAGS):
            return errors, warnings  # a .sqfs, a missing image (reported elsewhere) or a writable image
        for b in binds:
            inside = os.path.join(image, b.dst.lstrip("/"))
            is_file = os.path.isfile(b.src)  # a file binds onto a file, anything else onto a directory
            if any(_under(b.dst, d) for d in SHARED_DIRS) or (os.path.isfile if is_file else os.path.isdir)(inside):
                continue
            make = (f"mkdir -p {shlex.quote(os.path.dirname(inside))} && touch {shlex.quote(inside)}" if is_file
                    else f"mkdir -p {shlex.quote(inside)}")
            (warnings if cfg.dry_run else errors).append(Issue(
                b.key, b.dst,
                f"ch-run binds only onto a {'file' if is_file else 'directory'} that exists in the image, "
                "and this one is missing there",
                f"{make}  (or container.extra_args=[-w] for a writable image)",
            ))
        return errors, warnings
