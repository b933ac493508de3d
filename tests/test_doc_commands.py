"""Every command in a bash block of the README and the chapters is run by the tests, or checked as far as this machine
can, and the table below says which and why.

    run       runs as written: generation capped at 8 tokens, placeholders (model.gguf, out_dir) made real
    serve     the server starts, the curl commands after it in its block get 200s, the server stops
    collect   a test command (pytest, make test-phase): its tests are collected at its phase, none fails to import
    course    make course: the make line is valid, and the pass counts quoted beside it are the graders' own
    flags     needs what this machine lacks (a GPU, minutes of benchmark): its flags are parsed by its own parser
    not run   installs from the network or starts a cluster: said why, nothing checked

Quoted output under a `main.py` line is checked by tests/test_docs.py::test_quoted_output_is_what_main_prints.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from test_docs import PHASE_DOCS, ROOT, code_blocks

sys.path.insert(0, str(ROOT / "benchmarks"))
from reliability_client import free_port, start_server  # noqa: E402  (benchmarks/reliability_client.py)

DOCS = [ROOT / "README.md", *PHASE_DOCS]
PY = sys.executable
CLI = [PY, "-c", "import sys; from tinyvllm.cli import main; sys.exit(main())"]


@dataclass
class Command:
    where: str  # docs/phases/02-paged-attention.md:406
    text: str  # the command, continuation lines joined, without its comment
    comment: str  # what follows `#` on its line(s)
    block: int  # which block of its document


def commands(docs: list[Path]) -> list[Command]:
    found = []
    for doc in docs:
        blocks = [(line, code) for language, line, code in code_blocks(doc.read_text(encoding="utf-8"))
                  if language == "bash"]
        for number, (line, code) in enumerate(blocks):
            pending, start = "", line
            for i, raw in enumerate(code.splitlines()):
                if not pending and (not raw.strip() or raw.lstrip().startswith("#")):
                    continue  # quoted output, or a comment line continuing the one above
                if not pending:
                    start = line + i
                pending += raw.rstrip().removesuffix("\\") + " " if raw.rstrip().endswith("\\") else raw
                if raw.rstrip().endswith("\\"):
                    continue
                text, _, comment = split_comment(pending)
                found.append(Command(f"{doc.relative_to(ROOT)}:{start}", " ".join(text.split()), comment.strip(),
                                     number))
                pending = ""
    return found


def split_comment(line: str) -> tuple[str, str, str]:
    """`cmd 'a # b'  # note` -> ("cmd 'a # b'", "#", "note"): a `#` outside quotes after a space starts a comment."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), "#", line[i + 1:]
    return line.rstrip(), "", ""


# (pattern, how, why): the first pattern that matches a command decides
RULES = [
    (r"^pip install", "not run", "installs packages from the network"),
    (r"^ray start", "not run", "starts a Ray cluster across machines"),
    (r"tinyvllm\.serve\.ray", "flags", "a Ray Serve deployment of several replicas; tests/serve/test_serve_ray.py "
                                        "runs one"),
    (r"(^| )DEV=(CUDA|METAL)|--device CUDA", "flags", "needs a GPU"),
    (r"^make test$", "flags", "the command that runs this test"),
    (r"^make test-phase", "collect", ""),
    (r"^make course", "course", ""),
    (r"(^|/)pytest|-m pytest", "collect", ""),
    (r"tinyvllm\.api\.server|^tinyvllm serve", "serve", ""),
    (r"^curl ", "curl", ""),
    (r" --(image|mmproj) ", "flags", "needs a vision-language checkpoint, which no machine here downloads; "
                                     "tests/engine/test_multimodal_chat.py runs --image on the tests' tiny one"),
    (r"benchmarks/|^tinyvllm bench", "flags", "a benchmark: minutes of timing, and it must not time a busy machine"),
    (r"^make run|main\.py|^tinyvllm (generate|chat)|tinyvllm\.(convert|quantize|perplexity)|^tinyvllm "
     r"(quantize|perplexity)", "run", ""),
]


def how(command: Command) -> tuple[str, str]:
    for pattern, kind, why in RULES:
        if re.search(pattern, command.text):
            return kind, why
    raise AssertionError(f"{command.where}: no rule says how `{command.text}` is checked: add one to RULES")


COMMANDS = commands(DOCS)


def ids(kind: str) -> list[Command]:
    """The commands checked that way, each text once (the first place it is written stands for the others)."""
    seen, kept = set(), []
    for c in COMMANDS:
        if how(c)[0] == kind and c.text not in seen:
            seen.add(c.text)
            kept.append(c)
    return kept


def test_every_command_has_a_rule():
    assert len(COMMANDS) > 80
    for command in COMMANDS:
        how(command)


def test_the_parser_joins_lines_and_drops_comments():
    doc = "```bash\nmake run   # set up\npython main.py --chat \\\n    --prompt 'a # b'\n# quoted output\n```\n"
    path = ROOT / "tests" / "_commands_probe.md"
    path.write_text(doc)
    try:
        found = commands([path])
    finally:
        path.unlink()
    assert [(c.text, c.comment) for c in found] == [("make run", "set up"),
                                                    ("python main.py --chat --prompt 'a # b'", "")]


