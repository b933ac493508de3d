"""Which phase each test file belongs to: `pytest -m phase3` runs Phase 3's tests, `make test-phase P=3` Phases 1-3.

The roadmap promises each phase tests of its own that pass without the later phases; this table is where a test
file says which phase it tests. `conftest.py` turns it into the markers `phase1` ... `phase9` (sub-phases such as
7b and 7c count as 7), and `tests/test_phases.py` checks that every test file is listed here. A tutorial's own test
(`test_docs.py::test_phase_doc_code_runs[03-...]`) takes the phase of its chapter.
"""

from __future__ import annotations

PHASE_OF_TEST_FILE: dict[str, int] = {
    # Phase 1: foundation (model, weights, tokenizers, chat templates, sampling, contiguous cache, main.py)
    "test_model_tiny": 1, "test_weights": 1, "test_convert": 1, "test_tokenizer": 1,
    "test_sentencepiece_tokenizer": 1, "test_chat_template": 1, "test_sampling": 1, "test_generate": 1,
    "test_kernels_linear": 1, "test_cpu_graph": 1, "test_docs": 1, "test_wheel": 1, "test_phases": 1,
    # Phase 2: paged attention
    "test_sequence": 2, "test_block_manager": 2, "test_paged_attention": 2,
    # Phase 3: continuous batching
    "test_scheduler": 3, "test_engine": 3, "test_engine_isolation": 3, "test_engine_size": 3,
    # Phase 4: batched forward, device sampling
    "test_device_sampler": 4, "test_kernels_sampler_gpu": 4,
    # Phase 5: custom kernels
    "test_kernels_paged_attention": 5, "test_sliding_window": 5,
    # Phase 5b: the discrete GPU's path, forced on the CPU
    "test_device_path": 5, "test_bench_gpu": 5,
    # Phase 6: quantized weights, perplexity, cold start
    "test_kernels_qlinear": 6, "test_kernels_qlinear_gpu": 6, "test_quantize": 6, "test_quantized_weights": 6,
    "test_perplexity": 6, "test_cold_start": 6, "test_bench_peers": 6,
    # Phase 7: prefix caching, copy-on-write, beam search (7a), speculative decoding (7b), KV-cache quantization (7c)
    "test_block_manager_caching": 7, "test_prefix_cache_sharing": 7, "test_kernels_copy_blocks": 7,
    "test_beam_search": 7, "test_spec_decode": 7, "test_spec_decode_draft": 7, "test_rejection_sampler": 7,
    "test_spec_decode_serve": 7, "test_kv_cache_quantization": 7,
    "test_admission_width": 7, "test_architectures": 7,
    # Phase 8: several devices, replicas
    "test_tensor_parallel": 8, "test_pipeline_parallel": 8, "test_serve_ray": 8,
    # Phase 9: the OpenAI server
    "test_api_transport": 9, "test_cli": 9,
    "test_async_llm_engine": 9, "test_api_server": 9, "test_api_errors": 9, "test_api_fuzz": 9,
    "test_api_isolation": 9, "test_api_keys": 9, "test_api_limits": 9, "test_api_real_engine": 9,
    "test_api_structured": 9, "test_api_tools": 9, "test_structured_outputs": 9, "test_dashboard": 9,
    "test_reliability": 9, "test_api_endpoints": 9, "test_api_embeddings": 9, "test_api_responses": 9, "test_api_device_path": 9,
}


def phase_of_chapter(doc_name: str) -> int | None:
    """`03-continuous-batching.md` -> 3, `07b-speculative-decoding.md` -> 7; None for a name without a number."""
    digits = ""
    for ch in doc_name:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None
