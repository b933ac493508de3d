"""Every test file belongs to a phase (tests/phases.py), so `make test-phase P=k` runs all of Phases 1-k."""

from __future__ import annotations

from pathlib import Path

from phases import (CHAPTER_CODE_PHASE, PHASE_OF_TEST_FILE, folders_of_tests, paths_of_test_files, phase_of_chapter,
                    phase_of_chapter_test)

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def test_every_test_file_has_a_phase():
    files = sorted(paths_of_test_files())  # raises where two folders hold a test file of the same name
    missing = [f for f in files if f not in PHASE_OF_TEST_FILE]
    assert not missing, f"add these test files to PHASE_OF_TEST_FILE in tests/phases.py: {missing}"
    stale = sorted(set(PHASE_OF_TEST_FILE) - set(files))
    assert not stale, f"tests/phases.py lists files that do not exist: {stale}"
    assert all(1 <= p <= 10 for p in PHASE_OF_TEST_FILE.values())


def test_phase_of_chapter():
    assert phase_of_chapter("03-continuous-batching.md") == 3
    assert phase_of_chapter("07b-speculative-decoding.md") == 7
    assert phase_of_chapter("glossary.md") is None


def test_chapters_whose_code_runs_later_exist():
    docs = Path(__file__).resolve().parent.parent / "docs" / "phases"
    for name, phase in CHAPTER_CODE_PHASE.items():
        assert (docs / name).exists(), f"CHAPTER_CODE_PHASE names {name}, which docs/phases/ lacks"
        assert phase > phase_of_chapter(name)
        assert "-appendix-" in name, f"{name} is a chapter: its every block runs at its own phase (make test-phase)"
    assert phase_of_chapter_test("03-continuous-batching.md") == 3


def test_the_folders_mirror_the_package():
    """tests/<folder>/ holds the tests of tinyvllm/<folder>/: a folder of tests names a package, and every test file
    sits in tests/ itself or one such folder (a test file nested deeper would be missed by the phase table)."""
    packages = {p.parent.name for p in (ROOT / "tinyvllm").glob("*/__init__.py")}
    folders = {folder.name for folder in folders_of_tests()[1:]}
    assert folders <= packages, f"tests/ has folders that are no package of tinyvllm/: {sorted(folders - packages)}"
    nested = sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
                    if p.parent not in folders_of_tests() and "__pycache__" not in p.parts)
    assert not nested, f"test files outside tests/ and its package folders: {nested}"
    assert not sorted(TESTS.rglob("__init__.py")), "tests/ has no packages: a test file is imported by its name alone"
