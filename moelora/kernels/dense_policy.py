"""Which dense LoRA mode a `lora_linear` call takes when its caller names none, and which steps get their
rows grouped by slot for "planned": the shipped picks as one object that callers pass in.

Shape legend: T rows of the call (tokens), N_in / N_out the linear's in / out features.
Host logic only (no tensors, no Triton), so the runners can ask it on any backend; tests inject a subclass.
"""

from __future__ import annotations

from dataclasses import dataclass

PLAN_BLOCK_M = 16  # rows of one slot per block of the row grouping ("planned" reads it block by block)
PLANNED_MAX_ROWS = 1024  # the largest row count "planned" is the default for (not measured above)
# "concat" above this many rows; from PLANNED_MAX_ROWS + 1 on kv_b-like shapes (N_out >= 4 N_in)
CONCAT_MIN_ROWS = 4096


@dataclass(frozen=True)
class DenseLoRAPolicy:
    """The H200 picks: "splitk" for few LoRA rows on wide shapes, "planned" for 17..1024 grouped, "concat" above
    4096 on shapes at least as wide as deep (above 1024 on those 4x as wide), else "split"."""

    def prefers_splitk(self, num_tokens: int, n_in: int, n_out: int, has_lora: bool) -> bool:
        """LoRA rows, T <= 16 on shapes >= 1024 wide; T <= 64 on o-like ones (N_in >= 2 N_out, N_out >= 128)."""
        if not (has_lora and 0 < num_tokens <= 64 and n_in >= 1024):
            return False
        o_like = n_in >= 2 * n_out and n_out >= 128
        return o_like or (num_tokens <= 16 and n_out >= 1024)

    def prefers_planned(self, num_tokens: int, n_in: int, n_out: int) -> bool:
        """17 (129 on shapes deeper than wide) to PLANNED_MAX_ROWS rows on shapes >= 1024 wide."""
        if not (n_in >= 1024 and n_out >= 1024 and self.wants_row_plan(num_tokens)):
            return False
        return n_in <= n_out or num_tokens > 128

    def wants_row_plan(self, num_tokens: int) -> bool:
        """Whether a step of this many rows may take "planned" at some site (the runner then groups them by slot)."""
        return 16 < num_tokens <= PLANNED_MAX_ROWS

    def prefers_concat(self, num_tokens: int, n_in: int, n_out: int, has_lora: bool) -> bool:
        """LoRA rows above CONCAT_MIN_ROWS on shapes at least as wide as deep, above PLANNED_MAX_ROWS (prefill) on
        those at least 4x as wide (DeepSeek's kv_b): concat copies x (T N_in) and W (N_out N_in) to spare split's
        second pass over y (T N_out); W's copy, fixed per call, outweighs it at fewer rows (docs/performance.md)."""
        if not (has_lora and num_tokens > PLANNED_MAX_ROWS and n_out >= n_in):
            return False
        return num_tokens > CONCAT_MIN_ROWS or n_out >= 4 * n_in

    def mode(self, num_tokens: int, n_in: int, n_out: int, has_lora: bool, grouped: bool) -> str:
        """The mode of a call of T rows on an [N_out, N_in] weight; `grouped`: `DenseLoRAArgs.row_plan` given."""
        if self.prefers_splitk(num_tokens, n_in, n_out, has_lora):
            return "splitk"
        if self.prefers_concat(num_tokens, n_in, n_out, has_lora):
            return "concat"
        if has_lora and grouped and self.prefers_planned(num_tokens, n_in, n_out):
            return "planned"
        return "split"


DENSE_LORA_POLICY = DenseLoRAPolicy()
