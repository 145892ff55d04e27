"""Request lifecycle, scheduler, sampler, model runner, engine core and its clients."""
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingError, SamplingParams

__all__ = ["SamplingParams", "SamplingError", "RequestOutput", "CompletionOutput"]
