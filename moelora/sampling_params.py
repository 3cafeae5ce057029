"""vLLM's module path for the offline API's sampling classes (`from vllm.sampling_params import
StructuredOutputsParams` becomes `from moelora.sampling_params import ...`)."""

from moelora.engine.request import SamplingParams
from moelora.engine.structured import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]
