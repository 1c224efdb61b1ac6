"""leapdecode: fast, lossless LLM decoding in plain PyTorch."""

from leapdecode.llm import LLM
from leapdecode.outputs import CompletionOutput, RequestMetrics, RequestOutput
from leapdecode.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
__version__ = "0.1.0"
