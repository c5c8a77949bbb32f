"""Benchmark the streaming consolidator against Accelerate, torch DCP and ``cp -r``.

Run::

    python benchmarks/consolidate_bench.py --sizes 1.5 3 --ranks 2
    python benchmarks/consolidate_bench.py --hashes     # checksum throughput on this machine
    python benchmarks/consolidate_bench.py --nan-scan   # the NaN/inf scan's throughput, per dtype
    python benchmarks/consolidate_bench.py --sizes 1.5 --no-others --baseline /tmp/base   # paired with another checkout

For each size it writes a synthetic Llama-shaped bf16 checkpoint (``--ranks`` FSDP shards)
under ``benchmarks/_work/`` and runs, each in its own subprocess under ``/usr/bin/time``,
in ``--repeats`` interleaved rounds (median wall reported, every run listed): this
consolidator with its default verification, with ``--full-verify`` and with ``--no-verify`` (architecture cache
disabled, ``FSDP_WORKFLOW_NO_CACHE=1``, so each run is what a first consolidation of a new
config costs), ``accelerate.utils.merge_fsdp_weights``, torch's ``dcp_to_torch_save`` and
``cp -r`` of the shards. The page cache is warmed first so every tool reads from memory,
and ``sync`` runs before each timed command. Prints a markdown table of wall time, peak
RSS and ratios (of medians, and the median of each round's ratio to ``cp -r``) with the
load average before and after. The package is byte-compiled first (``compileall``), as an
installed package is. ``--keep`` keeps the data, ``--no-others`` skips
Accelerate and torch (they take most of the time).

A CPU column (user + system seconds, median) shows what each run cost where the CPUs are
shared. ``--baseline DIR`` runs our three commands from another checkout too, in the same
rounds (``git worktree add /tmp/base REV``), for a paired before/after comparison.

``--nan-scan`` times the writer's NaN/inf scan (``consolidate/nonfinite.py``) over 512 MiB of
finite values in 512 KiB slabs, per floating dtype, on one thread and on two, and the
import of numpy it needs, in a fresh interpreter.

``--hashes`` times the checksums a verification could keep per tensor (sha256 and the
other hashlib digests, zlib's crc32/adler32, and ``xxhash``, ``blake3``, ``crc32c`` when
installed) over 512 MiB in 1 MiB slabs, on one thread and on two.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
WORK = ROOT / "_work"


def timed(cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> tuple[float, float, float]:
    """Run ``cmd`` under /usr/bin/time; return (wall seconds, peak RSS in GB, CPU seconds: user + system)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf:
        subprocess.run(["sync"], check=True)
        proc = subprocess.run(["/usr/bin/time", "-f", "%e %M %U %S", "-o", tf.name, *cmd], env=env, cwd=cwd,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cmd[:4]} failed:\n{proc.stderr[-3000:]}")
        wall, rss_kb, user, system = tf.read().split()[-4:]
    return float(wall), int(rss_kb) / 1e6, float(user) + float(system)


