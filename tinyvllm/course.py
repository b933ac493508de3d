"""The build-it track (course/README.md): a learner writes a function of the engine, and the engine runs it.

`install` puts the learner's functions in place of the project's wherever they are bound; `uninstall` puts them back.

    python -m tinyvllm.course check 2              Phase 2's graders against course/phase2/*.py
    python -m tinyvllm.course check 2 --solution   ... against the project's own code, the reference
    python main.py --course course --prompt ...    the engine on the functions you have written
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import itertools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
COURSE_DIR = ROOT / "course"


@dataclass(frozen=True)
class Task:
    """One function to write: `target` ("module:function" or "module:Class.method") written as `file`'s `function`."""

    phase: int
    name: str
    target: str
    file: str
    function: str
    lines: int
    what: str


TASKS: tuple[Task, ...] = (
    Task(1, "rms_norm", "tinyvllm.model.llama:rms_norm", "phase1/rms_norm.py", "rms_norm", 3,
         "RMSNorm: x / sqrt(mean(x^2) + eps) * weight"),
    Task(1, "apply_rope", "tinyvllm.model.rope:apply_rope", "phase1/rope.py", "apply_rope", 3,
         "rotary position embeddings, rotate_half pairs"),
    Task(1, "grouped_query_attention", "tinyvllm.attention.contiguous:grouped_query_attention",
         "phase1/attention.py", "grouped_query_attention", 10, "scaled dot-product attention with GQA heads"),
    Task(2, "slot_mapping", "tinyvllm.core.block_manager:slot_mapping", "phase2/slot_mapping.py", "slot_mapping", 1,
         "each position's cache slot through the block table"),
    Task(2, "append_slots", "tinyvllm.core.block_manager:BlockManager.append_slots", "phase2/block_manager.py",
         "append_slots", 6, "grow a running sequence's block table"),
    Task(2, "free", "tinyvllm.core.block_manager:BlockManager.free", "phase2/block_manager.py", "free", 7,
         "drop a sequence's references, free blocks to the queue"),
    Task(2, "paged_attention", "tinyvllm.attention.paged:paged_attention", "phase2/paged_attention.py",
         "paged_attention", 10, "gather K/V through block tables, mask the future"),
    Task(3, "admit_waiting", "tinyvllm.core.scheduler:Scheduler._admit_waiting", "phase3/scheduler.py",
         "admit_waiting", 11, "the token budget, max_num_seqs and chunked prefill"),
    Task(3, "preempt", "tinyvllm.core.scheduler:Scheduler._preempt", "phase3/scheduler.py", "preempt", 6,
         "preemption by recompute"),
    Task(3, "check_stop", "tinyvllm.core.scheduler:Scheduler._check_stop", "phase3/scheduler.py", "check_stop", 11,
         "EOS, stop_token_ids, min_tokens, max_tokens, max_model_len"),
    Task(4, "buckets_up_to", "tinyvllm.worker.model_runner:buckets_up_to", "phase4/buckets.py", "buckets_up_to", 5,
         "the token buckets a step is padded to, one captured graph each"),
    Task(4, "apply_top_k", "tinyvllm.sample.device_sampler:apply_top_k", "phase4/filters.py", "apply_top_k", 7,
         "top-k on the device, each row its own k, by bisection"),
    Task(4, "apply_top_p", "tinyvllm.sample.device_sampler:apply_top_p", "phase4/filters.py", "apply_top_p", 7,
         "top-p on the device, each row its own p, by bisection"),
    Task(5, "gpu_attention_launches", "tinyvllm.attention.kernel_backend:gpu_attention_launches",
         "phase5/launches.py", "gpu_attention_launches", 6, "one attention launch, or flash-decoding's split + reduce"),
    Task(5, "inline_includes", "tinyvllm.kernels.launcher:_inline_includes", "phase5/kernel_source.py",
         "inline_includes", 6, "a kernel's own headers pasted into its source, each once"),
    Task(6, "dequantize_q8_0", "tinyvllm.model.quant:dequantize_q8_0", "phase6/dequantize.py", "dequantize_q8_0", 2,
         "Q8_0 blocks to float32: x = d * q"),
    Task(6, "dequantize_q4_1", "tinyvllm.model.quant:dequantize_q4_1", "phase6/dequantize.py", "dequantize_q4_1", 3,
         "Q4_1 blocks to float32: nibbles, x = d * q + m"),
    Task(6, "dequantize_q5_0", "tinyvllm.model.quant:dequantize_q5_0", "phase6/dequantize.py", "dequantize_q5_0", 4,
         "Q5_0 blocks to float32: nibbles and fifth bits, x = d * (q - 16)"),
    Task(7, "block_hashes", "tinyvllm.core.prefix_cache:block_hashes", "phase7/prefix_cache.py", "block_hashes", 4,
         "7a: each full block's hash, chained through its parent"),
    Task(7, "accept_greedy", "tinyvllm.spec_decode.verify:accept_greedy", "phase7/speculative.py", "accept_greedy", 5,
         "7b: drafts accepted while they equal the target's argmax, plus one"),
    Task(7, "find_ngram_drafts", "tinyvllm.spec_decode.ngram_proposer:find_ngram_drafts", "phase7/speculative.py",
         "find_ngram_drafts", 11, "7b: prompt lookup, the longest recurring suffix's continuation"),
    Task(7, "quantize_kv", "tinyvllm.attention.kv_quant:quantize", "phase7/kv_quant.py", "quantize", 8,
         "7c: int8 / fp8 codes and a scale per token and head"),
    Task(8, "split_layers", "tinyvllm.distributed.pipeline_parallel:split_layers", "phase8/parallel.py",
         "split_layers", 6, "pipeline parallel: consecutive layers per stage"),
    Task(8, "fused_rows", "tinyvllm.distributed.tensor_parallel:TensorParallel.fused_rows", "phase8/parallel.py",
         "fused_rows", 6, "tensor parallel: a fused weight's rows, each device's [q_i k_i v_i]"),
    Task(8, "route", "tinyvllm.serve.router:PrefixAffinityRouter.choose", "phase8/router.py", "choose", 14,
         "the replica holding the prompt's prefix, the least loaded on a tie"),
    Task(9, "sse", "tinyvllm.api.serving_engine:sse", "phase9/serving.py", "sse", 6,
         "one server-sent event: data: JSON, usage left out when None"),
    Task(9, "last_output", "tinyvllm.api.serving_engine:last_output", "phase9/serving.py", "last_output", 14,
         "the stream joined, raced against the client's disconnect (abort)"),
    Task(10, "expand_prompt", "tinyvllm.engine.multimodal:expand_prompt", "phase10/images.py", "expand_prompt", 5,
         "each image placeholder replaced by its image's text, in order"),
    Task(10, "pixel_shuffle", "tinyvllm.model.vision:VisionTower.pixel_shuffle", "phase10/images.py", "pixel_shuffle",
         5, "each s x s square of patches folded into one row"),
    Task(10, "gather", "tinyvllm.worker.encoder_runner:EncoderRunner.gather", "phase10/images.py", "gather", 11,
         "image rows merged into the step's flattened batch, chunk by chunk"),
)
TASKS_BY_NAME = {task.name: task for task in TASKS}


