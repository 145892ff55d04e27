"""Request lifecycle, scheduler, sampler, model runner, engine core and its clients."""
from engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.engine_args import EngineArgs
from engine.errors import EngineDeadError, InvalidRequest
from engine.lora import LoRARequest
from engine.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from engine.pooling_params import PoolingError, PoolingParams
from engine.sampling_params import SamplingError, SamplingParams


def __getattr__(name):
    # LLM and AsyncLLM pull in torch and the model zoo: import them lazily so
    # that light users (the protocol layer, tests of it) stay light.
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from engine.async_llm import AsyncLLM
        return AsyncLLM
    raise AttributeError(name)


__all__ = ["LLM", "AsyncLLM", "EngineArgs", "SamplingParams", "SamplingError", "RequestOutput",
           "CompletionOutput", "InvalidRequest", "EngineDeadError", "PoolingParams", "PoolingError",
           "EmbeddingRequestOutput", "LoRARequest", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"]