def warm_cache(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass


def bench(gb: float, ranks: int, keep: bool, repeats: int, others: bool, baseline: Path | None = None) -> list:
    from fsdp_workflow.consolidate.synthetic import write_llama_run

    run = WORK / f"run-{gb}gb"
    if not (run / "checkpoints" / "step-1" / ".metadata").is_file():
        shutil.rmtree(run, ignore_errors=True)
        write_llama_run(run, gb, ranks)
    ckpt = run / "checkpoints" / "step-1"
    size = sum(f.stat().st_size for f in ckpt.iterdir())
    warm_cache(ckpt)
    py = sys.executable
    # Bytecode, as an installed package has it (pip compiles on install). Where PYTHONDONTWRITEBYTECODE
    # is set (this machine sets it) every run would otherwise compile the package's sources again.
    subprocess.run([py, "-m", "compileall", "-q", str(ROOT.parent / "fsdp_workflow")], check=True,
                   stdout=subprocess.DEVNULL)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FSDP_WORKFLOW_NO_CACHE": "1"}
    acc_code = (f"from accelerate.utils import merge_fsdp_weights; "
                f"merge_fsdp_weights({str(ckpt)!r}, {str(WORK / 'out-acc')!r}, safe_serialization=True)")
    torch_code = ("from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                  f"dcp_to_torch_save({str(ckpt)!r}, {str(WORK / 'out-torch.pt')!r})")
    ours = [py, "-m", "fsdp_workflow.consolidate", str(run)]
    tools = [
        # FSDP_WORKFLOW_NO_CACHE: every run costs what a first consolidation of a new config costs
        ("fsdp_workflow.consolidate (default verification: fast)", ours + [str(WORK / "out-ours"), "--no-progress"],
         WORK / "out-ours"),
        ("fsdp_workflow.consolidate --full-verify", ours + [str(WORK / "out-full"), "--no-progress", "--full-verify"],
         WORK / "out-full"),
        ("fsdp_workflow.consolidate --no-verify", ours + [str(WORK / "out-nv"), "--no-progress", "--no-verify"],
         WORK / "out-nv"),
        ("accelerate merge_fsdp_weights", [py, "-c", acc_code], WORK / "out-acc"),
        ("torch dcp_to_torch_save", [py, "-c", torch_code], WORK / "out-torch.pt"),
        ("cp -r (floor)", ["cp", "-r", str(ckpt), str(WORK / "out-cp")], WORK / "out-cp"),
    ]
    if not others:
        tools = [t for t in tools if not t[0].startswith(("accelerate", "torch"))]
    cwds: dict = {}
    if baseline is not None:  # the same three commands run from another checkout (``-m`` imports from the cwd)
        subprocess.run([py, "-m", "compileall", "-q", str(baseline / "fsdp_workflow")], check=True,
                       stdout=subprocess.DEVNULL)
        ours_base = []
        for name, cmd, out in tools[:3]:
            base_out = out.with_name(out.name + "-base")
            base_name = f"baseline {baseline.name}: {name.split(' ', 1)[1]}"
            ours_base.append((base_name, [str(base_out) if c == str(out) else c for c in cmd], base_out))
            cwds[base_name] = baseline
        tools = tools[:3] + ours_base + tools[3:]
    samples: dict = {name: [] for name, _, _ in tools}
    load_before = os.getloadavg()
    # Interleaved rounds, median wall: this machine's disk write-back makes single runs noisy.
    for _ in range(repeats):
        for name, cmd, out in tools:
            run_env = {**env, "PYTHONPATH": str(cwds[name])} if name in cwds else env
            samples[name].append(timed(cmd, run_env, cwds.get(name)))
            if "verif" in name and "no-verify" not in name:
                v = json.loads((out / "verification.json").read_text())
                print(f"{name}: ok={v['ok']}, compared {v['values']['compared']} tensors, "
                      f"{v['values']['bytes_compared_fraction']:.3f} of the bytes; architecture check: "
                      f"{v['architecture']['notes']}", file=sys.stderr)
            shutil.rmtree(out) if out.is_dir() else out.unlink()
    load_after = os.getloadavg()
    cp_runs = [w for w, _, _ in samples["cp -r (floor)"]]
    rows = [(name, statistics.median(w for w, _, _ in runs), max(r for _, r, _ in runs), [w for w, _, _ in runs],
             statistics.median(c for _, _, c in runs)) for name, runs in samples.items()]
    print(f"\n### {size / 1e9:.2f} GB bf16, {ranks} ranks, {os.cpu_count()} CPUs, median of {repeats}\n")
    print(f"load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; "
          f"after: {', '.join(f'{x:.2f}' for x in load_after)}\n")
    acc = next((r[1] for r in rows if r[0].startswith("accelerate")), None)
    cp = rows[-1][1]
    print("| tool | wall s (median) | runs | peak RSS MB | wall / cp -r (medians) | median of per-round / cp -r | wall / Accelerate | CPU s (median) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, wall, rss, walls, cpu in rows:
        runs_s = ", ".join(f"{w:.2f}" for w in walls)
        per_round = statistics.median(w / c for w, c in zip(walls, cp_runs))
        vs_acc = f"{wall / acc:.2f}" if acc else "-"
        print(f"| {name} | {wall:.2f} | {runs_s} | {rss * 1000:.0f} | {wall / cp:.2f} | {per_round:.2f} | {vs_acc} | {cpu:.2f} |")
    sys.stdout.flush()
    if not keep:
        shutil.rmtree(run)
    return rows


def hashes(total_mb: int = 512, slab: int = 1 << 20) -> None:
    """Throughput of per-tensor checksum candidates, 1 and 2 threads (each hashes its own half)."""
    import hashlib
    import time
    import zlib
    from concurrent.futures import ThreadPoolExecutor

    data = memoryview(os.urandom(total_mb << 20))

    def obj(ctor):  # a hashlib-style object
        return lambda part: _feed(ctor(), part, slab)

    def crc(fn, start):
        def run(part):
            h = start
            for i in range(0, len(part), slab):
                h = fn(part[i:i + slab], h)
            return h
        return run

    cands = {"sha256": obj(hashlib.sha256), "sha1": obj(hashlib.sha1), "md5": obj(hashlib.md5),
             "blake2b": obj(hashlib.blake2b), "zlib.crc32": crc(zlib.crc32, 0), "zlib.adler32": crc(zlib.adler32, 1)}
    try:
        import xxhash
        cands.update({"xxhash.xxh64": obj(xxhash.xxh64), "xxhash.xxh3_64": obj(xxhash.xxh3_64),
                      "xxhash.xxh3_128": obj(xxhash.xxh3_128)})
    except ImportError:
        print("xxhash not installed")
    try:
        import blake3
        cands["blake3 (one thread per hasher)"] = obj(blake3.blake3)
    except ImportError:
        print("blake3 not installed")
    try:
        import crc32c
        cands["crc32c"] = crc(lambda b, h: crc32c.crc32c(b, h), 0)
    except ImportError:
        print("crc32c not installed")
    print(f"load average before: {os.getloadavg()[0]:.2f}\n")
    print("| checksum | GB/s, 1 thread | GB/s, 2 threads |")
    print("|---|---|---|")
    for name, fn in cands.items():
        rates = []
        for threads in (1, 2):
            n = len(data) // threads
            t = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(fn, [data[i * n:(i + 1) * n] for i in range(threads)]))
            rates.append(len(data) / (time.perf_counter() - t) / 1e9)
        print(f"| {name} | {rates[0]:.2f} | {rates[1]:.2f} |")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


def nan_scan(total_mb: int = 512, slab: int = 512 << 10) -> None:
    """Throughput of the NaN/inf scan the writer runs on every slab, 1 and 2 threads, and numpy's import."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from fsdp_workflow.consolidate.nonfinite import NonFiniteScan

    imports = []
    for _ in range(5):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import numpy"], check=True)
        t_numpy = time.perf_counter() - t
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        imports.append(t_numpy - (time.perf_counter() - t))
    print(f"load average before: {os.getloadavg()[0]:.2f}\n")
    print(f"numpy import (fresh interpreter, median of 5, wall): {statistics.median(imports):.3f} s\n")
    print("| dtype | slabs | GB/s, 1 thread | GB/s, 2 threads | us per 512 KiB slab, 1 thread |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((total_mb << 20) // 4, dtype=np.float32)
    bufs = {"float32": f32.tobytes(), "float16": f32.astype(np.float16).tobytes()[: total_mb << 20],
            "bfloat16": (f32.view(np.uint32) >> 16).astype(np.uint16).tobytes()}
    for dtype, raw in bufs.items():
        for where in ("in cache (as in the writer: the slab it just assembled)", "from memory (a new slab each time)"):
            rates = []
            for threads in (1, 2):
                scan = NonFiniteScan()
                n = len(raw) // threads
                hot = where.startswith("in cache")

                def run(i0: int, scan: NonFiniteScan = scan, dtype: str = dtype, hot: bool = hot) -> None:
                    data = memoryview(raw)
                    for i in range(i0, i0 + n, slab):
                        scan.scan("t", dtype, data[i0:i0 + slab] if hot else data[i:i + slab])

                t = time.perf_counter()
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(run, [k * n for k in range(threads)]))
                rates.append(len(raw) / (time.perf_counter() - t) / 1e9)
                assert scan.found() == {}
            print(f"| {dtype} | {where} | {rates[0]:.2f} | {rates[1]:.2f} | {slab / rates[0] / 1e3:.0f} |")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


def _feed(h, part: memoryview, slab: int) -> str:
    for i in range(0, len(part), slab):
        h.update(part[i:i + slab])
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description="benchmark consolidation tools")
    p.add_argument("--sizes", type=float, nargs="+", default=[1.5, 3.0], help="checkpoint sizes in GB")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds; the median wall is reported")
    p.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints in benchmarks/_work/")
    p.add_argument("--no-others", action="store_true", help="skip Accelerate and torch (ours against cp -r only)")
    p.add_argument("--hashes", action="store_true", help="only time the checksum candidates")
    p.add_argument("--nan-scan", action="store_true", help="only time the NaN/inf scan of the copy")
    p.add_argument("--baseline", type=Path, help="another checkout (e.g. `git worktree add /tmp/base REV`): its three "
                                                 "consolidator commands run in the same rounds, for a paired comparison")
    a = p.parse_args()
    if a.hashes:
        hashes()
        return
    if a.nan_scan:
        nan_scan()
        return
    WORK.mkdir(parents=True, exist_ok=True)
    for gb in a.sizes:
        bench(gb, a.ranks, a.keep, a.repeats, not a.no_others, a.baseline.resolve() if a.baseline else None)
    if not a.keep:
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
