"""tinyvllm: an LLM inference engine on tinygrad that teaches how vLLM works by being one."""

from tinyvllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in tinygrad and the model; import it only when asked for
    if name == "LLM":
        from tinyvllm.llm import LLM

        return LLM
    raise AttributeError(f"module 'tinyvllm' has no attribute {name!r}")
