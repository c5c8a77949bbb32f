"""The training job's preflight: one task per node checks the allocation before torchrun starts.

    srun --nodes=N --ntasks-per-node=1 python -m fsdp_workflow.preflight RUN_DIR \\
        --nodes N --processes-per-node P --device cpu|cuda

``train.sbatch`` runs it when ``cluster.preflight`` is true (the default), after
``MASTER_ADDR``/``MASTER_PORT`` are set and before the training step. A node that
cannot see the run directory, runs other code or other torch/transformers
versions, has fewer GPUs than ranks, or cannot reach the others makes a
rendezvous hang for ``cluster.rdzv_timeout_s`` or fail deep in a traceback;
here it costs seconds and one line that names the node, the check and the fix.

Every node:

1. writes its facts (host, the code it imports and its sha256, torch and
   transformers versions, GPUs, what ``MASTER_ADDR`` resolves to) into
   ``RUN_DIR/.preflight/<job id>.<restart>/node-I.json``; a node that cannot write
   there cannot see the run directory;
2. waits (:data:`PEER_WAIT_S`) for every node's file and compares them; the lowest
   node that sees them all prints the problems for the whole allocation;
3. node 0 (on the master host) checks that ``MASTER_ADDR`` is one of its addresses
   and ``MASTER_PORT`` is free, then every node joins a one-element all-reduce over
   a store on ``MASTER_ADDR:MASTER_PORT`` (gloo on CPU, NCCL on GPU), the route the
   training's rendezvous takes, within :data:`COLLECTIVE_TIMEOUT_S`.

Exit codes: 0 every check passed; 66 (:data:`~fsdp_workflow.core.exit_codes.EXIT_PREFLIGHT`)
a check failed, and the batch script then ends the job with 66 before any rank
starts (the consolidation job is cancelled by its ``afterok`` dependency); 2 bad
arguments. Test-only faults (``FSDP_WORKFLOW_TEST_PREFLIGHT``, :func:`fault_from_env`)
make one node lose the run directory or report another torch version.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import fsdp_workflow
from fsdp_workflow.backends.slurm.queue import hostnames as _hosts
from fsdp_workflow.core.exit_codes import EXIT_OK, EXIT_PREFLIGHT, EXIT_USAGE
from fsdp_workflow.core.rundir import RunDir, atomic_write_json
from fsdp_workflow.plan.snapshot import content_hash

PEER_WAIT_S = 30.0  # how long a node waits for the others' facts (NFS may show a new file seconds late)
COLLECTIVE_TIMEOUT_S = 60.0  # the store connection and the all-reduce
POLL_S = 0.25
PREFIX = "[fsdp_workflow] preflight"
# Test-only: "KIND@HOST", KIND one of FAULT_KINDS; and a shorter wait for the others' facts.
FAULT_ENV = "FSDP_WORKFLOW_TEST_PREFLIGHT"
WAIT_ENV = "FSDP_WORKFLOW_TEST_PREFLIGHT_WAIT_S"
FAULT_KINDS = ("no_run_dir", "version")

SHARED_FS_FIX = ("put the run directory on a filesystem every node mounts at the same path (not /tmp or a "
                 "node-local disk), plan the run there, and submit again")
SAME_ENV_FIX = ("give every node the same software: the same Python environment (cluster.env_script, "
                "cluster.modules) or container image, then submit again")


@dataclass
class Facts:
    """What one node found; written as ``node-I.json`` for the others to compare."""

    node_id: int
    host: str
    package: str  # where this node imports fsdp_workflow from
    code_sha256: str  # content hash of that package (plan.snapshot.content_hash)
    torch: str
    transformers: str
    gpus: Optional[int]  # visible CUDA devices; None on CPU
    master_ip: str  # what MASTER_ADDR resolves to here ("" when it does not)
    master_error: str = ""
    port_error: str = ""  # node 0 only: MASTER_PORT or MASTER_ADDR unusable on the master host
    cwd: str = ""  # the task's working directory: ``python -m`` imports a package there first


@dataclass
class Problem:
    """One failed check, on one node: printed as one line with the fix."""

    node: str  # "n2 (node 1)"
    check: str
    why: str
    fix: str

    def line(self) -> str:
        return f"{PREFIX} failed on {self.node}: {self.check}: {self.why}. Fix: {self.fix}."


@dataclass
class Context:
    """This node's place in the step and what the plan expects."""

    run_dir: Path
    job_id: str
    restart: int
    node_id: int
    nodes: int
    processes_per_node: int
    device: str
    master_addr: str
    master_port: int
    wait_s: float = PEER_WAIT_S
    fault: Optional[Tuple[str, str]] = None
    hosts: List[str] = field(default_factory=list)

    @property
    def host(self) -> str:
        return socket.gethostname().split(".")[0]

    def name(self, node_id: int, host: str = "") -> str:
        host = host or (self.hosts[node_id] if node_id < len(self.hosts) else "")
        return f"{host} (node {node_id})" if host else f"node {node_id}"

    @property
    def token_dir(self) -> Path:
        return RunDir(self.run_dir).preflight(self.job_id, self.restart)


