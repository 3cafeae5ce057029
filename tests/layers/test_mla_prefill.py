"""MLA prefill, the expanded form's pieces: its attention core (`layers.mla.attend`, SDPA given as a batch of one
so torch takes its fused kernels) against the same causal attention in float64 and against the 3-D call it
replaced (SDPA's math kernel): the mask's bottom-right alignment (a chunk after a cached prefix), heads, and
DeepSeek's head widths (q / k 192, v 128); and kv_b_proj's expansion of every sequence's latents at once, each row
with its own adapter slot (`LinearSite.forward_rows`), on both backends, against the delta written out per row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moelora.layers.linear import Linear
from moelora.layers.mla import attend
from moelora.layers.options import LayerOptions
from moelora.lora.adapter import LoRAWeights
from moelora.lora.batch import LoRABatch
from tests.helpers.kernel_env import CUDA, DEV, INTERP, kernel_test, rel_err


def case(N: int, n: int, L: int, dtype: torch.dtype, device: str, seed: int = 0):
    """q [N, n, 192], keys [N, L, 192], vals [N, L, 128], the mask of n queries at positions L - n .. L - 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    q, k = (torch.randn(N, m, 192, generator=g, device=device).to(dtype) for m in (n, L))
    v = torch.randn(N, L, 128, generator=g, device=device).to(dtype)
    mask = torch.arange(L, device=device)[None, :] <= torch.arange(L - n, L, device=device)[:, None]
    return q, k, v, mask


def exact(q, k, v, mask, scale):
    """The causal attention written out in float64."""
    s = (q.double() @ k.double().transpose(1, 2)) * scale
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v.double()


@pytest.mark.parametrize("N,n,L", [(2, 5, 5), (3, 4, 11), (2, 1, 9), (1, 17, 40), (2, 9, 9)])
def test_attend_is_causal_attention_bottom_right(N, n, L):
    q, k, v, mask = case(N, n, L, torch.float32, "cpu")
    want = exact(q, k, v, mask, 192 ** -0.5)
    for given in (mask, None) if n == L else (mask,):  # None: is_causal, for a sequence with no cached prefix
        got = attend(q, k, v, given, 192 ** -0.5)
        assert got.shape == (N, n, 128)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(AssertionError, match="n must be L"):
        attend(q[:, :-1] if n == L else q, k, v, None, 1.0)  # is_causal would align n < L queries top-left


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N,n,L", [(16, 2048, 2048), (16, 512, 2560), (128, 300, 700), (16, 1, 64)])
def test_gpu_attend_bf16_within_the_math_kernels_rounding(N, n, L):
    """bf16 on the GPU: the fused kernels' error against float64 at most twice that of the 3-D call's math kernel
    (+1e-3), which it replaced; both within bf16's rounding."""
    q, k, v, mask = case(N, n, L, torch.bfloat16, "cuda")
    want = exact(q, k, v, mask, 192 ** -0.5)
    math = rel_err(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=192 ** -0.5), want)
    for given in (mask, None) if n == L else (mask,):  # None: is_causal
        fused = rel_err(attend(q, k, v, given, 192 ** -0.5), want)
        assert fused <= 2 * math + 1e-3 and fused < 1e-2, (given is None, fused, math)


def rows_case(backend: str, device: str, dtype: torch.dtype):
    """A Linear 40 -> 24 (bias) with slots of rank 8, 3 and 5 (slot 3 empty), 37 rows on slots -1..3 in no order,
    and the step's batch naming slots 0..2: (layer, x, row slots, batch, the per-row result in float64)."""
    g = torch.Generator().manual_seed(5)
    layer = Linear(40, 24, bias=True, max_loras=4, max_rank=8, options=LayerOptions(kernel_backend=backend),
                   dtype=torch.float32)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(24, 40, generator=g) * 0.2)
        layer.bias.copy_(torch.randn(24, generator=g))
    deltas = {}
    for slot, rank in enumerate((8, 3, 5)):
        a, b = torch.randn(rank, 40, generator=g) * 0.3, torch.randn(24, rank, generator=g) * 0.3
        layer.set_lora_slot(slot, LoRAWeights(a, b))
        deltas[slot] = (a.double(), b.double())
    x = torch.randn(37, 40, generator=g)
    slots = torch.randint(-1, 4, (37,), generator=g, dtype=torch.int32)
    want = x.double() @ layer.weight.double().t() + layer.bias.double()
    for i, s in enumerate(slots.tolist()):
        if s in deltas:
            a, b = deltas[s]
            want[i] += b @ (a @ x[i].double())
    layer = layer.to(device=device, dtype=dtype)
    batch = LoRABatch.build([0, 1, 2, -1], [8, 3, 5, 0], device, rows=backend == "torch")
    return layer, x.to(device, dtype), slots.to(device), batch, want


def test_forward_rows_gives_each_row_its_slots_delta_torch():
    layer, x, slots, batch, want = rows_case("torch", "cpu", torch.float32)
    torch.testing.assert_close(layer.forward_rows(x, slots, batch).double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(layer.forward_rows(x, slots, None), layer(x))  # no batch: no delta


@kernel_test
def test_forward_rows_gives_each_row_its_slots_delta_triton():
    """Under the interpreter in fp32 (1e-4); on CUDA in bf16 (the kernels' rounding)."""
    dtype = torch.float32 if INTERP or not CUDA else torch.bfloat16
    layer, x, slots, batch, want = rows_case("triton", DEV, dtype)
    with torch.no_grad():
        got = layer.forward_rows(x, slots, batch)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double().cpu(), want, atol=1e-4, rtol=1e-4)
    else:
        assert rel_err(got.cpu(), want) < 1e-2


def test_context_rows_follow_each_sequences_table_row():
    """`context_rows`: every position of every sequence, sequence after sequence, through the block table row the
    sequence names (here not its index: rows stored in reverse), blocks scattered; each row's sequence; each
    sequence's first query row."""
    from moelora.layers.attention import AttnMetadata, SeqSlice
    from moelora.layers.mla import context_rows
    from tests.helpers.attention_cases import scattered_tables

    bs, g = 4, torch.Generator().manual_seed(3)
    spec = [(0, 5), (7, 2), (3, 9)]  # (cached, new) a sequence
    tables, _, pad = scattered_tables([c + n for c, n in spec], bs, 3, g)
    mb, B = max(len(t) for t in tables), len(spec)
    seqs, off = [], 0
    for i, (c, n) in enumerate(spec):
        seqs.append(SeqSlice(off, n, c + n, B - 1 - i))
        off += n
    stored = [t + [pad] * (mb - len(t)) for t in reversed(tables)]  # row B - 1 - i holds sequence i's blocks
    meta = AttnMetadata(torch.zeros(off, dtype=torch.int64), torch.tensor(stored, dtype=torch.int32),
                        torch.tensor([s.seq_len for s in seqs], dtype=torch.int32),
                        torch.tensor([0, 5, 7, 16], dtype=torch.int32), tuple(seqs), 12, 9)
    rows, seq_of_row, q_offsets = context_rows(meta, bs)
    want = [tables[i][p // bs] * bs + p % bs for i, s in enumerate(seqs) for p in range(s.seq_len)]
    assert rows.tolist() == want and rows.dtype == torch.int64
    assert seq_of_row.tolist() == [i for i, s in enumerate(seqs) for _ in range(s.seq_len)]
    assert q_offsets.tolist() == [0, 5, 7]
