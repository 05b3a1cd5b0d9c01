"""Finiteness is checked once per exchange, before anything is compressed, and agreed by
all workers (WorkerCompression.agree): a bucket is read once; only a failing bucket
is checked per tensor, so the error still names the tensor that holds the NaN/Inf; the
Sessions do not check again."""

from __future__ import annotations

import pytest
import torch

import compressors
from compressors import drive, session
from repro import compression
from repro.compression import WorkerCompression


def _bucket(bad: float | None = None):
    buffer = torch.randn(30, generator=torch.Generator().manual_seed(0))
    named = [("layer1.weight", buffer[:12].view(3, 4)), ("layer1.bias", buffer[12:15]),
             ("layer2.weight", buffer[15:])]
    if bad is not None:
        named[2][1][4] = bad
    return buffer, named


def _exchange(buffer, named, monkeypatch, with_buffer=True):
    calls, reads = [], []
    real = session.validate_gradient
    real_finite_norm = compression.finite_norm

    def counting(name, grad, check_finite=True):
        calls.append((name, check_finite))
        return real(name, grad, check_finite)

    def reading(t):
        reads.append(t.numel())
        return real_finite_norm(t)

    monkeypatch.setattr(session, "validate_gradient", counting)
    monkeypatch.setattr(compression, "finite_norm", reading)
    worker = WorkerCompression(compressors.build("topk", ratio=0.5), rank=0, world_size=1)
    job, finish = worker.layerwise(named, 0, buffer=buffer if with_buffer else None)
    finish(drive([job])[0])
    return calls, reads


def test_finite_bucket_is_checked_once_not_per_tensor(monkeypatch):
    buffer, named = _bucket()
    before = buffer.clone()
    calls, reads = _exchange(buffer, named, monkeypatch)
    assert [n for n, _ in calls] == [n for n, _ in named]
    assert not any(check for _, check in calls)  # the agreement covered them
    assert reads == [buffer.numel()]  # one read of the bucket
    # Without the bucket every tensor is checked on its own, once.
    buffer2, named2 = _bucket()
    calls2, reads2 = _exchange(buffer2, named2, monkeypatch, with_buffer=False)
    assert not any(check for _, check in calls2)
    assert reads2 == [g.numel() for _, g in named2]
    # Same result either way (world size 1, top-k 50% with error feedback: the average
    # is the selected half of each tensor).
    assert torch.equal(buffer, buffer2)
    assert not torch.equal(buffer, before)  # the averages were written in place


@pytest.mark.parametrize("bad, word", [(float("nan"), "NaN"), (float("inf"), "Inf")])
def test_non_finite_bucket_names_the_tensor(monkeypatch, bad, word):
    buffer, named = _bucket(bad)
    with pytest.raises(FloatingPointError, match=rf"step 0: gradient 'layer2.weight' contains "
                                                 rf"{word} on rank 0"):
        _exchange(buffer, named, monkeypatch)