def course_dir(path: str | Path | None = None) -> Path:
    """The learner's folder: `path`, else TINYVLLM_COURSE, else course/ of this checkout."""
    return Path(path or os.environ.get("TINYVLLM_COURSE") or COURSE_DIR).resolve()


# ---- the learner's functions ----

def load_learner_function(task: Task, folder: Path):
    """The function the learner wrote for `task` in `folder` (its file imported under a name of its own)."""
    path = folder / task.file
    if not path.is_file():
        raise FileNotFoundError(f"{task.name}: {path} does not exist (copy the stub from course/{task.file})")
    name = "tinyvllm_course_" + task.file.removesuffix(".py").replace("/", "_")
    module = sys.modules.get(name)
    if module is None or getattr(module, "__file__", None) != str(path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    fn = getattr(module, task.function, None)
    if not callable(fn):
        raise AttributeError(f"{task.name}: {path} defines no function {task.function}")
    return fn


def is_written(task: Task, folder: Path) -> bool:
    """False while the learner's function is missing or still the stub that raises NotImplementedError."""
    path = folder / task.file
    if not path.is_file():
        return False
    defined = False
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef) and node.name == task.function:
            body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value,
                                                                                      ast.Constant) else node.body
            if len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0]):
                return False
            defined = True
        elif isinstance(node, ast.alias) and (node.asname or node.name) == task.function:
            defined = True
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id == task.function:
            defined = True
    return defined


