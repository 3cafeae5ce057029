"""`moelora.upload.upload`: host lists -> device tensors; on CUDA through pinned memory, so the
copy is queued without the host waiting for the stream (overlapped scheduling depends on it)."""

from __future__ import annotations

import time

import pytest
import torch

from moelora.upload import upload


def test_values_and_dtypes_on_cpu():
    assert torch.equal(upload([3, 1, 2], torch.long, "cpu"), torch.tensor([3, 1, 2]))
    assert upload([1, 2], torch.int32, "cpu").dtype == torch.int32
    assert upload([0.5, 1.0], None, "cpu").dtype == torch.float32
    assert upload([True, False], None, "cpu").dtype == torch.bool
    assert upload([], torch.long, "cpu").shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_upload_does_not_wait_for_queued_work():
    values = list(range(50_000))  # larger than what the driver copies inline
    upload(values, torch.long, "cuda")  # warm the caching host allocator
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of device time queued ahead of the copy
    t0 = time.perf_counter()
    got = upload(values, torch.long, "cuda")
    returned = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert returned < 0.1, f"upload waited {returned:.3f} s for the stream"
    assert torch.equal(got.cpu(), torch.tensor(values))
