"""leapdecode: fast, lossless LLM decoding in plain PyTorch."""

from leapdecode.llm import LLM
from leapdecode.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from leapdecode.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
    "RequestMetrics",
]
__version__ = "0.1.0"