# ---- putting them in the engine ----

@dataclass
class Installed:
    """What `install` replaced, so that `uninstall` puts the project's functions back."""

    replaced: list[tuple[object, object, object]]  # (module, class or table, attribute or key, the project's value)


def _resolve(target: str) -> tuple[object, str]:
    """"pkg.mod:Class.method" -> (Class, "method"); "pkg.mod:function" -> (the module, "function")."""
    module_name, _, attr_path = target.partition(":")
    owner: object = importlib.import_module(module_name)
    *classes, attr = attr_path.split(".")
    for name in classes:
        owner = getattr(owner, name)
    return owner, attr


def install(tasks: list[Task], folder: str | Path | None = None) -> Installed:
    """Put the learner's function of each task in place of the project's wherever the engine calls it."""
    folder = course_dir(folder)
    replaced: list[tuple[object, object, object]] = []
    if tasks:  # a graph on disk is keyed by the package's source: it would replay the project's code, not the learner's
        os.environ["TINYVLLM_GRAPH_CACHE"] = "0"
        graph_cache = sys.modules.get("tinyvllm.kernels.graph_cache")
        if graph_cache is not None:
            graph_cache.ENABLED = False
    for task in tasks:
        owner, attr = _resolve(task.target)
        original = owner.__dict__[attr]
        learner = load_learner_function(task, folder)
        if isinstance(owner, type):
            replaced.append((owner, attr, original))
            setattr(owner, attr, learner)
            continue
        # a function: its module, every module that bound it by `from ... import`, and any table that holds it
        for module in list(sys.modules.values()):
            if isinstance(module, ModuleType) and module.__name__.split(".")[0] == "tinyvllm":
                for name, value in list(vars(module).items()):
                    if value is original:
                        replaced.append((module, name, original))
                        setattr(module, name, learner)
                    elif type(value) is dict:
                        for key, entry in list(value.items()):
                            swapped = _swapped(entry, original, learner)
                            if swapped is not None:
                                replaced.append((value, key, entry))
                                value[key] = swapped
    return Installed(replaced)


def _swapped(entry: object, original: object, learner: object) -> object | None:
    """A table's entry with `learner` in place of `original`; None when it does not hold `original`."""
    if entry is original:
        return learner
    if type(entry) is tuple and any(item is original for item in entry):
        return tuple(learner if item is original else item for item in entry)
    return None


def uninstall(installed: Installed) -> None:
    for owner, attr, original in reversed(installed.replaced):
        if type(owner) is dict:
            owner[attr] = original
        else:
            setattr(owner, attr, original)
    installed.replaced.clear()


def install_written(folder: str | Path | None = None, up_to_phase: int = 10) -> list[Task]:
    """Install every written task of Phases 1..`up_to_phase`; returns the tasks installed."""
    folder = course_dir(folder)
    tasks = [task for task in TASKS if task.phase <= up_to_phase and is_written(task, folder)]
    install(tasks, folder)
    return tasks


# ---- grading ----