def fault_from_env(host: str, node_id: int, environ: Optional[Dict[str, str]] = None) -> Optional[Tuple[str, str]]:
    """The test-only fault ``FSDP_WORKFLOW_TEST_PREFLIGHT=KIND@WHERE`` aimed at this node, or None.

    ``no_run_dir@n2``: the node on host n2 acts as if the run directory did not exist there;
    ``version@n2``: it reports a torch version of its own. ``WHERE`` may also be ``node-I``
    (node id I), for tests whose nodes share one host.

    Raises:
        ValueError: the variable is set but malformed (a test bug, reported loudly).
    """
    spec = (environ if environ is not None else os.environ).get(FAULT_ENV, "").strip()
    if not spec:
        return None
    kind, _, target = spec.partition("@")
    if kind not in FAULT_KINDS or not target:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected KIND@HOST or KIND@node-I with KIND in {FAULT_KINDS}")
    return (kind, target) if target in (host, f"node-{node_id}") else None


# ---------------------------------------------------------------- this node
def _resolve(addr: str) -> Tuple[str, str]:
    """(IPv4/IPv6 address, "") or ("", the resolver's error)."""
    try:
        return socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][4][0], ""
    except OSError as err:
        return "", f"{type(err).__name__}: {err}"


def _port_error(ip: str, port: int) -> str:
    """Why the master host cannot listen on MASTER_ADDR:MASTER_PORT ("" when it can).

    Bound with SO_REUSEADDR, as c10d's store binds: a connection of an earlier job in
    TIME_WAIT does not count as "in use", a listening process does.
    """
    fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
    for addr, what in (((ip, 0), "address"), (("", port), "port")):
        s = socket.socket(fam, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
            s.listen(1)
        except OSError as err:
            if what == "address":
                return f"resolves to {ip}, which is not an address of this host ({err.strerror})"
            if err.errno == errno.EADDRINUSE:
                return f"port {port} is in use on this host (another process or job listens there)"
            return f"cannot listen on port {port} ({err.strerror})"
        finally:
            s.close()
    return ""


def local_facts(ctx: Context) -> Facts:
    """This node's facts (imports torch: seconds)."""
    import importlib.metadata as md

    import torch

    package = Path(fsdp_workflow.__file__).resolve().parent
    try:
        transformers = md.version("transformers")
    except md.PackageNotFoundError:
        transformers = "not installed"
    gpus = torch.cuda.device_count() if ctx.device == "cuda" else None
    ip, master_error = _resolve(ctx.master_addr)
    torch_version = str(torch.__version__)
    if ctx.fault and ctx.fault[0] == "version":
        torch_version += "+test-other-version"
    facts = Facts(ctx.node_id, ctx.host, str(package), content_hash(package), torch_version, transformers,
                  gpus, ip, master_error, cwd=os.getcwd())
    if ctx.node_id == 0 and ip:
        facts.port_error = _port_error(ip, ctx.master_port)
    return facts


def write_facts(ctx: Context, facts: Facts) -> Optional[Problem]:
    """``node-I.json`` in the token directory; a Problem when this node cannot write there."""
    try:
        if ctx.fault and ctx.fault[0] == "no_run_dir":
            raise FileNotFoundError(errno.ENOENT, "No such file or directory (test fault)", str(ctx.run_dir))
        if not ctx.run_dir.is_dir():
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(ctx.run_dir))
        ctx.token_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(ctx.token_dir / f"node-{ctx.node_id}.json", asdict(facts))
    except OSError as err:
        return Problem(ctx.name(ctx.node_id, facts.host), "run directory",
                       f"this node cannot write in the run directory {ctx.run_dir} ({err.strerror or err})",
                       SHARED_FS_FIX)
    return None


def read_all(ctx: Context) -> Dict[int, Facts]:
    """Every node's facts that arrive within ``ctx.wait_s`` (all of them when all nodes see the run directory)."""
    deadline = time.monotonic() + ctx.wait_s
    found: Dict[int, Facts] = {}
    while True:
        try:
            os.listdir(ctx.token_dir)  # a directory read makes NFS revalidate what it caches
        except OSError:
            pass
        for i in range(ctx.nodes):
            if i not in found:
                try:
                    found[i] = Facts(**json.loads((ctx.token_dir / f"node-{i}.json").read_text()))
                except (OSError, ValueError, TypeError):
                    pass
        if len(found) == ctx.nodes or time.monotonic() >= deadline:
            return found
        time.sleep(POLL_S)


