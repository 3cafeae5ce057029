"""The launchers' host-side grid arithmetic (`kernels.checks.cdiv`, `next_pow2`) is Triton's own
(`triton.cdiv`, `triton.next_power_of_2`, constexpr functions ~3 µs a host call) for every int it meets."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from moelora.kernels.checks import cdiv, next_pow2  # noqa: E402


def test_cdiv_is_tritons():
    for a in range(-70, 5000, 7):
        for b in (1, 2, 3, 16, 64, 127, 128, 4096):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_next_pow2_is_tritons():
    for n in [*range(0, 5000), 2 ** 20 - 1, 2 ** 20, 2 ** 20 + 1, 2 ** 40 + 3]:
        assert next_pow2(n) == triton.next_power_of_2(n), n


def test_checks_format_their_messages_only_on_failure_and_still_name_what_failed():
    import torch

    from moelora.kernels.checks import check_rows, lora_tile_rank, need, need_at_least, need_one_of, need_pow2
    from moelora.kernels.fused_moe import fused_moe

    need(True, lambda: 1 / 0)  # a passing check never builds its message
    with pytest.raises(ValueError, match="^built$"):
        need(False, lambda: "built")
    with pytest.raises(ValueError, match=r"Cfg\.block_m must be a power of two >= 16 \(tl\.dot\), got 24"):
        need_pow2("Cfg", block_n=32, block_m=24)
    with pytest.raises(ValueError, match=r"Cfg\.lanes must be >= 1, got 0"):
        need_at_least("Cfg", 1, lanes=0)
    with pytest.raises(ValueError, match=r"Cfg\.mode must be one of \('a', 'b'\), got 'c'"):
        need_one_of("Cfg", "mode", "c", ("a", "b"))
    with pytest.raises(ValueError, match="LoRA width must be None or >= 0, got -1"):
        lora_tile_rank(16, -1)
    with pytest.raises(ValueError, match=r"x must be \(2, 4\), got \(2, 3\)"):
        check_rows("x", torch.zeros(2, 3), (2, 4))
    x = torch.zeros(4, 8)
    ids = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"w_gate_up must be \[E, 2I, H=8\], got \(3, 6, 9\)"):
        fused_moe(x, torch.zeros(3, 6, 9), torch.zeros(3, 8, 3), torch.ones(4, 2), ids)
    with pytest.raises(ValueError, match=r"w_down must be \[E=3, H=8, I=3\], got \(3, 8, 4\)"):
        fused_moe(x, torch.zeros(3, 6, 8), torch.zeros(3, 8, 4), torch.ones(4, 2), ids)
    with pytest.raises(ValueError, match=r"w_down dtype torch.float16 must be x's \(torch.float32\), or float8_e4m3fn"):
        fused_moe(x, torch.zeros(3, 6, 8), torch.zeros(3, 8, 3, dtype=torch.float16), torch.ones(4, 2), ids)


def test_tma_is_refused_off_hopper_outside_the_interpreter_and_on_rows_not_16_bytes(monkeypatch):
    """use_tma=True needs Hopper's descriptors (the interpreter emulates them: the TMA interp test runs there)
    and rows of whole 16-byte units; both refusals come before any launch."""
    from moelora.kernels.fused_moe import fused_moe
    from tests.helpers.moe_cases import make_case, tiny_config

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w_gu, w_d, wts, ids, _ = make_case(5, 32, 16, 4, 2, seed=6)
    with pytest.raises(ValueError, match=r"use_tma=True needs a CUDA GPU of compute capability >= 9.0"):
        fused_moe(x, w_gu, w_d, wts, ids, config=tiny_config(tma=True))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w_gu, w_d, wts, ids, _ = make_case(5, 30, 16, 4, 2, seed=6)  # 30 fp32 columns: 120-byte rows
    with pytest.raises(ValueError, match=r"16-byte rows: H=30, I=16"):
        fused_moe(x, w_gu, w_d, wts, ids, config=tiny_config(tma=True))