def grade(phase: int, solution: bool = False, folder: str | Path | None = None, quiet: bool = True) -> dict[str, dict]:
    """Run Phase `phase`'s graders in this process: task name -> {"passed": bool, "message": first failure}."""
    import pytest

    os.environ["TINYVLLM_COURSE"] = str(course_dir(folder))
    os.environ["TINYVLLM_COURSE_SOLUTION"] = "1" if solution else "0"
    os.environ.setdefault("TINYVLLM_HIDE_AFTER_PHASE", str(phase))
    grader = ROOT / "course" / "graders" / f"test_phase{phase}.py"
    if not grader.is_file():
        raise ValueError(f"Phase {phase} has no tasks yet ({grader.relative_to(ROOT)} does not exist)")
    collector = _TaskReports()
    args = [str(grader), "-p", "no:cacheprovider", "--rootdir", str(grader.parent)]
    args += ["-q", "--no-header", "-rN", "--tb=no"] if quiet else ["-q"]
    pytest.main(args, plugins=[collector])
    results = {}
    for task in (t for t in TASKS if t.phase == phase):
        entry = collector.outcomes.get(task.name)
        if entry is None:
            results[task.name] = {"passed": False, "message": "no grader test ran for this task"}
        else:
            results[task.name] = {"passed": entry["failed"] == 0 and entry["passed"] > 0, "message": entry["message"],
                                  "tests": entry["passed"] + entry["failed"]}
    return results


class _TaskReports:
    """A pytest plugin: each task's tests passed and failed, and the first failure's message."""

    def __init__(self):
        self.outcomes: dict[str, dict] = {}
        self._task_of: dict[str, str] = {}

    def pytest_collection_modifyitems(self, items):
        for item in items:
            marker = item.get_closest_marker("task")
            self._task_of[item.nodeid] = marker.args[0] if marker else item.name

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and not report.failed:
            return
        entry = self.outcomes.setdefault(self._task_of.get(report.nodeid, report.nodeid),
                                         {"passed": 0, "failed": 0, "message": None})
        if report.failed:
            entry["failed"] += 1
            if entry["message"] is None:
                crash = getattr(report.longrepr, "reprcrash", None)
                entry["message"] = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]
        else:
            entry["passed"] += 1


def report(phase: int, results: dict[str, dict], solution: bool) -> str:
    """The table a learner reads: each task, passed or the first failing assertion."""
    who = "the project's code (the reference)" if solution else "your code"
    lines = [f"Phase {phase}: {who}"]
    for task in (t for t in TASKS if t.phase == phase):
        result = results[task.name]
        mark = "passed" if result["passed"] else "FAILED"
        lines.append(f"  {mark:<6}  {task.name:<24} course/{task.file}")
        if not result["passed"] and result["message"]:
            message = result["message"].strip().splitlines()
            if len(message) > 1:
                message = list(itertools.takewhile(lambda line: not line.startswith("assert "), message)) or message
            lines += [f"            {line}" for line in message[:4]]
    num_passed = sum(r["passed"] for r in results.values())
    lines.append(f"{num_passed} of {len(results)} tasks passed")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description="tinyvllm's build-it track: grade the functions you wrote")
    sub = p.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run one phase's graders")
    check.add_argument("phase", type=int, help="the phase whose tasks to grade")
    check.add_argument("--solution", action="store_true", help="grade the project's own code (the reference)")
    check.add_argument("--course", default=None, help="the learner's folder (default: TINYVLLM_COURSE or course/)")
    check.add_argument("--json", action="store_true", help="print the results as JSON")
    sub.add_parser("tasks", help="list the tasks")
    args = p.parse_args(argv)
    if args.command == "tasks":
        for task in TASKS:
            print(f"{task.phase}  {task.name:<24} course/{task.file:<28} ~{task.lines:>2} lines  {task.what}")
        return 0
    results = grade(args.phase, args.solution, args.course)
    print(json.dumps(results) if args.json else report(args.phase, results, args.solution))
    return 0 if all(r["passed"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
