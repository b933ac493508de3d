"""Which phase each test file belongs to: `pytest -m phase3` runs Phase 3's tests, `make test-phase P=3` Phases 1-3.

The roadmap promises each phase tests of its own that pass without the later phases; this table is where a test
file says which phase it tests, by the file's name: the test files live in folders that mirror the package
(tests/core/ holds the tests of tinyvllm/core/, tests/ itself those of the top-level modules and the checks that
span the repository), and a name is unique across the folders (`paths_of_test_files`). `conftest.py` turns the
table into the markers `phase1` ... `phase10` (sub-phases such as 7b and 7c count as 7), and `tests/test_phases.py`
checks that every test file is listed here. A tutorial's own test (`test_docs.py::test_phase_doc_code_runs[03-...]`)
takes the phase of its chapter. A test of a later phase's feature inside an earlier file carries that phase's marker
too (`pytest.param("int8", marks=pytest.mark.phase7)`), and `make test-phase P=k` leaves out every test marked with
a phase after k.
"""

from __future__ import annotations

import importlib.abc
import re
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def folders_of_tests() -> list[Path]:
    """tests/ and its folders of tests (tests/core/, tests/engine/, ...): the helpers here and the test files that
    other tests import (`from test_engine import engine`) are imported by plain name from any of them."""
    return [TESTS, *sorted(p for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))]


def paths_of_test_files() -> dict[str, Path]:
    """Every test file by its name: `test_scheduler` -> tests/core/test_scheduler.py. A name used twice raises."""
    files: dict[str, Path] = {}
    for folder in folders_of_tests():
        for path in sorted(folder.glob("test_*.py")):
            if path.stem in files:
                raise ValueError(f"two test files named {path.name}: {files[path.stem]} and {path} (the phase table, "
                                 f"the markers and the imports between test files go by the name alone)")
            files[path.stem] = path
    return files


PHASE_OF_TEST_FILE: dict[str, int] = {
    # Phase 1: foundation (model, weights, tokenizers, chat templates, sampling, contiguous cache, main.py)
    "test_model_tiny": 1, "test_weights": 1, "test_rope": 1, "test_contiguous": 1, "test_generate_loop": 1,
    "test_convert": 1,
    "test_tokenizer": 1, "test_sentencepiece_tokenizer": 1, "test_chat_template": 1, "test_sampling": 1, "test_stop": 1,
    "test_docs": 1, "test_phases": 1,
    "test_phase_isolation": 1, "test_layering": 1, "test_no_timings_in_comments": 1,
    "test_prose_share": 1, "test_phase_lines": 1, "test_module_coverage": 1,
    "test_course": 1,  # the build-it track's graders fail on its stubs and pass on the project (each phase's tasks)
    # Phase 2: paged attention
    "test_sequence": 2, "test_block_manager": 2, "test_paged_attention": 2, "test_paged_runner": 2,
    # Phase 3: continuous batching
    "test_scheduler": 3, "test_engine": 3, "test_engine_isolation": 3, "test_engine_size": 3, "test_paged_engine": 3,
    "test_engine_parts": 3, "test_config_and_runtime": 3, "test_sampling_batch": 3,

    "test_generate": 3,  # Generator and main.py (Phase 1's entry points) run on the Phase 3 engine
    "test_figures": 3,  # docs/images' figures: the scheduler's and the runner's own output (tp-split's drawing: 8)
    # Phase 4: batched forward, device sampling
    "test_device_sampler": 4, "test_kernels_sampler_gpu": 5,
    # Phase 5: custom kernels
    "test_linear": 5, "test_activation": 5, "test_wheel": 5, "test_tinygrad_ext": 5,
    "test_trace_reuse": 5,  # the layers share one trace inside a graph captured on its first call (the CPU graph)
    "test_programs_and_jit": 5,
    "test_compiling": 5,  # the hand-written kernels' header parsed once, compiled ahead on workers that stay
    "test_kernels_paged_attention": 5, "test_sliding_window": 5,
    # Phase 5b: the discrete GPU's path, forced on the CPU
    "test_device_path": 5, "test_bench_gpu": 5,
    # Phase 6: quantized weights, perplexity, cold start
    "test_qlinear": 6, "test_repack": 6, "test_qlinear_gpu": 6, "test_quantize": 6, "test_quantizer": 6,
    "test_gguf_writer": 6,
    "test_quantized_weights": 6,
    "test_perplexity": 6, "test_cold_start": 6, "test_cpu_graph": 6, "test_bench_peers": 6,
    "test_bench_scale": 6,
    # Phase 7: prefix caching, copy-on-write, beam search (7a), speculative decoding (7b), KV-cache quantization (7c)
    "test_block_manager_caching": 7, "test_prefix_cache_sharing": 7,
    "test_beam_search": 7, "test_spec_decode": 7, "test_spec_decode_draft": 7, "test_rejection_sampler": 7,
    "test_speculator": 7,
    "test_kv_cache_quantization": 7,
    "test_admission_width": 7, "test_architectures": 7,
    # Phase 8: several devices, replicas
    "test_tensor_parallel": 8, "test_pipeline_parallel": 8, "test_serve_ray": 8,
    # Phase 9: the OpenAI server
    "test_api_transport": 9, "test_cli": 9, "test_spec_decode_serve": 9,
    "test_async_llm_engine": 9, "test_api_server": 9, "test_api_errors": 9, "test_api_fuzz": 9,
    "test_api_isolation": 9, "test_api_keys": 9, "test_api_limits": 9, "test_api_real_engine": 9,
    "test_api_structured": 9, "test_api_tools": 9, "test_api_reasoning": 9, "test_structured_outputs": 9,
    "test_dashboard": 9,
    "test_reliability": 9, "test_api_endpoints": 9, "test_api_embeddings": 9, "test_api_responses": 9,
    "test_api_device_path": 9, "test_api_parts": 9, "test_api_fields": 9, "test_hidden_states": 9,
    "test_doc_commands": 9, "test_api_metrics": 9, "test_api_start": 9,
    # Phase 10: images in, text out
    "test_vision": 10, "test_image_processor": 10, "test_multimodal_engine": 10, "test_api_images": 10,
    "test_multimodal_chat": 10, "test_mmproj": 10, "test_llava": 10, "test_llava_engine": 10,
    "test_gemma3_vision": 10, "test_gemma3_engine": 10,
}


