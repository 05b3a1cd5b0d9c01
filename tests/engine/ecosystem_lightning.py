"""The LightningModule and callback of tests/engine/test_ecosystem.py's Lightning test. Lightning's
spawn launcher pickles them into the ranks, so they live at a module's top level; a module
of their own, imported by that test only, keeps collection from importing Lightning (six
seconds here) wherever the test is not selected."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from tests.engine.test_ecosystem import _data


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        x, y = _data(self.global_rank)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                           batch_size=16)


class Report(pl.Callback):
    """Rank 0 saves whether the ranks' parameters are identical and how many tensor
    exchanges this rank's hook state recorded."""

    def __init__(self, path: str, state):
        self.path, self.state = path, state

    def on_train_end(self, trainer, module):
        import torch.distributed as dist

        params = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        every = [torch.empty_like(params) for _ in range(dist.get_world_size())]
        dist.all_gather(every, params)
        if trainer.global_rank == 0:
            # this rank's (unpickled) copy of the state is the one that ran
            state = next(c for c in trainer.callbacks if hasattr(c, "hook")).state
            torch.save({"identical": all(torch.equal(e, every[0]) for e in every),
                        "exchanges": len(state.pop_records()),
                        "resolved": state.resolved, "world": state.world_size},
                       self.path)
