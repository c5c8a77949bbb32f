"""Every fix a message suggests is accepted by the planner (issue 24, item 12).

For each case of the invalid corpus, the override(s) of the first alternative
its message suggests are applied on top of the case; the error the message
was about must then be gone (and the key must exist: a suggested key the
planner refuses is a broken promise). Applying a fix replaces the case's
override of the same key (and of the key in error), as a user edits the
command line. Fixes that are prose or placeholders
(``/path/to/...``, ``NAME``) have nothing to apply and must at least say what to write; most
messages must carry an exact override.
"""

from __future__ import annotations

import functools
import re
from typing import List, Tuple

import pytest
from invalid_corpus import INVALID_CASES, case_id

from fsdp_workflow.config.keys import override_key, override_key_issues
from fsdp_workflow.config.load import compose
from fsdp_workflow.plan.checks import check

_OVERRIDE = re.compile(r"(?<![\w.])([+~]?[a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*=(?:\[[^\]]*\]|[^\s,;)`']+))")
_PLACEHOLDER = re.compile(r"/path/to|/absolute/|[A-Z]{3,}|<|\.\.\.")


def suggested_alternatives(fix: str) -> List[List[str]]:
    """The exact overrides of each alternative a fix offers ("A B (or C)", "A, or B"), in order.

    An alternative holding a placeholder (``data.path=/path/to/...``) or none is left out.
    """
    out: List[List[str]] = []
    for alternative in re.split(r"\(or |, or | or |; ", fix):
        found = [m.rstrip(".") for m in _OVERRIDE.findall(alternative)]
        if found and not any(_PLACEHOLDER.search(o) for o in found):
            out.append(found)
    return out


def suggested_overrides(fix: str) -> List[str]:
    """The first alternative with exact overrides ([] when none has any)."""
    alternatives = suggested_alternatives(fix)
    return alternatives[0] if alternatives else []


def test_the_extraction_reads_fixes_as_a_user_would() -> None:
    assert suggested_overrides("strategy.sync_module_states=true (or strategy.cpu_ram_efficient_loading=false)") == \
        ["strategy.sync_module_states=true"]
    assert suggested_overrides("strategy.sync_module_states=false strategy.cpu_ram_efficient_loading=false") == \
        ["strategy.sync_module_states=false", "strategy.cpu_ram_efficient_loading=false"]
    assert suggested_overrides("data.path=/path/to/train.jsonl (a file)") == []
    assert suggested_overrides("model.name_or_path=/path/to/hf_model_dir (or model.init=random)") == ["model.init=random"]
    assert suggested_overrides("optimizer.betas=[0.9,0.95]") == ["optimizer.betas=[0.9,0.95]"]



@functools.lru_cache(maxsize=None)
def case_errors(overrides: Tuple[str, ...]) -> tuple:
    """The planner's errors for a case, composed once for this module's two tests (the check is deterministic)."""
    return tuple(check(compose(["+experiment=smoke", "dry_run=true", *overrides])).errors)


@pytest.mark.parametrize("case", INVALID_CASES, ids=[case_id(c) for c in INVALID_CASES])
def test_the_suggested_fix_is_accepted_and_removes_the_error(case) -> None:
    overrides, key = case
    issues = [i for i in case_errors(tuple(overrides)) if i.key == key]
    assert issues, f"the case no longer fails on {key}"
    alternatives = suggested_alternatives(issues[0].fix)
    if not alternatives:  # prose ("one of eager, sdpa, ..."): it must still say what to write
        assert len(issues[0].fix.split()) >= 3, f"the fix of {key} says too little: {issues[0].fix!r}"
        return
    for fix in alternatives:  # every alternative offered must work, not only the first
        assert not override_key_issues(fix), f"the fix {fix} names a key the planner refuses"
        replaced = {key} | {override_key(o) for o in fix}
        kept = [o for o in overrides if override_key(o) not in replaced]
        after = check(compose(["+experiment=smoke", "dry_run=true", *kept, *fix]))
        still = [i for i in after.errors if i.key == key and i.why == issues[0].why]
        assert not still, f"applying {fix} left: {still[0].format()}"


def test_most_messages_carry_an_exact_fix() -> None:
    exact = 0
    for overrides, key in INVALID_CASES:
        issues = [i for i in case_errors(tuple(overrides)) if i.key == key]
        exact += bool(issues and suggested_alternatives(issues[0].fix))
    assert exact >= 0.8 * len(INVALID_CASES), (exact, len(INVALID_CASES))
