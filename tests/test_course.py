"""The build-it track (course/, tinyvllm/course.py) can fail and can pass: every untouched stub fails its task, the
project's own code passes every task, and so does a course folder whose files hand the project's functions back
(which proves the learner's function is the one the graders and the engine run). With that folder, `main.py
--course` generates the same greedy text as without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinyvllm.course import TASKS, Task

ROOT = Path(__file__).resolve().parent.parent
PHASES = sorted({task.phase for task in TASKS})


def write_reference_course(folder: Path) -> Path:
    """A course folder whose every function is the project's own (a method through its class)."""
    files: dict[str, list[str]] = {}
    for task in TASKS:
        module, _, attr = task.target.partition(":")
        owner, _, method = attr.rpartition(".")
        lines = files.setdefault(task.file, [])
        if owner:
            lines.append(f"from {module} import {owner}\n{task.function} = {owner}.{method}\n")
        else:
            lines.append(f"from {module} import {attr} as {task.function}\n")
    for name, lines in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("".join(lines))
    return folder


def check(phase: int, *flags: str) -> dict:
    env = {**os.environ}
    env.pop("TINYVLLM_HIDE_AFTER_PHASE", None)
    out = subprocess.run([sys.executable, "-m", "tinyvllm.course", "check", str(phase), "--json", *flags],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def tasks_of(phase: int) -> list[Task]:
    return [task for task in TASKS if task.phase == phase]


def test_every_phase_with_tasks_has_at_least_two():
    for phase in PHASES:
        assert len(tasks_of(phase)) >= 2, f"Phase {phase} has {len(tasks_of(phase))} task(s)"


@pytest.mark.parametrize("phase", PHASES)
def test_untouched_stubs_fail_every_task(phase):
    results = check(phase)
    assert sorted(results) == sorted(task.name for task in tasks_of(phase))
    for name, result in results.items():
        assert not result["passed"], f"the stub of {name} passes its grader: the grader cannot fail"
        assert "NotImplementedError" in result["message"], f"{name}: {result['message']}"


@pytest.mark.parametrize("phase", PHASES)
def test_the_project_passes_every_task(phase):
    results = check(phase, "--solution")
    failed = {name: r["message"] for name, r in results.items() if not r["passed"]}
    assert not failed, f"the reference fails its own graders: {failed}"


@pytest.mark.parametrize("phase", PHASES)
def test_the_project_through_the_course_folder_passes_every_task(tmp_path, phase):
    results = check(phase, "--course", str(write_reference_course(tmp_path / "course")))
    failed = {name: r["message"] for name, r in results.items() if not r["passed"]}
    assert not failed, f"the project's functions, installed as a learner's, fail: {failed}"


def test_stubs_are_recognised_as_unwritten(tmp_path):
    from tinyvllm.course import course_dir, is_written

    assert not any(is_written(task, course_dir(ROOT / "course")) for task in TASKS)
    folder = write_reference_course(tmp_path / "course")
    assert all(is_written(task, folder) for task in TASKS)


@pytest.mark.slow
def test_main_with_the_course_generates_the_same_greedy_text(tiny_model_dir, tmp_path):
    folder = write_reference_course(tmp_path / "course")
    argv = [sys.executable, "main.py", "--model", str(tiny_model_dir), "--prompt", "The capital of France is",
            "--max-tokens", "8", "--temperature", "0", "--max-model-len", "128"]
    plain = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    course = subprocess.run(argv + ["--course", str(folder)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and course.returncode == 0, plain.stderr[-2000:] + course.stderr[-2000:]
    assert f"[course] {len(TASKS)} of your functions run in the engine" in course.stderr, course.stderr[-2000:]
    assert course.stdout == plain.stdout
