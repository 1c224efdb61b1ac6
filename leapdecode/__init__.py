"""leapdecode: fast, lossless LLM decoding in plain PyTorch."""

from leapdecode.threads import set_wait_defaults

set_wait_defaults()  # before torch is imported below: the OpenMP runtime reads how to wait when it loads

from leapdecode.llm import LLM  # noqa: E402
from leapdecode.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from leapdecode.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
__version__ = "0.1.0"
