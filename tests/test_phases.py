"""Every test file belongs to a phase (tests/phases.py), so `make test-phase P=k` runs all of Phases 1-k."""

from __future__ import annotations

from pathlib import Path

from phases import CHAPTER_CODE_PHASE, PHASE_OF_TEST_FILE, phase_of_chapter, phase_of_chapter_test

TESTS = Path(__file__).resolve().parent


def test_every_test_file_has_a_phase():
    files = sorted(p.stem for p in TESTS.glob("test_*.py"))
    missing = [f for f in files if f not in PHASE_OF_TEST_FILE]
    assert not missing, f"add these test files to PHASE_OF_TEST_FILE in tests/phases.py: {missing}"
    stale = sorted(set(PHASE_OF_TEST_FILE) - set(files))
    assert not stale, f"tests/phases.py lists files that do not exist: {stale}"
    assert all(1 <= p <= 9 for p in PHASE_OF_TEST_FILE.values())


def test_phase_of_chapter():
    assert phase_of_chapter("03-continuous-batching.md") == 3
    assert phase_of_chapter("07b-speculative-decoding.md") == 7
    assert phase_of_chapter("glossary.md") is None


def test_chapters_whose_code_runs_later_exist():
    docs = Path(__file__).resolve().parent.parent / "docs" / "phases"
    for name, phase in CHAPTER_CODE_PHASE.items():
        assert (docs / name).exists(), f"CHAPTER_CODE_PHASE names {name}, which docs/phases/ lacks"
        assert phase > phase_of_chapter(name)
    assert phase_of_chapter_test("03-continuous-batching.md") == 3