# ---- turning a documented command into one this machine runs ----

def argv_of(text: str, tmp: Path, tiny_model_dir: Path) -> tuple[dict[str, str], list[str]]:
    """(environment, argv): `DEV=X python main.py ...` -> ({"DEV": "X"}, [sys.executable, "main.py", ...]), with
    the placeholders made real."""
    from tinyvllm.model.weights import default_model_path

    words = shlex.split(text)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    real = {"model.gguf": str(default_model_path()), "path/to/model.gguf": str(default_model_path()),
            "out_dir": str(tmp / "out_dir"), "out_dir/": str(tmp / "out_dir"), "out.gguf": str(tmp / "out.gguf"),
            "model-q8_0.gguf": str(tmp / "model-q8_0.gguf"), "model-q4_0.gguf": str(tmp / "model-q4_0.gguf"),
            "hf_dir/": str(tiny_model_dir)}
    words = [real.get(w, w) for w in words]
    if words[0] in ("python", ".venv/bin/python"):
        words[0] = PY
    elif words[0] == "tinyvllm":
        words = [*CLI, *words[1:]]
    return env, words


def capped(argv: list[str]) -> list[str]:
    """Generation capped at 8 tokens (a later flag wins), a perplexity at one short chunk."""
    text = " ".join(argv)
    if "tinyvllm.perplexity" in text or "perplexity" in argv:
        return [*argv, "--chunks", "1", "--n-ctx", "64"]
    if "main.py" in text or "generate" in argv or "chat" in argv:
        return [*argv, "--max-tokens", "8"]
    return argv


