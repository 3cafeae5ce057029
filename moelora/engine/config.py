"""`EngineConfig`: frozen engine settings (contract 8); `resolve()` fills every derived value.

Memory plan on CUDA (`gpu_memory_utilization` of the card): weights and all adapter slots are
allocated first, a profiling forward at the full token budget measures activations, and only
what is left becomes KV blocks, so loading adapters later can never run out of memory.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from moelora.config import ModelConfig
from moelora.errors import ConfigError
from moelora.kernels.moe_config import check_table_file
from moelora.layers.options import DEFAULT_OPTIONS, LayerOptions
from moelora.quant.config import FP8Config

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The default token budget of a step (`max_num_batched_tokens`): LARGE_GPU_TOKENS on a GPU of at least
# LARGE_GPU_BYTES (H100 / H200 class, vLLM's rule for its API server), else SMALL_GPU_TOKENS (smaller GPUs, the
# CPU). H200, Qwen3-30B-A3B shape: a 2048-token step is bound by the host's launches (38 % of the matmul peak,
# 8 adapters 0.59 of no LoRA), 8192 reaches 61 % (0.82) and prefills 1.36x as fast beside 32 decodes, whose
# inter-token latency while a prompt lasts grows 58 -> 167 ms (docs/performance.md, "Prefill chunk size").
LARGE_GPU_BYTES = 70 * 2**30
LARGE_GPU_TOKENS = 8192
SMALL_GPU_TOKENS = 2048


def default_max_num_batched_tokens(gpu_bytes: int | None) -> int:
    """The default step token budget for a GPU of `gpu_bytes` memory (None: the CPU)."""
    return LARGE_GPU_TOKENS if gpu_bytes is not None and gpu_bytes >= LARGE_GPU_BYTES else SMALL_GPU_TOKENS


@dataclass(frozen=True)
class EngineConfig:
    device: str | None = None  # None/"auto": cuda if available
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's dtype on CUDA
    kernel_backend: str | None = None  # torch | triton; default triton on CUDA
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: `default_max_num_batched_tokens` of the device
    max_model_len: int | None = None  # default: the model's max_position_embeddings (under YaRN, x its factor)
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: from gpu_memory_utilization (CUDA) or a CPU default
    gpu_memory_utilization: float = 0.9
    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None  # default: max(32, max_loras)
    # Modules that carry LoRA, by name as PEFT's target_modules ("q_proj", "experts", "self_attn", ...;
    # moelora.models.lora_targets); None: every site; "auto": the sites of the adapters given at start
    # (`moelora serve --lora-modules`, `LLM(adapters=...)` resolve it). The others hold no slot buffers
    # and launch no LoRA kernels; an adapter with LoRA outside them is refused when it is added.
    lora_target_modules: tuple[str, ...] | str | None = None
    # Skip LoRA at sites where no registered adapter has weights (every slot rank 0 there: the delta
    # is exactly zero): they launch no LoRA kernel. A site turns on when the first adapter with LoRA
    # there is added (decode graphs are then re-captured once: 5.4 s for a 48-layer 30B MoE with 20
    # buckets on the H200, before base_decode_graphs doubled the capture) and stays on. Off switch.
    skip_idle_lora_sites: bool = True
    # Dense LoRA sites (Triton) of steps of 17..1024 rows: the rows grouped by adapter slot once per
    # step, and the sites' delta one program per block of one slot's rows ("planned"), where that
    # measured faster (H200, merged q/k/v at 256 rows, 8 adapters r16: 41.9 -> 23.0 us). Off switch.
    group_lora_rows: bool = True
    # Triton LoRA kernels tile at the width of the adapters at hand, not max_lora_rank: an eager step at
    # its rows' adapters' largest rank (`LoRABatch.max_rank`), the decode graphs at the largest rank of the
    # registered adapters (re-captured, like idle sites, when a wider one is registered: at most twice,
    # 16 -> 32 -> 64 columns). Off: every launch at max_lora_rank.
    lora_width_by_batch: bool = True
    # Decode steps whose rows name no adapter replay a second set of graphs captured without LoRA (no LoRA
    # launch at all, as an eager step with no adapter rows runs), in the same memory pool (each set keeps
    # its own logits: the memory plan leaves them free); captured beside the LoRA graphs whenever some
    # LoRA site is on (twice the capture time). H200, Qwen3-30B shape, a layer of a decode graph on rows
    # of no adapter: the LoRA graphs cost 7-14 % over no LoRA (8 requests 195.4 vs 171.8 us, 64: 349.7
    # vs 326.3, 256: 388.5 vs 358.3). Off switch.
    base_decode_graphs: bool = True
    enable_prefix_caching: bool = True
    structured_any_whitespace: bool = True  # vLLM's disable_any_whitespace off: JSON formats allow any whitespace
    scheduling_policy: str = "fcfs"  # vLLM's: "fcfs", or "priority" (requests' `priority` read: scheduler.py)
    enforce_eager: bool = False  # off switch for CUDA graphs (decode, and the piecewise graphs below)
    # Steps with prompt rows (a prefill chunk, alone or beside decodes) of up to this many tokens replay
    # piecewise CUDA graphs (`engine/piecewise_graphs.py`): each layer's attention eager, everything else
    # captured at token buckets, where such a step otherwise launches every kernel from the host. One device
    # (not under tensor parallelism), with the decode graphs (`enforce_eager` turns both off). 0: off switch.
    # 2048: H200, Qwen3 shape, 1.35-2.9x at steps of 512-2048 tokens, 0.95-0.97x at 4096-8192 (device-bound
    # there; docs/performance.md "Steps with prompt rows").
    piecewise_graph_tokens: int = 2048
    overlap_shared_experts: bool = True  # off switch for the shared expert's second stream
    # LoRA work on a second stream, concurrent with the base GEMM reading the same input (CUDA, Triton):
    # the dense LoRA shrink next to cuBLAS, the routed experts' down delta next to the down GEMM.
    overlap_lora: bool = True
    mla_absorbed_decode: bool = True  # off switch for MLA's absorbed decode (off: expanded path, no graphs)
    # MLA's absorbed decode (Triton, CUDA): the absorb GEMM and its LoRA term on a second stream beside the rope
    # kernel (both read only the projection's output). H200, DeepSeek-V2-Lite shape, no LoRA at one request: 2.66
    # -> 2.57 ms a step (docs/performance.md). Off switch.
    overlap_mla_absorb: bool = True
    merge_qkv: bool = True  # off switch for the merged q/k/v projection (one GEMM, one LoRA pair)
    merge_gate_up: bool = True  # off switch for a dense MLP's (and shared experts') merged gate / up projection
    # Programmatic dependent launch (`kernels/pdl.py`; CUDA, compute capability >= 9.0, Triton kernels): each
    # kernel's launch and start-up overlap the end of the one before it, every kernel waiting for its inputs
    # before its first access (results bit for bit). H200, Qwen3-30B shape, 1-64 requests: FP8 steps 4-5 %
    # shorter with 8 adapters r16, up to 4 % without; bf16 1-4 % (DeepSeek-V2-Lite with 8 adapters 4-7 % at
    # 1-8), but longer without LoRA at one request (+1-4 %) and for DSV2 with 8 adapters at 64 (+4 %)
    # (docs/performance.md). Off switch.
    pdl: bool = True
    # Write adapter slots on a side stream (CUDA) while other requests run; requests of a loading
    # adapter wait for its write (its GPU equivalence and sanitizer tests pass on the H200). The CPU
    # cache (max_cpu_loras adapters) then holds each adapter page-locked, in the slots' dtypes: with
    # large expert adapters, size max_cpu_loras to the host memory you can pin.
    async_adapter_loading: bool = True
    # Overlapped scheduling: launch step n+1 (its input ids gathered on the device from step n's
    # samples) before reading step n back, so the host's scheduling and input building hide behind the
    # device. None: on with CUDA, off on the CPU (nothing to overlap there). A request's token reaches
    # the caller one step after it was sampled, and a row computed for a request that stopped in step
    # n is dropped. H200, Qwen3-30B shape, 48 layers: steps 4-10 % shorter at 1-256 requests, with and
    # without LoRA (docs/performance.md).
    async_scheduling: bool | None = None
    # A tuned fused-MoE config table (a JSON file as benchmarks/tune_fused_moe.py writes, e.g. for this
    # deployment's model and GPU) read instead of the package's table for the GPU; a shape it lacks
    # takes the heuristic default. None: the package's.
    fused_moe_table: str | None = None
    # The server runs `engine/warmup.py` before it reports ready (/health 200): the forwards and sampler
    # paths a request can take, so none compiles a Triton kernel while a client waits. Off: start at once
    # (tests; the first requests then pay the compiles).
    warmup: bool = True
    # FP8 base weights (vLLM's `quantization`): None follows the checkpoint (its quantization_config, or
    # none); "fp8" on a bf16/fp16/fp32 checkpoint quantizes every projection while loading (128 x 128
    # blocks, per expert), on an FP8 checkpoint it names the checkpoint's method ("fp8" or
    # "compressed-tensors", which must agree). kernel_backend "triton" runs the FP8 kernels
    # (`kernels/fp8_moe.py`, `kernels/fp8_linear.py`): compute capability >= 8.9, else a ConfigError.
    quantization: str | None = None
    # vLLM's --hf-overrides: config.json fields replaced when the model is read (e.g. {"rope_scaling": {"rope_type":
    # "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}: Qwen3 past 32k); None: the file as it is
    hf_overrides: dict | None = None
    # W8A8: FP8 GEMMs also round their input activations as the checkpoint's scheme says (dynamic 1 x 128
    # groups per token, or per token for compressed-tensors), LoRA reading them unrounded: the torch twin, and
    # on Triton the e4m3 MMA kernels (which round per 1 x 128 group for either scheme: finer, within the
    # per-token bound). Off: W8A16, activations as they are (Triton: the weights upcast in the kernels).
    # None (default): W8A8 where the FP8 tensor cores run it (kernel_backend "triton" on CUDA), as vLLM and
    # SGLang serve these checkpoints, and faster than W8A16 at every batch size measured on the H200; W8A16
    # on the torch backend, whose dequantized twin is what `moelora verify` and the CPU oracle tests compare.
    fp8_activation_quant: bool | None = None
    # Tensor / expert parallelism (moelora.parallel, docs/parallel.md): ranks (one process per device, rank 0
    # this one), routed experts partitioned over them instead of split inside, and the seconds a rank waits
    # on a dead or hung peer before the engine raises WorkerError.
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    parallel_step_timeout_s: float = 300.0
    # Several hosts (`ParallelConfig`): nodes, and where rank 0 hosts the rendezvous the other nodes join.
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    @property
    def has_lora_slots(self) -> bool:
        return self.max_loras > 0 and self.max_lora_rank > 0

    @property
    def use_cuda_graphs(self) -> bool:
        return self.torch_device.type == "cuda" and self.kernel_backend == "triton" and not self.enforce_eager

    def layer_options(self, base: LayerOptions = DEFAULT_OPTIONS) -> LayerOptions:
        """The options this (resolved) config builds its models' layers with: its kernel backend, fused-MoE
        table, shared-expert and MLA absorb overlap (CUDA only: ignored on the CPU), MLA absorbed decode, merged
        q/k/v, LoRA target modules and programmatic dependent launch, over `base` for what it does not set (the
        dense LoRA policy)."""
        cuda = self.torch_device.type == "cuda"
        return dataclasses.replace(base, kernel_backend=self.kernel_backend, fused_moe_table=self.fused_moe_table,
                                   overlap_shared_experts=self.overlap_shared_experts and cuda,
                                   overlap_mla_absorb=self.overlap_mla_absorb and cuda,
                                   mla_absorbed_decode=self.mla_absorbed_decode,
                                   merge_qkv=self.merge_qkv, merge_gate_up=self.merge_gate_up,
                                   lora_target_modules=self.lora_target_modules,
                                   pdl=self.pdl and cuda)

    def model_config(self, model_dir) -> ModelConfig:
        """The model's config.json as this engine reads it (`hf_overrides` over it)."""
        return ModelConfig.from_hf(model_dir, self.hf_overrides)

    def fp8_config(self, model: ModelConfig) -> FP8Config | None:
        """The model's FP8 scheme under this engine config (resolved: checked by `resolve`)."""
        fp8 = model.quantization or (FP8Config.from_engine(self.quantization) if self.quantization else None)
        return None if fp8 is None else dataclasses.replace(fp8, quantize_activations=self.fp8_activation_quant)

    @property
    def parallel_config(self):
        from moelora.parallel.config import ParallelConfig

        return ParallelConfig(self.tensor_parallel_size, self.expert_parallel, self.parallel_step_timeout_s,
                              self.nnodes, self.master_addr, self.master_port)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def resolve(self, model: ModelConfig) -> EngineConfig:
        device = self.device
        if device in (None, "auto"):
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} requested but CUDA is not available")
        dtype = self.dtype
        if dtype == "auto":
            dtype = "float32" if torch.device(device).type == "cpu" else model.dtype
        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be auto or one of {', '.join(DTYPES)}; got {dtype!r}")
        backend = self.kernel_backend or ("triton" if torch.device(device).type == "cuda" else "torch")
        if backend not in ("torch", "triton"):
            raise ConfigError(f"kernel_backend must be 'torch' or 'triton', got {backend!r}")
        if backend == "triton" and torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            # else Triton's launcher fails at the first kernel with "Pointer argument ... (cpu tensor?)"
            raise ConfigError(f"kernel_backend='triton' runs its kernels on a CUDA device, not on device={device!r}: "
                              "use kernel_backend='torch' there (Triton's interpreter, TRITON_INTERPRET=1, runs them "
                              "on the CPU for tests)")
        max_len = self.max_model_len or model.max_context_len
        batched = self.max_num_batched_tokens
        if batched is None:
            on_gpu = torch.device(device).type == "cuda"
            batched = default_max_num_batched_tokens(torch.cuda.get_device_properties(device).total_memory
                                                     if on_gpu else None)
        for name, value in (("max_num_seqs", self.max_num_seqs), ("max_num_batched_tokens", batched),
                            ("block_size", self.block_size), ("max_model_len", max_len)):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if max_len > model.max_context_len:
            raise ConfigError(f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                              f"{model.max_position_embeddings}" + (f" (x its YaRN factor: {model.max_context_len})"
                                                                    if model.rope_yarn else ""))
        if self.max_loras < 0 or self.max_lora_rank < 0:
            raise ConfigError("max_loras and max_lora_rank must be >= 0")
        if self.piecewise_graph_tokens < 0:
            raise ConfigError(f"piecewise_graph_tokens must be >= 0 (0: off), got {self.piecewise_graph_tokens}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        targets = ("auto",) if self.lora_target_modules == "auto" else self.lora_target_modules
        if targets is not None:
            if isinstance(targets, str) or not all(isinstance(t, str) and t.strip(".") for t in targets):
                raise ConfigError(f"lora_target_modules must be module names (a tuple of str), got {targets!r}")
            targets = tuple(t.strip(".") for t in targets)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self._check_quantization(model, backend, torch.device(device))
        w8a8 = self.fp8_activation_quant
        if w8a8 is None:
            fp8_weights = model.quantization is not None or self.quantization is not None
            w8a8 = fp8_weights and backend == "triton" and torch.device(device).type == "cuda"
        table = self.fused_moe_table
        if table is not None:
            try:
                table = check_table_file(table)
            except (OSError, ValueError) as e:  # no file, or an entry that does not parse (naming it)
                raise ConfigError(f"fused_moe_table: {e}") from None
        self._check_parallel(torch.device(device))
        return dataclasses.replace(
            self, device=device, dtype=dtype, kernel_backend=backend, max_model_len=max_len,
            max_num_batched_tokens=batched, max_cpu_loras=self.max_cpu_loras or max(32, self.max_loras),
            lora_target_modules=targets, fp8_activation_quant=w8a8,
            fused_moe_table=table, async_scheduling=(torch.device(device).type == "cuda"
                                                     if self.async_scheduling is None else self.async_scheduling))

    def _check_quantization(self, model: ModelConfig, backend: str, device: torch.device) -> None:
        method = model.quantization.method if model.quantization else None
        if self.quantization not in (None, "fp8", "compressed-tensors"):
            raise ConfigError(f"quantization={self.quantization!r} is not supported (only 'fp8', or "
                              f"'compressed-tensors' for such a checkpoint)")
        if self.quantization is not None and method is not None and self.quantization != method:
            raise ConfigError(f"quantization={self.quantization!r} does not match the checkpoint's "
                              f"quantization_config quant_method={method!r}")
        if self.quantization == "compressed-tensors" and method is None:
            raise ConfigError("quantization='compressed-tensors' needs a compressed-tensors checkpoint; use 'fp8' "
                              "to quantize a bf16 checkpoint while loading")
        if self.fp8_activation_quant and method is None and self.quantization is None:
            raise ConfigError("fp8_activation_quant needs FP8 weights (an FP8 checkpoint or quantization='fp8')")
        if (method or self.quantization) and backend == "triton" and device.type == "cuda":
            cap = torch.cuda.get_device_capability(device)
            if cap < (8, 9):
                raise ConfigError(f"FP8 weights on kernel_backend='triton' need FP8 support in the GPU (compute "
                                  f"capability >= 8.9: Ada, Hopper), this one is sm_{cap[0]}{cap[1]}: use "
                                  f"kernel_backend='torch', or a bf16 checkpoint")

    def _check_parallel(self, device: torch.device) -> None:
        parallel = self.parallel_config  # validates the sizes
        first = device.index or 0
        local = parallel.ranks_per_node  # this node's ranks
        if parallel.distributed and device.type == "cuda" and torch.cuda.device_count() < first + local:
            raise ConfigError(f"tensor_parallel_size={parallel.world_size} over {parallel.nnodes} node(s) on {device} "
                              f"needs GPUs {first}..{first + local - 1}; {torch.cuda.device_count()} are visible")

    def with_kv_blocks(self, num_blocks: int) -> EngineConfig:
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        blocks_per_seq += self.use_cuda_graphs  # the graphs' padding block (BlockAllocator.reserve)
        if num_blocks < blocks_per_seq:
            raise ConfigError(f"only {num_blocks} KV blocks fit, but one sequence of max_model_len="
                              f"{self.max_model_len} needs {blocks_per_seq}; lower max_model_len or raise "
                              "gpu_memory_utilization")
        return dataclasses.replace(self, num_kv_blocks=num_blocks)
