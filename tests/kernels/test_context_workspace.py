"""Context.workspace: a buffer a protocol writes whole each step (FP16's 16-bit wire),
kept per worker and tensor between steps on the CPU instead of allocated fresh (a fresh
full-size CPU tensor costs a page fault per 4 KiB on first touch), and never part of a
checkpoint. tests/kernels/test_allocations.py checks that FP16's step allocates nothing full-size."""

from __future__ import annotations

import pytest
import torch

import compressors
from compressors import Context, Session
from compressors.requests import AllReduce, as_round
from compressors.simulated import _combine

WORKERS = 2
NUMEL = 3001


def _grads(step: int, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(40 + step)
    return [torch.randn(NUMEL, generator=g).to(dtype) for _ in range(WORKERS)]


def _steps(sessions, names, steps, dtype=torch.float32, out=True):
    """Drive every (step, name) through the simulated group; each AllReduce tensor's
    data_ptr per (rank, name, step), and the outcomes and gradients."""
    wires, results = {}, {}
    for step in range(steps):
        for name in names:
            grads = _grads(step, dtype)
            before = [g.clone() for g in grads]
            gens = [s.exchange(name, g, step, out=g if out else None)
                    for s, g in zip(sessions, grads)]
            replies = [None] * WORKERS
            while True:
                items, done = [], 0
                for gen, reply in zip(gens, replies):
                    try:
                        items.append(gen.send(reply))
                    except StopIteration:
                        done += 1
                if done:
                    assert done == WORKERS  # the workers finish in the same round
                    break
                for rank, item in enumerate(items):
                    for req in as_round(item)[0]:
                        if isinstance(req, AllReduce):
                            wires[(rank, name, step)] = req.tensor.data_ptr()
                replies = _combine(items)
            results[(name, step)] = (grads, before)
    return wires, results


def _fp16_sessions(dtype: str = "float16", feedback: str = "none"):
    comp = compressors.build("fp16", dtype=dtype)
    return [Session(comp, rank=r, world_size=WORKERS, feedback=feedback, seed=1)
            for r in range(WORKERS)]


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_fp16_keeps_one_wire_per_worker_and_tensor_and_its_result_is_unchanged(wire):
    sessions = _fp16_sessions(wire)
    wires, results = _steps(sessions, ["a", "b"], steps=3)
    for rank in range(WORKERS):
        for name in ("a", "b"):
            kept = sessions[rank].workspaces[name]["wire"].data_ptr()
            assert wires[(rank, name, 0)] == wires[(rank, name, 1)] == wires[(rank, name, 2)]
            assert wires[(rank, name, 0)] == kept
        assert wires[(rank, "a", 0)] != wires[(rank, "b", 0)]  # one wire per tensor
    assert wires[(0, "a", 0)] != wires[(1, "a", 0)]  # and per worker
    half = getattr(torch, wire)
    for (name, step), (grads, before) in results.items():
        # what the wire carried before it was kept: each rank's cast, pre-divided, summed
        # in rank order, cast back
        want = (before[0].to(half).div_(WORKERS) + before[1].to(half).div_(WORKERS)).float()
        for g in grads:  # the aggregate, written into each gradient (out=grad)
            assert torch.equal(g, want), (name, step)


def test_a_16_bit_gradient_is_not_the_wire():
    """A float16 gradient cast to float16 is no copy: the wire must still be the workspace,
    so the pre-division and the allreduce leave the caller's tensor as it was."""
    sessions = _fp16_sessions()
    _, results = _steps(sessions, ["a"], steps=2, dtype=torch.float16, out=False)
    for grads, before in results.values():
        for g, b in zip(grads, before):
            assert torch.equal(g, b)


def test_the_wire_is_not_checkpointed_and_a_skipped_tensor_keeps_none():
    sessions = _fp16_sessions()
    _steps(sessions, ["a"], steps=1)
    sd = sessions[0].state_dict()

    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)

    assert [t for t in tensors(sd["states"]) if t.numel() >= NUMEL] == []
    assert set(sessions[0].workspaces["a"]) == {"wire"}
    # a step refused for a NaN leaves no state and no workspace for a new tensor
    s = sessions[0]
    bad = torch.full((NUMEL,), float("nan"))
    with pytest.raises(FloatingPointError, match="NaN"):
        gen = s.exchange("c", bad, 0)
        gen.send(None)
    assert "c" not in s.states and "c" not in s.workspaces


