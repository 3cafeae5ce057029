"""moelora: serve many LoRA fine-tunes of one Mixture-of-Experts LLM at once."""

from moelora.engine.request import RequestOutput, SamplingParams
from moelora.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams"]
