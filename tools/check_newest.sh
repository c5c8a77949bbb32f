#!/usr/bin/env bash
# Drift, seen the day it happens: install the newest releases into a fresh virtual environment
# and run the tests of the library seams (tools/seam_tests.txt) there.
#
#   bash tools/check_newest.sh               # the newest versions pyproject.toml's ranges allow
#   bash tools/check_newest.sh --unbounded   # the newest releases of the libraries, past our upper bounds
#   bash tools/check_newest.sh --oldest      # every lower bound of pyproject.toml (are they still true?)
#   bash tools/check_newest.sh --venv DIR    # where to build it (default: $TMPDIR/fsdp_workflow-check)
#
# It prints which packages moved against the lock (requirements/common.txt), then the seam tests'
# result, and ends with one line: which package moved and which tests broke, or that all passed.
# Exit code: pytest's (0: the seam tests pass with these versions). The lock is not touched:
# docs/contributing.md ("Dependencies") says how to move it once this passes.
#
# torch stays at the lock's build on a CPU machine (requirements/cpu.txt: the CPU wheel on
# disk; a newer torch from PyPI is a multi-GB CUDA build): FSDP_WORKFLOW_TORCH_SPEC overrides.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PY="${PYTHON:-python3}"
mode=ranges
venv="${TMPDIR:-/tmp}/fsdp_workflow-check"
while [ $# -gt 0 ]; do
    case "$1" in
        --unbounded) mode=unbounded ;;
        --oldest) mode=oldest ;;
        --venv) venv="$2"; shift ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "check_newest: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

echo "[check] fresh virtual environment $venv ($mode)" >&2
rm -rf "$venv"
"$PY" -m venv "$venv"
V="$venv/bin/python"
"$V" -m pip install -q --disable-pip-version-check "${FSDP_WORKFLOW_TORCH_SPEC:-torch==$(sed -n 's/^torch==//p' requirements/cpu.txt)}"

# the libraries whose releases change what a run does, as --version lists them (GPU builds and extras aside);
# asked of the installed package, so the list is fsdp_workflow/core/versions.py's alone
seam_libs() { "$V" -c 'from fsdp_workflow.core.versions import BUILDS, LIBRARIES; print(*(n for n in LIBRARIES if n not in BUILDS))'; }

case "$mode" in
    ranges)
        "$V" -m pip install -q --disable-pip-version-check -e ".[dev]" ;;
    unbounded)
        "$V" -m pip install -q --disable-pip-version-check -e ".[dev]"
        # past our upper bounds on purpose: pip reports the conflict with fsdp_workflow's ranges
        "$V" -m pip install -q --disable-pip-version-check --upgrade $(seam_libs) || true ;;
    oldest)
        # each requirement's lower bound, pinned (torch aside: kept at the installed build)
        "$V" -m pip install -q --disable-pip-version-check packaging  # to compare versions below
        "$V" - "$ROOT/pyproject.toml" > "$venv/oldest.txt" <<'PYEOF'
import re, subprocess, sys
from packaging.version import InvalidVersion, Version

text = open(sys.argv[1]).read()
seen = set()
for name, spec in re.findall(r'"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*(>=[^"]*)"', text):
    low = re.match(r">=\s*([0-9][^,;\s]*)", spec)
    key = name.lower()
    if not low or key in seen or key in ("torch", "setuptools", "wandb", "trackio", "deepspeed", "torchao"):
        continue
    seen.add(key)
    # the lowest release at or above the bound: a bound like 0.23 names no release when 0.23.0 never was
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name, "--disable-pip-version-check"],
                         capture_output=True, text=True).stdout
    found = re.search(r"Available versions: (.*)", out)
    versions = []
    for v in found.group(1).split(", ") if found else []:
        try:
            versions.append(Version(v))
        except InvalidVersion:  # regex once numbered its releases 2013-12-31
            pass
    ok = sorted(v for v in versions if not v.is_prerelease and v >= Version(low.group(1)))
    print(f"{name}=={ok[0] if ok else low.group(1)}")
PYEOF
        echo "[check] lower bounds: $(tr '\n' ' ' < "$venv/oldest.txt")" >&2
        "$V" -m pip install -q --disable-pip-version-check -c "$venv/oldest.txt" -e ".[dev]" ;;
esac

# What moved against the lock (requirements/cpu.txt and the common.txt it includes)
"$V" -m pip freeze --exclude-editable 2>/dev/null > "$venv/freeze.txt"
moved=$("$V" - requirements/cpu.txt "$venv/freeze.txt" <<'PYEOF'
import re, sys
from pathlib import Path

def pins(path):
    out = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-c "):
            out.update(pins(Path(path).parent / line[3:].strip()))
        elif "==" in line:
            name, version = line.split("==", 1)
            out[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return out

lock, now = pins(sys.argv[1]), pins(sys.argv[2])
for name in sorted(set(lock) | set(now)):
    a, b = lock.get(name), now.get(name)
    if (a and b and a.split("+")[0] != b.split("+")[0]) or bool(a) != bool(b):
        print(f"{name} {a or '(not in the lock)'} -> {b or '(not installed)'}")
PYEOF
)
seam_moved=""
for lib in torch $(seam_libs); do
    key=$(echo "$lib" | sed 's/[-_.]\+/-/g' | tr 'A-Z' 'a-z')
    line=$(echo "$moved" | grep "^$key " || true)
    [ -n "$line" ] && seam_moved="$seam_moved${seam_moved:+, }$line"
done
echo "[check] moved against requirements/cpu.txt:" >&2
echo "${moved:-nothing}" | sed 's/^/  /' >&2
"$V" -m fsdp_workflow --version >&2 || true

# The seam tests
mapfile -t tests < <(grep -v '^\s*#' tools/seam_tests.txt | sed '/^\s*$/d')
set +e
FSDP_WORKFLOW_UNLOCKED=1 "$V" -m pytest -p no:cacheprovider -q -rf --durations=0 "${tests[@]}" \
    2>&1 | tee "$venv/pytest.txt" | grep -E "^(FAILED|ERROR)|passed|failed" >&2
rc=${PIPESTATUS[0]}
set -e
failed=$(grep -E "^(FAILED|ERROR) " "$venv/pytest.txt" | sed 's/ - .*//' | awk '{print $2}' | tr '\n' ' ' || true)
if [ "$rc" = 0 ]; then
    echo "[check] $mode: the seam tests pass (seam libraries moved: ${seam_moved:-none})"
else
    echo "[check] $mode: seam tests FAILED with ${seam_moved:-no seam library moved}: ${failed:-pytest exit $rc} (log: $venv/pytest.txt)"
fi
exit "$rc"
