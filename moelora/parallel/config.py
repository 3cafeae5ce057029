"""`ParallelConfig`: how many ranks, and whether routed experts are split by expert (EP) or inside each
expert (TP). Frozen (contract 8); vLLM's names (`--tensor-parallel-size`, `--enable-expert-parallel`).

Every rank holds 1/N of attention heads, dense-MLP and shared-expert intermediate columns and vocab rows.
Routed experts: `expert_parallel` off, each expert's intermediate dim is split N ways (TP); on, the E experts
are partitioned over the N ranks (EP, vLLM's meaning: the expert-parallel size is the tensor-parallel size).
"""

from __future__ import annotations

from dataclasses import dataclass

from moelora.errors import ConfigError


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    # Seconds a rank waits in a collective (or for a worker's answer) before the engine raises WorkerError:
    # a dead or hung worker never hangs the server. Includes the first step's kernel compilation on CUDA.
    step_timeout_s: float = 300.0

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.step_timeout_s <= 0:
            raise ConfigError(f"parallel step timeout must be positive, got {self.step_timeout_s}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def distributed(self) -> bool:
        """Whether the engine runs on several ranks (a process group), even of size 1 when asked for."""
        return self.tensor_parallel_size > 1
