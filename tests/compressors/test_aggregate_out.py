"""Decoding into the caller's buffer: Session.exchange(out=...). The DDP hook passes the
gradient itself, so a compressor whose decode builds a dense aggregate from zero writes
it there instead of allocating a full-size tensor every step and copying it back."""

from __future__ import annotations

import pytest
import torch

import compressors
from compressors import Session, drive
from compressors.kernels import ops
from repro.compression import WorkerCompression

NAMES = compressors.list_compressors()
WORKERS = 2
NUMEL = 4096
# Decoders that start from a zero dense tensor (a scatter of sparse pairs, or a sum of
# decoded payloads in the input's dtype), the dense allreduce (reduced in `out`), FP16 and
# TernGrad's shared-scaler allreduce (their sums cast into `out`) and SignSGD (its integer
# vote cast into `out`). The others return a tensor they already have and leave `out` alone.
DECODES_INTO_OUT = {
    "cltk", "deft", "dgc", "dragonn", "efsignsgd", "fp16", "gaussianksgd", "hard_threshold",
    "mstopk", "none", "qsgd", "randomk", "redsync", "signsgd", "sidco_e", "sidco_gp",
    "sidco_p", "terngrad", "thc_uniform", "topk", "powersgd", "dgc_reference",
}
# THC's fused native decode (CPU float32) also writes into `out`.
if ops.available():
    DECODES_INTO_OUT.add("thc")


def _params(name: str) -> dict:
    return {"ratio": 0.05} if "ratio" in compressors.default_params(name) else {}


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(NUMEL, generator=g) for _ in range(WORKERS)]


def _run(name: str, feedback: str, out_kind: str | None, steps: int = 3):
    """Every step's outcomes, the out buffers given and the gradients, and the sessions.
    out_kind: None (no out), "buffer" (a NaN-filled buffer like the gradient: it must be
    zeroed before use) or "grad" (the gradient itself)."""
    comp = compressors.build(name, **_params(name))
    sessions = [Session(comp, rank=r, world_size=WORKERS, feedback=feedback, seed=5)
                for r in range(WORKERS)]
    history = []
    for step in range(steps):
        grads = _grads(step)
        if out_kind == "buffer":
            outs = [torch.full_like(g, float("nan")) for g in grads]
        elif out_kind == "grad":
            outs = list(grads)
        else:
            outs = [None] * WORKERS
        originals = [g.clone() for g in grads]
        outcomes = drive([s.exchange("grad", g, step, out=o)
                          for s, g, o in zip(sessions, grads, outs)])
        history.append((outcomes, outs, grads, originals))
    return sessions, history


def test_the_decoders_listed_are_the_registered_ones():
    assert DECODES_INTO_OUT <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_out_gives_the_same_aggregate_and_feedback(name):
    feedback = compressors.get_class(name).default_feedback
    ref_sessions, ref = _run(name, feedback, None)
    sessions, got = _run(name, feedback, "buffer")
    for (ref_outcomes, *_), (outcomes, outs, grads, originals) in zip(ref, got):
        for r in range(WORKERS):
            agg = outcomes[r].aggregate
            assert torch.equal(agg, ref_outcomes[r].aggregate)
            assert torch.equal(grads[r], originals[r]), "the gradient was modified"
            if name in DECODES_INTO_OUT:
                assert agg.data_ptr() == outs[r].data_ptr(), "decoded into a new tensor"
            else:
                assert torch.isnan(outs[r]).all(), "out was written but not returned"
    for s, rs in zip(sessions, ref_sessions):
        a, b = s.residual("grad"), rs.residual("grad")
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_out_that_is_the_compressed_tensor_itself(name):
    """Without error feedback the compressed tensor is the gradient itself, and the DDP
    hook passes it as `out`: a protocol writes `out` only after its last read of the
    gradient, so the aggregate equals the one decoded without `out`; the decoders listed
    write it into the gradient's own memory (the dense allreduce reduces it in place),
    the others leave the gradient as it was."""
    _, ref = _run(name, "none", None)
    _, got = _run(name, "none", "grad")
    for (ref_outcomes, *_), (outcomes, _, grads, originals) in zip(ref, got):
        for r in range(WORKERS):
            assert torch.equal(outcomes[r].aggregate, ref_outcomes[r].aggregate)
            if name in DECODES_INTO_OUT:
                assert outcomes[r].aggregate.data_ptr() == grads[r].data_ptr()
                assert torch.equal(grads[r], ref_outcomes[r].aggregate)
            else:
                assert torch.equal(grads[r], originals[r])


