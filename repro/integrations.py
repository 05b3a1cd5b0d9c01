"""The compression hook inside the frameworks researchers already train with.

PyTorch Lightning: DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook) registers the
hook only when training on CUDA; `CompressionCallback` registers it on any device (gloo
on the CPU included) once the strategy has wrapped the model:

    state, hook = repro.hooks.make("sidco_e", ratio=0.01, model=lightning_module)
    trainer = pl.Trainer(strategy="ddp", callbacks=[CompressionCallback(state, hook)])

Hugging Face Accelerate: register the hook on the model `accelerator.prepare` returns:

    model, opt = accelerator.prepare(model, opt)
    model.register_comm_hook(*repro.hooks.make("dgc", ratio=0.01, model=model))

In both, the hook state may be built before the process group exists: it takes its rank
and world size at the first exchange (repro.hooks.CompressionHookState).
"""

from __future__ import annotations

from typing import Any


try:  # the base class of CompressionCallback (Lightning is optional: the lightning extra)
    from lightning.pytorch import Callback as _CallbackBase
except ImportError:
    try:
        from pytorch_lightning import Callback as _CallbackBase
    except ImportError:
        _CallbackBase = object


class CompressionCallback(_CallbackBase):
    """A Lightning callback that registers `hook` with `state` on the DDP model at the
    start of fit (unless the strategy already did, as it does on CUDA)."""

    def __init__(self, state: Any, hook: Any) -> None:
        if _CallbackBase is object:
            raise ImportError("CompressionCallback needs PyTorch Lightning: pip install "
                              "lightning (the suite's `lightning` extra)")
        self.state, self.hook = state, hook

    def on_fit_start(self, trainer, pl_module) -> None:
        from torch.nn.parallel import DistributedDataParallel

        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise ValueError("CompressionCallback needs a DDP strategy (strategy='ddp' or "
                             f"DDPStrategy(...)); the model is a {type(model).__name__}")
        if getattr(trainer.strategy, "_ddp_comm_hook", None) is not None and (
                trainer.strategy.root_device.type == "cuda"):
            return  # the strategy registered its hook itself
        model.register_comm_hook(self.state, self.hook)