def make_dry_run(text: str) -> list[str]:
    """The recipe lines `make -n` prints for a documented make command."""
    done = subprocess.run(["make", "-n", "--no-print-directory", *shlex.split(text)[1:]], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"`{text}` is not a valid make command: {done.stderr[-1000:]}"
    return done.stdout.replace("\\\n", " ").splitlines()  # a recipe line continued with a backslash, joined


def run(argv: list[str], env: dict[str, str] | None = None, timeout: int = 600, stdin: str | None = None):
    return subprocess.run(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


# ---- run ----

@pytest.mark.slow
@pytest.mark.parametrize("command", ids("run"), ids=lambda c: c.where)
def test_run(command: Command, tmp_path, tiny_model_dir):
    text = command.text
    if text.startswith("make run"):
        lines = [line for line in make_dry_run(text) if "main.py" in line]
        assert lines, f"{command.where}: `make -n` shows no main.py line for `{text}`"
        text = lines[-1].replace(".venv/bin/python", "python")
    env, argv = argv_of(text, tmp_path, tiny_model_dir)
    if "tinyvllm.quantize" in text or "quantize" in argv[3:4]:
        source = next((a for a in argv if a.endswith(".gguf") or a == str(tiny_model_dir)), None)
        assert source is not None and Path(source).exists(), f"{command.where}: nothing to quantize in {argv}"
    stdin = "Hello\n" if "chat" in argv and "--prompt" not in argv else None
    done = run(capped(argv), env, stdin=stdin)
    assert done.returncode == 0, f"{command.where}: `{command.text}` failed:\n{done.stderr[-3000:]}"


# ---- collect ----

COLLECT = " --collect-only -q -p no:cacheprovider"


def collected(shell_line: str) -> tuple[int, str]:
    """How many tests a pytest command line selects (run by bash: a make recipe's line has $(...) in it)."""
    line = re.sub(r"(^|\s)\.venv/bin/python ", rf"\g<1>{PY} ", shell_line.replace(" -n auto --dist loadfile", ""))
    done = subprocess.run(["bash", "-c", line + COLLECT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = done.stdout.splitlines()
    count = sum(int(m.group(1)) for m in map(re.compile(r"^\S+\.py: (\d+)$").match, lines) if m)
    count += sum(1 for line in lines if "::" in line)
    return (count if done.returncode == 0 else 0), done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("command", ids("collect"), ids=lambda c: c.where)
def test_collect(command: Command, tmp_path, tiny_model_dir):
    if command.text.startswith("make"):
        recipe = [line for line in make_dry_run(command.text) if "pytest" in line]
        assert recipe, f"{command.where}: `make -n` shows no pytest line"
        line = recipe[-1]
    else:
        line = re.sub(r"^(\.venv/bin/)?pytest ", f"{PY} -m pytest ", command.text)
        line = re.sub(r"^python ", f"{PY} ", line)
    count, output = collected(line)
    assert count > 0, f"{command.where}: `{command.text}` collects no test:\n{output}"


# ---- course ----

@pytest.mark.parametrize("command", ids("course"), ids=lambda c: c.where)
def test_course_counts(command: Command):
    from tinyvllm.course import TASKS

    assert any("tinyvllm.course check" in line for line in make_dry_run(command.text))
    phase = int(re.search(r"P=(\d+)", command.text).group(1))
    tasks = [task for task in TASKS if task.phase == phase]
    quoted = re.search(r"(\d+) of (\d+) tasks passed(?: \((\d+) tests\))?", command.comment)
    if quoted is None:
        return  # the comment quotes no count
    passed, total, tests = quoted.groups()
    assert int(total) == len(tasks), f"{command.where} says {total} tasks; Phase {phase} has {len(tasks)}"
    assert int(passed) == (len(tasks) if "SOLUTION=1" in command.text else 0), command.where
    if tests is not None:
        grader = ROOT / "course" / "graders" / f"test_phase{phase}.py"
        count, output = collected(f"{PY} -m pytest {grader}")
        assert int(tests) == count, f"{command.where} says {tests} tests; {grader.name} has {count}"


# ---- serve, with the curl commands after it ----

def served_blocks() -> list[tuple[Command, list[Command]]]:
    """Each server command that curl commands follow in its block, with them."""
    pairs = []
    for i, command in enumerate(COMMANDS):
        if how(command)[0] != "serve":
            continue
        follow = []
        for later in COMMANDS[i + 1:]:
            if later.where.split(":")[0] != command.where.split(":")[0] or later.block != command.block:
                break
            if how(later)[0] == "curl":
                follow.append(later)
        pairs.append((command, follow))
    return pairs


SERVED = served_blocks()


def test_every_curl_follows_a_server():
    followed = {c.text for _, follow in SERVED for c in follow}
    assert {c.text for c in ids("curl")} == followed


@pytest.mark.slow
@pytest.mark.parametrize("command, follow", [p for p in SERVED if p[1]], ids=lambda x: getattr(x, "where", ""))
def test_serve_and_curl(command: Command, follow: list[Command], tmp_path, tiny_model_dir):
    port = free_port()
    env, argv = argv_of(command.text, tmp_path, tiny_model_dir)
    if "--port" in argv:  # the documented port may be taken: a free one instead
        del argv[argv.index("--port"):argv.index("--port") + 2]
    server = start_server([*argv, "--port", str(port)], port, timeout=300, env={**os.environ, **env})
    try:
        for curl in follow:
            line = curl.text.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace("curl ", "curl -fsS ", 1)
            done = subprocess.run(["bash", "-o", "pipefail", "-c", line], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0 and done.stdout.strip(), f"{curl.where}: `{curl.text}` failed: {done.stderr}"
            if "| grep" not in line:
                json.loads(done.stdout)  # a JSON answer
    finally:
        server.terminate()
        server.wait(timeout=60)


# ---- flags: the command's own parser accepts them ----

def parse_flags(argv: list[str], env: dict[str, str]) -> None:
    """Parse `argv` with the parser of the program it runs; SystemExit (argparse's error) fails the test."""
    text = " ".join(argv)
    if "benchmarks/" in text or argv[len(CLI):len(CLI) + 1] == ["bench"]:
        done = run(argv, {**env, "TINYVLLM_CHECK_FLAGS": "1", "DEV": "CPU"}, timeout=120)
        assert done.returncode == 0 and "flags accepted" in done.stdout, done.stderr[-2000:]
        return
    rest = argv[argv.index(next(a for a in argv if a.endswith(("server", "ray", "main.py")) or a == "serve")) + 1:]
    if "tinyvllm.serve.ray" not in text and ("tinyvllm.api.server" in text or "serve" in argv):
        from tinyvllm.api.server import build_parser
        from tinyvllm.cli import _model_first
        from tinyvllm.engine.arg_utils import EngineArgs

        args = build_parser().parse_args(_model_first(rest))
        EngineArgs.from_cli_args(args).create_engine_config()
    elif "tinyvllm.serve.ray" in text:
        from tinyvllm.api.server import build_parser
        from tinyvllm.serve.ray import build_parser as ray_parser
        from tinyvllm.serve.ray import split_argv

        ours, server = split_argv(rest)
        ray_parser().parse_args(ours)
        build_parser().parse_args(server)
    elif "main.py" in text:
        from tinyvllm.cli import build_generate_parser

        build_generate_parser().parse_args(rest)
    else:
        raise AssertionError(f"no parser known for {argv}")


# a server command with no curl after it: its flags (test_serve_and_curl starts the server)
FLAGS = ids("flags") + [command for command, follow in SERVED if not follow]


@pytest.mark.parametrize("command", FLAGS, ids=lambda c: c.where)
def test_flags(command: Command, tmp_path, tiny_model_dir):
    kind, why = how(command)
    assert why or kind == "serve", f"{command.where}: a command only checked by its flags says why"
    if command.text == "make test":
        assert any("pytest" in line for line in make_dry_run(command.text))
        return
    env, argv = argv_of(command.text, tmp_path, tiny_model_dir)
    parse_flags(argv, env)


def test_not_run_says_why():
    for command in ids("not run"):
        assert how(command)[1], command.where