@pytest.mark.parametrize("name", ["none", "fp16"])
def test_a_contribution_overwritten_in_place_is_refused_not_faked(name):
    """A dense protocol that wrote the aggregate over the gradient kept no copy of what it
    sent: asking for it fails with the fix, instead of returning the aggregate."""
    _, got = _run(name, "none", "grad", steps=1)
    outcome = got[0][0][0]
    with pytest.raises(RuntimeError, match="without them to keep it"):
        outcome.sent.dense(NUMEL)
    _, kept = _run(name, "none", None, steps=1)
    originals = kept[0][3]
    sent = kept[0][0][0].sent.dense(NUMEL)
    if name == "none":
        assert torch.equal(sent, originals[0])
    else:
        assert torch.equal(sent, originals[0].half().float())


@pytest.mark.parametrize("bad, what", [
    (torch.zeros(NUMEL + 1), "4097 elements"),
    (torch.zeros(NUMEL, dtype=torch.float64), "torch.float64"),
    (torch.zeros(2 * NUMEL)[::2], "contiguous=False"),
    (torch.zeros(NUMEL).numpy(), "must be a torch.Tensor"),
])
def test_bad_out_is_refused_before_any_work(bad, what):
    s = Session(compressors.build("topk", ratio=0.05), feedback="residual")
    grad = torch.randn(NUMEL)
    before = grad.clone()
    with pytest.raises((TypeError, ValueError), match=what):
        drive([s.exchange("grad", grad, 0, out=bad)])
    assert "grad" not in s.states  # no feedback buffer, no compressor state
    assert torch.equal(grad, before)


def test_hook_decodes_into_the_gradients_without_a_copy():
    """WorkerCompression.layerwise (the DDP hook's and the simulated trainer's path): the
    average lands in each gradient's own memory, equal to a plain Session's aggregate."""
    buffer = torch.randn(300, generator=torch.Generator().manual_seed(3))
    named = [("w", buffer[:200].view(10, 20)), ("b", buffer[200:])]
    expected = {}
    for n, g in named:
        ref = Session(compressors.build("topk", ratio=0.1), feedback="residual",
                      seed=0)
        expected[n] = drive([ref.exchange(n, g.clone(), 0)])[0].aggregate
    worker = WorkerCompression(compressors.build("topk", ratio=0.1), rank=0, world_size=1)
    job, finish = worker.layerwise(named, 0, buffer=buffer)
    outcomes = drive([job])[0]
    for (n, g), o in zip(named, outcomes):
        assert o.aggregate.data_ptr() == g.data_ptr()
    finish(outcomes)
    for n, g in named:
        assert torch.equal(g.reshape(-1), expected[n])


def _full_size_ops(fn, numel: int) -> list[str]:
    """The aten ops `fn` runs that return a tensor of `numel` elements (a pass over the
    whole output)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if isinstance(result, torch.Tensor) and result.numel() == numel:
                seen.append(func.overloadpacket.__name__)
            return result

    with Record():
        fn()
    return seen


@pytest.mark.parametrize("pairs", [0, 7, 1000, 2400, 9000])
def test_the_torch_sparse_mean_divides_only_where_pairs_landed_and_gives_the_same_bits(pairs):
    """The decode of the sparse families off the CPU (reference.scatter_mean): with few
    received pairs its only pass over the whole output is the zero fill, and the mean is
    bit for bit the sum's full-tensor division (repeated indices, three ranks)."""
    from compressors.kernels import reference

    n, world = 10_000, 3
    g = torch.Generator().manual_seed(pairs)
    idx = torch.randint(0, n, (pairs,), generator=g)
    val = torch.randn(pairs, generator=g)
    lengths = [pairs // 3, pairs // 3, pairs - 2 * (pairs // 3)]
    out = torch.full((n,), float("nan"))
    ops_run = _full_size_ops(lambda: reference.scatter_mean(idx, val, out, world, lengths), n)
    expected = torch.zeros(n)
    for i, v in zip(idx.split(lengths), val.split(lengths)):
        expected.index_add_(0, i, v)
    expected.div_(world)
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    if pairs <= n // 10:  # a sparsifier's payload: ratios of 0.1 and below
        assert ops_run.count("div_") == 0 and ops_run.count("zero_") == 1, ops_run
