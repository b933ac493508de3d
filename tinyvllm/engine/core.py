"""The engine core: the scheduler and the model runner, one step at a time (vLLM v1's `EngineCore`, v1/engine/core.py).

    step():  schedule()  ->  execute_model()  ->  update_from_output()  ->  [propose the next step's drafts]
                 |                 |                      |
          who runs, how many   the step's device side:   append the tokens, stop tokens and lengths,
          tokens (budget)      forward, sample, verify    free finished sequences' blocks
                               -> ModelRunnerOutput       -> EngineCoreOutputs
"""

from __future__ import annotations

from tinyvllm.config import EngineConfig
from tinyvllm.core.outputs import EngineCoreOutput, ModelRunnerOutput
from tinyvllm.core.scheduler import Scheduler, SchedulerOutput
from tinyvllm.core.sequence import Sequence, SequenceStatus
from tinyvllm.engine.engine_state import StepLog
from tinyvllm.engine.failures import retry_in_parts
from tinyvllm.model.llama import LlamaForCausalLM
from tinyvllm.model.tokenizer import Tokenizer
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.model_runner import ModelRunner


class EngineCore:
    """Built once from the config and a loaded model: the runner sizes the KV cache, the scheduler gets its blocks."""

    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, tokenizer: Tokenizer,
                 model_name: str = "(the target)"):
        self.model_runner = ModelRunner.from_config(config, model, tokenizer, model_name)
        self.config = config.with_kv_cache(self.model_runner.kv_cache.num_blocks, self.model_runner.max_model_len)
        cc, sc = self.config.cache_config, self.config.scheduler_config
        tower = getattr(model, "vision_tower", None)  # Phase 10
        encoder_cache_size = 0 if tower is None else max(sc.max_num_batched_tokens, tower.max_embeds_per_image)
        whole_images = tower is not None and (sc.disable_chunked_mm_input or tower.is_mm_prefix_lm)
        if whole_images and tower.max_embeds_per_image > sc.max_num_batched_tokens:
            raise ValueError(f"Chunked MM input disabled but max_tokens_per_mm_item ({tower.max_embeds_per_image}) is "
                             f"larger than max_num_batched_tokens ({sc.max_num_batched_tokens}). Please increase "
                             "max_num_batched_tokens.")
        self.scheduler = Scheduler(cc.num_gpu_blocks, cc.block_size, self.config.max_model_len, sc.max_num_seqs,
                                   sc.max_num_batched_tokens, eos_token_ids=tokenizer.stop_token_ids,
                                   policy=sc.policy, enable_prefix_caching=cc.enable_prefix_caching,
                                   encoder_cache_size=encoder_cache_size, disable_chunked_mm_input=whole_images)
        self.step_log = StepLog()  # the last steps' records, for the dashboard

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    priority: int = 0, arrival_time: float | None = None, pooling_params: object | None = None,
                    grammar: object | None = None, mm_features: list = ()) -> None:
        """Queue a request already checked by the input processor (engine/input_processor.py)."""
        self.scheduler.add_seq(Sequence(request_id, prompt_token_ids, params, arrival_time, priority=priority,
                                        pooling_params=pooling_params, grammar=grammar, mm_features=mm_features))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish these requests now and free their blocks (a client left, or a stop string was found)."""
        self.scheduler.finish_requests(request_ids, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def step(self) -> list[EngineCoreOutput]:
        runner = self.model_runner
        runner.lap(None)
        scheduler_output = self.scheduler.schedule()
        runner.lap("schedule")
        begun = self.step_log.begin(scheduler_output)
        model_output = self.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if runner.speculator is not None:  # the next step's drafts (vLLM v1's update_draft_token_ids)
            self.scheduler.update_draft_token_ids(runner.propose_draft_token_ids(list(self.scheduler.running)))
        runner.lap("bookkeeping")
        self.step_log.end(begun, sum(1 for out in outputs if out.new_token_ids))
        return outputs

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The runner's step; a step that fails as a whole is retried in parts, so only its cause ends."""
        try:
            return self.model_runner.execute_model(scheduler_output)
        except Exception as e:  # the forward pass, or the batch's sampling
            return retry_in_parts(scheduler_output, e, self.model_runner.execute_model)