# ---------------------------------------------------------------- the allocation
def compare(ctx: Context, found: Dict[int, Facts], planned_sha256: Optional[str]) -> List[Problem]:
    """The problems that the nodes' facts show, each naming the node and the fix."""
    out: List[Problem] = []
    for i in range(ctx.nodes):
        if i not in found:
            out.append(Problem(ctx.name(i), "run directory",
                               f"no facts from this node in {ctx.token_dir} after {ctx.wait_s:g} s: it cannot see "
                               f"the run directory {ctx.run_dir} (or it could not start Python there; its own lines "
                               "above say which)", SHARED_FS_FIX))
    ref = found.get(min(found)) if found else None
    for i, f in sorted(found.items()):
        where = ctx.name(i, f.host)
        if planned_sha256 and f.code_sha256 != planned_sha256:
            fix = (f"keep {RunDir(ctx.run_dir).code} as planned and keep PYTHONPATH in cluster.env_script from "
                   "putting another copy first; or plan the run again (python -m fsdp_workflow ...)")
            if f.cwd and Path(f.package).parent == Path(f.cwd):
                fix = (f"the job's working directory {f.cwd} holds a copy of fsdp_workflow, and python -m imports "
                       "it before the snapshot: submit from another directory, and leave that copy alone meanwhile")
            out.append(Problem(where, "code snapshot",
                               f"it imports fsdp_workflow from {f.package} (sha256 {f.code_sha256[:12]}), not the "
                               f"code snapshot planned for this run (sha256 {planned_sha256[:12]})", fix))
        elif not planned_sha256 and ref is not None and f.code_sha256 != ref.code_sha256:
            out.append(Problem(where, "same code", f"its fsdp_workflow ({f.package}, sha256 {f.code_sha256[:12]}) differs "
                               f"from {ctx.name(ref.node_id, ref.host)}'s ({ref.package}, sha256 "
                               f"{ref.code_sha256[:12]})", "install the same code on every node, or plan with "
                               "cluster.code_snapshot=true (the default)"))
        for lib in ("torch", "transformers"):
            if ref is not None and getattr(f, lib) != getattr(ref, lib):
                out.append(Problem(where, "versions", f"it runs {lib} {getattr(f, lib)}, "
                                   f"{ctx.name(ref.node_id, ref.host)} runs {lib} {getattr(ref, lib)}", SAME_ENV_FIX))
        if f.gpus is not None and f.gpus < ctx.processes_per_node:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            out.append(Problem(where, "GPUs", f"it sees {f.gpus} GPU(s)"
                               + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
                               + f" for cluster.processes_per_node={ctx.processes_per_node} ranks",
                               "ask Slurm for one GPU per rank (cluster.gpus_per_node, or leave it unset), or set "
                               "cluster.processes_per_node to the GPUs a node has"))
        if f.master_error:
            out.append(Problem(where, "master address", f"MASTER_ADDR={ctx.master_addr} does not resolve here "
                               f"({f.master_error})", "make the nodes' hostnames resolve on every node (DNS or "
                               "/etc/hosts); the master is the first host of the allocation"))
        if f.port_error:
            out.append(Problem(where, "master port", f"MASTER_ADDR={ctx.master_addr}:{ctx.master_port}: "
                               f"{f.port_error}", "submit again (the port comes from the job id), or change "
                               "cluster.master_port_base / cluster.port_range to a range free on the nodes"))
    return out


def all_reduce(ctx: Context) -> Optional[Problem]:
    """A one-element all-reduce of every node over a store on MASTER_ADDR:MASTER_PORT; a Problem if it fails."""
    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    backend = "nccl" if ctx.device == "cuda" else "gloo"
    try:
        store = dist.TCPStore(ctx.master_addr, ctx.master_port, ctx.nodes, ctx.node_id == 0, timeout,
                              wait_for_workers=False)
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, store=store, rank=ctx.node_id, world_size=ctx.nodes, timeout=timeout)
        x = torch.ones(1, device="cuda" if backend == "nccl" else "cpu")
        dist.all_reduce(x)
        total = int(x.item())
        # The store lives in node 0's process: it leaves only after every node is done with it.
        store.add("preflight_done", 1)
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        while ctx.node_id == 0 and store.add("preflight_done", 0) < ctx.nodes and time.monotonic() < deadline:
            time.sleep(POLL_S)
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - c10d raises several types; each is this check's failure
        return Problem(ctx.name(ctx.node_id, ctx.host), "all-reduce",
                       f"a {backend} all-reduce across the {ctx.nodes} nodes over {ctx.master_addr}:"
                       f"{ctx.master_port} did not complete within {COLLECTIVE_TIMEOUT_S:g} s "
                       f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})",
                       "the nodes must reach each other over TCP on the interface the hostnames resolve to "
                       "(a firewall, or the wrong interface: set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME in "
                       "cluster.nccl_env)")
    if total != ctx.nodes:
        return Problem(ctx.name(ctx.node_id, ctx.host), "all-reduce", f"the sum of ones over {ctx.nodes} nodes "
                       f"came back as {total}", "check the interconnect (NCCL_DEBUG=INFO in cluster.nccl_env)")
    return None


