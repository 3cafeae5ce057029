"""`LoRARequest`: vLLM's per-request adapter handle, for offline code written against vLLM
(`from vllm.lora.request import LoRARequest` -> `from moelora.lora.request import LoRARequest`).

`LLM.generate(..., lora_request=LoRARequest("sql", 1, "/adapters/sql"))` serves the request with the adapter
named `lora_name`, registering it from `lora_path` at its first use (a name registered from another path is an
error: a name is one adapter). `lora_int_id` is vLLM's integer identity (positive); moelora names adapters by
`lora_name` and only checks the id.
"""

from __future__ import annotations

from dataclasses import dataclass

from moelora.errors import RequestError


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not self.lora_name or not isinstance(self.lora_name, str):
            raise RequestError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise RequestError(f"lora_int_id must be a positive integer (vLLM's rule), got {self.lora_int_id!r}")