def _context(workspaces: dict) -> Context:
    return Context(rank=0, world_size=1, step=0, name="t", state={},
                   generator=torch.Generator(), shared_seed=0, workspaces=workspaces)


def test_workspace_is_kept_for_its_key_size_and_dtype_and_replaced_otherwise():
    workspaces: dict = {}
    ctx = _context(workspaces)
    a = ctx.workspace("wire", 1000, torch.float16, torch.device("cpu"))
    assert a.shape == (1000,) and a.dtype == torch.float16
    assert ctx.workspace("wire", 1000, torch.float16, "cpu").data_ptr() == a.data_ptr()
    other = ctx.workspace("other", 1000, torch.float16, "cpu")
    assert other.data_ptr() != a.data_ptr()
    smaller = ctx.workspace("wire", 999, torch.float16, "cpu")
    assert smaller.shape == (999,)  # exactly the size asked for, not a larger old one
    wider = ctx.workspace("wire", 999, torch.float32, "cpu")
    assert wider.dtype == torch.float32 and workspaces["wire"] is wider
    assert set(workspaces) == {"wire", "other"}


def test_workspace_off_the_cpu_is_fresh_and_not_kept():
    if not torch.cuda.is_available():
        # the meta device stands in: anything but the CPU gets a new tensor each call
        device = torch.device("meta")
    else:
        device = torch.device("cuda")
    workspaces: dict = {}
    ctx = _context(workspaces)
    t = ctx.workspace("wire", 10, torch.float16, device)
    assert t.device.type == device.type and t.shape == (10,)
    assert workspaces == {}


# Every compressor that keeps a buffer in Context.workspace, with its parameters.
WORKSPACE_USERS = {"fp16": {}, "qsgd": {}, "terngrad": {}, "signsgd": {}, "thc": {},
              "thc_uniform": {}, "thc_ps": {"aggregation": "ps"}}


def _history(name: str, feedback: str, dtype: torch.dtype, out: bool) -> list:
    """Three steps of two workers on one tensor: each step's aggregates (as returned, and
    copied at once) and residuals (copied at once)."""
    params = dict(WORKSPACE_USERS[name])
    comp = compressors.build("thc" if name == "thc_ps" else name, **params)
    sessions = [Session(comp, rank=r, world_size=WORKERS, feedback=feedback, seed=9)
                for r in range(WORKERS)]
    steps = []
    for step in range(3):
        grads = _grads(step, dtype)
        outcomes = compressors.drive([s.exchange("g", g, step, out=g if out else None)
                                      for s, g in zip(sessions, grads)])
        steps.append([(o.aggregate, o.aggregate.clone(),
                       None if s.residual("g") is None else s.residual("g").clone())
                      for o, s in zip(outcomes, sessions)])
    return steps


@pytest.mark.parametrize("name", sorted(WORKSPACE_USERS))
@pytest.mark.parametrize("feedback", ["none", "residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("out", [False, True])
def test_workspaces_change_no_result_and_no_aggregate_lives_in_one(name, feedback, dtype,
                                                                   out, monkeypatch):
    """The same aggregates and residuals, bit for bit, as with a fresh buffer for every
    workspace (so no workspace is shared by two buffers a step needs at once, such as a
    wire and the levels error feedback reads after the allreduce); and no aggregate
    handed back is a workspace, which a later step would rewrite."""
    if dtype == torch.float16 and name in ("thc", "thc_ps"):
        dtype = torch.bfloat16  # (THC rotates in float32 either way; any 16-bit input)
    kept = _history(name, feedback, dtype, out)
    for step in kept:  # three steps later, every aggregate is still what it was
        for aggregate, at_once, _ in step:
            assert torch.equal(aggregate, at_once)
    monkeypatch.setattr(Context, "workspace", lambda self, key, numel, dtype, device:
                        torch.empty(numel, dtype=dtype, device=device))
    fresh = _history(name, feedback, dtype, out)
    for got, want in zip(kept, fresh):
        for (_, aggregate, residual), (_, aggregate_ref, residual_ref) in zip(got, want):
            assert torch.equal(aggregate, aggregate_ref)
            assert (residual is None) == (residual_ref is None)
            if residual is not None:
                assert torch.equal(residual, residual_ref)