# ---------------------------------------------------------------- entry point
def _planned_sha256(run_dir: Path) -> Optional[str]:
    """The code snapshot's sha256 as planned (``provenance.json``); None without a snapshot."""
    try:
        snap = json.loads(RunDir(run_dir).provenance.read_text()).get("code_snapshot")
    except (OSError, ValueError, AttributeError):
        return None
    return snap.get("sha256") if isinstance(snap, dict) else None


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _give_up(signum: int, frame: object) -> None:
    os.write(2, f"{PREFIX} failed: no answer within its time limit on {socket.gethostname()}; "
                "nothing was trained\n".encode())
    os._exit(EXIT_PREFLIGHT)


def run(ctx: Context) -> int:
    """All checks on this node; returns 0 or :data:`EXIT_PREFLIGHT`."""
    t0 = time.monotonic()
    facts = local_facts(ctx)
    problem = write_facts(ctx, facts)
    if problem is not None:  # the others report this node missing too
        _say(problem.line())
        return EXIT_PREFLIGHT
    found = read_all(ctx)
    problems = compare(ctx, found, _planned_sha256(ctx.run_dir))
    reporter = ctx.node_id == min(found, default=ctx.node_id)  # the lowest node that sees RUN_DIR speaks
    gpus = "skipped (cluster.device=cpu)" if facts.gpus is None else str(facts.gpus)
    _say(f"{PREFIX} {ctx.name(ctx.node_id, facts.host)}: run directory ok, code sha256 {facts.code_sha256[:12]}, "
         f"torch {facts.torch}, transformers {facts.transformers}, GPUs {gpus}, "
         f"master {ctx.master_addr} -> {facts.master_ip or '?'}")
    if problems:
        if reporter:
            for p in problems:
                _say(p.line())
        return EXIT_PREFLIGHT
    problem = all_reduce(ctx)
    if problem is not None:
        _say(problem.line())
        return EXIT_PREFLIGHT
    if ctx.node_id == 0:
        _say(f"{PREFIX} passed on {ctx.nodes} node(s) in {time.monotonic() - t0:.1f} s: run directory, code, "
             f"versions, GPUs, master {ctx.master_addr}:{ctx.master_port}, all-reduce")
        # every node has read the facts (the all-reduce came after): nothing of a good preflight stays
        for i in range(ctx.nodes):
            (ctx.token_dir / f"node-{i}.json").unlink(missing_ok=True)
        try:
            ctx.token_dir.rmdir()
        except OSError:
            pass
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fsdp_workflow.preflight", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path, help="the run directory (as planned)")
    p.add_argument("--nodes", type=int, required=True, help="nodes of the allocation (cluster.nodes)")
    p.add_argument("--processes-per-node", type=int, required=True, help="ranks per node (cluster.processes_per_node)")
    p.add_argument("--device", choices=("cpu", "cuda"), required=True, help="cluster.device")
    return p


def main(argv: Optional[Sequence[str]] = None, environ: Optional[Dict[str, str]] = None) -> int:
    """Run the preflight on this node of a Slurm step; see the module docstring."""
    args = _parser().parse_args(argv)
    env = dict(os.environ if environ is None else environ)
    try:
        ctx = Context(
            run_dir=Path(os.path.abspath(args.run_dir)), job_id=env.get("SLURM_JOB_ID", "0"),
            restart=int(env.get("SLURM_RESTART_COUNT", "0") or 0), node_id=int(env.get("SLURM_NODEID", "0")),
            nodes=args.nodes, processes_per_node=args.processes_per_node, device=args.device,
            master_addr=env.get("MASTER_ADDR", ""), master_port=int(env.get("MASTER_PORT", "0")),
            wait_s=float(env.get(WAIT_ENV) or PEER_WAIT_S),
        )
        ctx.fault = fault_from_env(ctx.host, ctx.node_id, env)
    except ValueError as err:
        _say(f"{PREFIX}: {err}")
        return EXIT_USAGE
    if not ctx.master_addr or not ctx.master_port:
        _say(f"{PREFIX}: MASTER_ADDR and MASTER_PORT must be set (train.sbatch sets them); nothing was checked")
        return EXIT_USAGE
    ctx.hosts = _hosts(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
    signal.signal(signal.SIGALRM, _give_up)  # a bound on everything, a hung filesystem included
    signal.alarm(int(ctx.wait_s + 2 * COLLECTIVE_TIMEOUT_S + 60))
    return run(ctx)


if __name__ == "__main__":
    sys.exit(main())
