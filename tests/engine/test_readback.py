"""`ReadBack`: a step's tokens reach the host without waiting for work queued after them (the
overlapped scheduler launches step n+1 before it reads step n back)."""

from __future__ import annotations

import pytest
import torch

from moelora.engine.readback import ReadBack


def test_host_tensors_pass_through():
    t = torch.tensor([3, 1, 2])
    got, missing = ReadBack([t, None]).get()
    assert got is t and missing is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_read_back_does_not_wait_for_later_work():
    tokens = torch.arange(8, device="cuda") * 2
    logprobs = torch.linspace(-1, 0, 8, device="cuda")
    pending = ReadBack([tokens, None, logprobs])
    tokens.zero_()  # queued after the copy: the host copy keeps the sampled values
    torch.cuda._sleep(int(4e8))  # ~0.2 s of device work queued behind the copy (the next step)
    host_tokens, missing, host_lp = pending.get()
    assert not torch.cuda.current_stream().query()  # returned while the later work still runs
    assert host_tokens.tolist() == list(range(0, 16, 2)) and missing is None
    assert torch.equal(host_lp, torch.linspace(-1, 0, 8))
    torch.cuda.synchronize()
