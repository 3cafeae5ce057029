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
    # Several hosts (vLLM's --nnodes / --master-addr / --master-port): the ranks are spread evenly over
    # `nnodes` nodes, node 0 (this one) holding ranks 0..N/nnodes-1; rank 0 hosts the rendezvous store at
    # master_addr:master_port (0: a free port, one node only), which the other nodes' `moelora serve
    # --headless` join (docs/parallel.md).
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.step_timeout_s <= 0:
            raise ConfigError(f"parallel step timeout must be positive, got {self.step_timeout_s}")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ConfigError(f"nnodes={self.nnodes} must be >= 1 and divide tensor_parallel_size="
                              f"{self.tensor_parallel_size} (the ranks are spread evenly over the nodes)")
        if not 0 <= self.master_port <= 65535 or (self.nnodes > 1 and self.master_port == 0):
            raise ConfigError(f"master_port={self.master_port}: several nodes need a fixed TCP port (1..65535) "
                              "that every node can reach on master_addr")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def distributed(self) -> bool:
        """Whether the engine runs on several ranks (a process group), even of size 1 when asked for."""
        return self.tensor_parallel_size > 1
