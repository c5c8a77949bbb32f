"""Every code block of README.md and docs/*.md marked runnable runs, exits as the doc says, and prints what it says.

The marker and its keys: tests/docs/runnable.py and docs/contributing.md#runnable-docs.
A doc whose example rots then fails here instead of misleading a user.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, Tuple

import pytest

from .runnable import Block, find_blocks, parse_marker, run_block, run_setup, verdict

BLOCKS = find_blocks()
# (doc, session) -> (working directory, indices of BLOCKS already run there)
_SESSIONS: Dict[Tuple[Path, str], Tuple[Path, set]] = {}
# setup command -> the directory it ran in, for slow blocks outside a session (a training run each)
_SETUPS: Dict[str, Path] = {}


def _param(i: int, b: Block):
    marks = [pytest.mark.slow] if b.slow else []
    if b.skip:
        marks.append(pytest.mark.skip(reason=b.skip))
    twin = sum(1 for c in BLOCKS[:i] if c.where == b.where)  # a second marker on the same block
    return pytest.param(i, id=b.where + (f"#{twin + 1}" if twin else ""), marks=marks)


def _workdir(i: int, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh directory, or the block's session's, after the session's earlier blocks ran there."""
    block = BLOCKS[i]
    if not block.session:
        return tmp_path_factory.mktemp("doc")
    key = (block.path, block.session)
    if key not in _SESSIONS:
        _SESSIONS[key] = (tmp_path_factory.mktemp(f"doc-{block.session}"), set())
    work, done = _SESSIONS[key]
    for j in range(i):  # run alone (-k), a block still finds what the earlier ones left
        earlier = BLOCKS[j]
        if (earlier.path, earlier.session) == key and j not in done and not earlier.skip:
            done.add(j)
            problem = verdict(earlier, run_block(earlier, work))
            assert problem is None, f"an earlier block of session {block.session!r} failed:\n{problem}"
    done.add(i)
    return work


def _shared_setup(block: Block, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory where ``block.setup`` ran, once for all the slow blocks (of any doc) that name it.

    Such a setup trains a run; the blocks that share it read that run or write names of
    their own into it (docs/consolidation.md's ``RUN_DIR/hf-model``, docs/evaluation.md's
    ``evals.jsonl``), so their order does not matter.
    """
    if block.setup not in _SETUPS:
        work = tmp_path_factory.mktemp("doc-setup")
        done = run_setup(block, work)
        assert done.returncode == 0, f"{block.where}: setup failed: {block.setup}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        _SETUPS[block.setup] = work
    return _SETUPS[block.setup]


@pytest.mark.parametrize("i", [_param(i, b) for i, b in enumerate(BLOCKS)])
def test_marked_block_runs_as_documented(i: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    block = BLOCKS[i]
    if block.slow and block.setup and not block.session:
        work = _shared_setup(block, tmp_path_factory)
        block = dataclasses.replace(block, setup="")
    else:
        work = _workdir(i, tmp_path_factory)
    problem = verdict(block, run_block(block, work))
    assert problem is None, problem


def test_the_docs_have_runnable_blocks_in_each_user_facing_file() -> None:
    marked = {b.path.name for b in BLOCKS}
    for name in ("README.md", "data.md", "training.md", "consolidation.md", "observability.md", "parallelism.md",
                 "containers.md", "configuration.md"):
        assert name in marked, f"{name} has no runnable block"


def test_the_harness_catches_a_wrong_exit_code_and_a_missing_fragment(tmp_path: Path) -> None:
    doc = Block(path=Path(__file__), line=1, text="echo hello\nexit 3\necho never")
    assert verdict(parse_marker('exit=3 expect="hello"', doc), run_block(doc, tmp_path)) is None
    wrong = parse_marker('exit=0 expect="goodbye"', Block(path=Path(__file__), line=1, text=doc.text))
    problem = verdict(wrong, run_block(wrong, tmp_path))
    assert problem is not None and "exit 3, the doc says 0" in problem and "no 'goodbye' in the output" in problem
    part = parse_marker('lines=1 sub="hello=>$WORK"', Block(path=Path(__file__), line=1, text=doc.text))
    proc = run_block(part, tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == str(tmp_path)
    slow = parse_marker('timeout=1', Block(path=Path(__file__), line=1, text="sleep 30 & wait"))
    assert run_block(slow, tmp_path).returncode == 124
    with pytest.raises(ValueError, match="unknown runnable key 'exitcode'"):
        parse_marker("exitcode=0", Block(path=Path(__file__), line=1, text=""))