# an appendix whose code runs a later phase's modules: its test (test_docs.py) takes that phase; a chapter's blocks
# all run at its own phase
CHAPTER_CODE_PHASE: dict[str, int] = {
    "01-appendix-tinygrad-speed.md": 5,  # its CPU graph block replays through Phase 5's graph runner
    "01-appendix-tinygrad-internals.md": 5,  # its block reads the table of internals, Phase 5's
    "02-appendix-sharing-blocks.md": 3,  # its blocks are shared through the prefix cache's hashes
}


def phase_of_chapter_test(doc_name: str) -> int | None:
    """The phase of a chapter's code-block test: its chapter's, unless its code needs a later phase's modules."""
    return CHAPTER_CODE_PHASE.get(doc_name, phase_of_chapter(doc_name))


def phase_of_chapter(doc_name: str) -> int | None:
    """`03-continuous-batching.md` -> 3, `07b-speculative-decoding.md` -> 7; None for a name without a number."""
    digits = ""
    for ch in doc_name:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None


# ---- which phase built each module: docs/modules.md's `phase` column is the source of truth ----

ROOT = Path(__file__).resolve().parent.parent
MODULE_MAP = ROOT / "docs" / "modules.md"
_ROW = re.compile(r"^\|\s*`(tinyvllm/[\w/]+\.py)`\s*\|\s*(\d+)[a-z]?\b")  # | `tinyvllm/x/y.py` | 7b | ...


def module_phases(module_map: Path = MODULE_MAP) -> dict[str, int]:
    """`tinyvllm.core.scheduler` -> 3, read from docs/modules.md's tables (a sub-phase counts as its phase: 7b -> 7;
    a row such as `2, 7c` names the phase that added the module first). A package takes its earliest module's phase
    unless its `__init__.py` has a row of its own."""
    phases: dict[str, int] = {}
    listed: set[str] = set()  # the paths with a row
    for line in module_map.read_text(encoding="utf-8").splitlines():
        if m := _ROW.match(line):
            path, phase = m.group(1), int(m.group(2))
            listed.add(path)
            phases[path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")] = phase
    for name, phase in list(phases.items()):  # a package without a row of its own: its earliest module's phase
        parts = name.split(".")
        for i in range(2, len(parts)):
            package = ".".join(parts[:i])
            if f"{package.replace('.', '/')}/__init__.py" not in listed:
                phases[package] = min(phase, phases.get(package, phase))
    return phases


class HideLaterPhases(importlib.abc.MetaPathFinder):
    """An import hook that makes the modules of phases after `phase` unimportable, as if not built yet: Phase k's
    tests run against Phases 1..k alone. Installed by `hide_after_phase`; TINYVLLM_HIDE_AFTER_PHASE=k in the
    environment installs it for a test run (tests/conftest.py, `make test-phase P=k`)."""

    def __init__(self, phase: int, phases: dict[str, int]):
        self.phases = phases
        self.hide_after(phase)

    def hide_after(self, phase: int) -> None:
        self.phase = phase
        self.hidden = {name: p for name, p in self.phases.items() if p > phase}

    def find_spec(self, name: str, path=None, target=None):
        if name in self.hidden:
            raise ModuleNotFoundError(f"{name} belongs to Phase {self.hidden[name]} (docs/modules.md), hidden while "
                                      f"testing Phases 1-{self.phase} (TINYVLLM_HIDE_AFTER_PHASE={self.phase})",
                                      name=name)
        return None  # not ours to decide: the next finder looks


def hide_after_phase(phase: int) -> HideLaterPhases:
    """Install the hook for `phase` (first on sys.meta_path) and return it."""
    finder = HideLaterPhases(phase, module_phases())
    sys.meta_path.insert(0, finder)
    return finder
