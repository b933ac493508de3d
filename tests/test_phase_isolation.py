"""Each phase testable alone: Phase k's tests import nothing built in a later phase.

docs/modules.md's phase column says which phase built each module (`phases.module_phases`). One fresh interpreter
goes through the phases in order: for Phase k it hides the modules of Phases k+1.. (`phases.hide_after_phase`, an
import hook: as if not built yet) and imports Phase k's test files, with everything they import at their top.
Phases 1..k-1's files are imported by then, with nothing beyond them, so each phase is checked against its own
line. What the code imports where a feature is used (a beam search, a speculative config) runs under the same hook
in `make test-phase P=k` (TINYVLLM_HIDE_AFTER_PHASE, tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from phases import MODULE_MAP, PHASE_OF_TEST_FILE, ROOT, HideLaterPhases, module_phases

TESTS = ROOT / "tests"
LAST_PHASE = max(PHASE_OF_TEST_FILE.values())

# the interpreter's script: {phase: ["test_x: the error", ...]} as JSON on its last line
IMPORT_EVERY_PHASE = """
import importlib, json, sys
sys.path[:0] = [{tests!r}, {root!r}]
from phases import PHASE_OF_TEST_FILE, folders_of_tests, hide_after_phase
sys.path[:0] = [str(folder) for folder in folders_of_tests()]  # tests/core/, tests/engine/, ...
hook, failures = hide_after_phase(1), {{}}
for phase in range(1, {last} + 1):
    hook.hide_after(phase)
    failures[phase] = []
    for name in sorted(n for n, p in PHASE_OF_TEST_FILE.items() if p == phase):
        try:
            importlib.import_module(name)
        except ImportError as e:
            failures[phase].append(f"{{name}}: {{e}}")
print(json.dumps(failures))
"""


@pytest.fixture(scope="module")
def import_failures() -> dict[int, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "TINYVLLM_HIDE_AFTER_PHASE"}
    script = IMPORT_EVERY_PHASE.format(tests=str(TESTS), root=str(ROOT), last=LAST_PHASE)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("phase", range(1, LAST_PHASE + 1))
def test_a_phase_imports_nothing_built_later(import_failures, phase):
    failures = import_failures[phase]
    assert not failures, (f"Phase {phase}'s tests import a later phase's module (import it where the feature is "
                          f"used, or correct its phase in docs/modules.md):\n" + "\n".join(failures))


def test_every_module_has_a_phase():
    phases = module_phases()
    modules = sorted(str(p.relative_to(ROOT).with_suffix("")).replace("/", ".")
                     for p in (ROOT / "tinyvllm").rglob("*.py") if p.name != "__init__.py")
    missing = [m for m in modules if m not in phases]
    assert not missing, f"{MODULE_MAP.name} gives no phase for: {missing}"
    assert phases["tinyvllm.core.scheduler"] == 3 and phases["tinyvllm.spec_decode"] == 7  # 7b counts as 7


def test_the_hook_hides_later_phases_only():
    hook = HideLaterPhases(3, {"tinyvllm.core.scheduler": 3, "tinyvllm.engine.beam_search": 7})
    assert hook.find_spec("tinyvllm.core.scheduler") is None  # not hidden: the next finder finds it
    assert hook.find_spec("numpy") is None
    with pytest.raises(ModuleNotFoundError, match="Phase 7"):
        hook.find_spec("tinyvllm.engine.beam_search")
