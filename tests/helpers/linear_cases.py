"""Dense LoRA linear kernel cases: tiny configs per registered mode, random inputs with NaN past every
slot's rank (shared by the lora_linear, segments and FP8 linear tests)."""

from __future__ import annotations

import torch

from moelora.kernels.args import DenseLoRAArgs, SlotRows
from moelora.kernels.lora_linear import LoRALinearConfig, default_lora_linear_config

# Tiny blocks so that tiny shapes still span several row blocks, N tiles and N_in chunks.
TINY = {"split": LoRALinearConfig("split", 16, 32, 16, split_k=3),
        # fp16/bf16 only (fp32 calls take "split"): split-K GEMM, expand in its reduce
        "splitk": LoRALinearConfig("splitk", 16, 32, 16, split_k=3, gemm_block_n=16, gemm_block_k=16,
                                   gemm_split_k=3),
        # rows grouped by slot: 16-row plan blocks, 16-column programs (tiles straddle no segment bound)
        "planned": LoRALinearConfig("planned", 16, 16, 16, plan_cols=16),
        # the delta as more K columns of the GEMM: 16-row shrink programs, 16 x 16 weight tiles
        "concat": LoRALinearConfig("concat", 16, 16, 16)}


def rows_off_exact(config: LoRALinearConfig | None) -> bool:
    """Whether rows on no adapter get exactly the mode's base GEMM: not where the GEMM itself carries the delta
    (expand_first's beta = 1 onto the written zeros, concat's longer K), which only the reference bounds."""
    return config is None or not (config.expand_first or config.mode == "concat")


def named_config(T: int, name: str) -> LoRALinearConfig:
    """A TINY key's real-size default: its mode's default config."""
    return default_lora_linear_config(T, name)


def make_case(T, n_in, n_out, ranks, R, *, bias=True, dtype=torch.float32, device="cpu", seed=0, slots=None):
    g = torch.Generator().manual_seed(seed)  # routing and slots
    gd = torch.Generator(device=device).manual_seed(seed)  # tensors, drawn where they live

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gd, device=device) * scale).to(dtype)

    x, w = rn(T, n_in), rn(n_out, n_in, scale=n_in ** -0.5)
    b = rn(n_out) if bias else None
    if not ranks:
        return x, w, b, None
    S = len(ranks)
    a, bb = rn(S, R, n_in, scale=n_in ** -0.5), rn(S, n_out, R, scale=R ** -0.5)
    for s, r in enumerate(ranks):  # NaN beyond the rank: kernels must read only the first r columns
        a[s, r:] = float("nan")
        bb[s, :, r:] = float("nan")
    if slots is None:
        slots = torch.randint(-1, S, (T,), generator=g, dtype=torch.int32)
    slots = torch.as_tensor(slots, dtype=torch.int32)
    active = active_rows(slots, ranks, device)
    return x, w, b, DenseLoRAArgs(a, bb, slots.to(device), torch.tensor(ranks, dtype=torch.int32, device=device),
                                  active, slots=step_slots(active, device))


def step_slots(active, device) -> torch.Tensor:
    """`DenseLoRAArgs.slots` of a case: the slots its rows name with rank > 0, ascending."""
    return torch.tensor([sr.slot for sr in active], dtype=torch.int32, device=device)


def active_rows(slots, ranks, device):
    slots = slots.cpu()
    return tuple(SlotRows(s, ranks[s], (slots == s).nonzero().squeeze(1).to(device))
                 for s in range(len(ranks)) if ranks[s] > 0 and bool((slots == s).any()))


def call_without_sync(case, config: LoRALinearConfig | None):
    """`lora_linear` on a case's (x, w, bias, lora) under CUDA's sync debug mode "error": no host sync in the call."""
    from moelora.kernels.lora_linear import lora_linear

    torch.cuda.set_sync_debug_mode("error")
    try:
        return lora_linear(*case[:4], config=config)
    finally:
        torch.cuda.set_sync_debug_mode("default")
