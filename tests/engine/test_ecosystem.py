"""The hook where users already train: PyTorch Lightning's DDPStrategy and Hugging Face
Accelerate, each on 2 gloo ranks, with the hook state built before the process group
exists (as both frameworks require), the gradients exchanged through it, and the ranks'
models identical afterwards."""

from __future__ import annotations

import os
import socket

import pytest
import torch

pytestmark = pytest.mark.distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data(rank: int):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 8, generator=g)
    return x, x @ torch.arange(8.0).unsqueeze(1) + 0.1 * torch.randn(64, 1, generator=g)


# -- Lightning ---------------------------------------------------------------------------------
# Its LightningModule and callback are in tests/engine/ecosystem_lightning.py, imported by the test
# only: collecting this file then does not import Lightning.


@pytest.mark.heavy
def test_lightning_ddp_strategy_runs_the_hook(tmp_path):
    pl = pytest.importorskip("lightning.pytorch", reason="the lightning extra is not installed")
    from tests.engine.ecosystem_lightning import Regression, Report
    from lightning.pytorch.strategies import DDPStrategy

    import repro.hooks
    from repro.integrations import CompressionCallback

    module = Regression()
    # Built before Lightning creates the process group (inside fit): resolved at first use.
    state, hook = repro.hooks.make("topk", ratio=0.25, model=module, measure=True)
    # The strategy registers a comm hook only on CUDA; the callback does it on any device.
    strategy = DDPStrategy(process_group_backend="gloo", ddp_comm_state=state,
                           ddp_comm_hook=hook, start_method="spawn")
    results = tmp_path / "result.pt"
    compression = CompressionCallback(state, hook)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[compression, Report(str(results), state)])
    trainer.fit(module)
    out = torch.load(results, weights_only=True)
    assert out["resolved"] and out["world"] == 2
    assert out["identical"]
    assert out["exchanges"] > 0  # the gradients went through our hook


# -- Accelerate --------------------------------------------------------------------------------

def _accelerate_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from accelerate import Accelerator

    import repro.hooks

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    state, hook = repro.hooks.make("dgc", ratio=0.25, model=model, measure=True)
    accelerator = Accelerator(cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp, opt = accelerator.prepare(model, opt)
    ddp.register_comm_hook(state, hook)
    x, y = _data(rank)
    for i in range(0, 64, 16):
        opt.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(ddp(x[i:i + 16]), y[i:i + 16]))
        opt.step()
    import torch.distributed as dist

    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(every, params)
    torch.save({"identical": all(torch.equal(e, every[0]) for e in every),
                "exchanges": len(state.pop_records()), "world": accelerator.num_processes},
               os.path.join(out_dir, f"{rank}.pt"))


def test_accelerate_prepared_model_runs_the_hook(tmp_path):
    pytest.importorskip("accelerate", reason="the accelerate extra is not installed")
    import torch.multiprocessing as mp

    port = _free_port()
    mp.start_processes(_accelerate_rank, args=(2, port, str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    for rank in range(2):
        out = torch.load(tmp_path / f"{rank}.pt", weights_only=True)
        assert out["world"] == 2 and out["identical"] and out["exchanges"] > 0


def test_hook_state_built_before_the_process_group_checks_its_arguments_at_once():
    import repro.hooks

    state, _ = repro.hooks.make("topk", ratio=0.1)
    assert not state.resolved
    with pytest.raises(ValueError, match="granularity='layer' is refused"):
        repro.hooks.make("deft", granularity="layer")
    with pytest.raises(ValueError, match="nonfinite"):
        repro.hooks.make("topk", nonfinite="ignore")
    with pytest.raises(RuntimeError, match="not initialised"):
        state.resolve()


def test_hook_options_as_one_object_or_as_keywords():
    """make takes the CompressionOptions object, its fields as keywords, or both (the
    keywords win); the compressor's own parameters go to the compressor; a misspelled
    option is refused, naming the options."""
    import compressors
    import repro.hooks
    from repro.compression import CompressionOptions, WorkerCompression

    options = CompressionOptions(granularity="bucket", nonfinite="off", min_numel=64, seed=3)
    state, _ = repro.hooks.make("topk", options, ratio=0.1)
    assert (state.options, state.granularity, state.compressor.ratio) == (options, "bucket", 0.1)
    state, _ = repro.hooks.make("topk", ratio=0.1, granularity="bucket", nonfinite="off",
                                min_numel=64, seed=3)
    assert state.options == options
    state, _ = repro.hooks.make("topk", options, nonfinite="error")
    assert (state.options.nonfinite, state.options.min_numel) == ("error", 64)
    # thc has a parameter of its own named granularity: make's keyword is the hook's
    state, _ = repro.hooks.make("thc", granularity="model")
    assert state.granularity == "model"
    assert state.compressor.params()["granularity"] == compressors.default_params("thc")["granularity"]
    for build in (lambda: WorkerCompression(compressors.build("topk"), 0, 2, nonfinit="off"),
                  lambda: repro.hooks.CompressionHookState(compressors.build("topk"),
                                                           min_numl=64)):
        with pytest.raises(TypeError, match=r"unknown compression option\(s\) (nonfinit|min_numl): "
                                            r"the options are batch, feedback, granularity, .*selector"):
            build()
    with pytest.raises(ValueError, match="local_clip=-1.0 must be a positive number"):
        CompressionOptions(local_clip=-1.0)
