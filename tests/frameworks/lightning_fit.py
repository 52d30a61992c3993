"""A PyTorch Lightning `Trainer.fit` on a small seeded model and data; `--callback` adds
salus.lightning.SalusCallback (the one line a script may add). Saves the model to argv[1]."""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


L.seed_everything(0)
generator = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(256, 8, generator=generator),
                     torch.randn(256, 1, generator=generator))
callbacks = []
if "--callback" in sys.argv:
    import salus.lightning
    callbacks.append(salus.lightning.SalusCallback())
trainer = L.Trainer(max_steps=24, accelerator="cpu", devices=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, callbacks=callbacks)
model = Model()
trainer.fit(model, DataLoader(data, batch_size=32, shuffle=True))
torch.save(model.state_dict(), sys.argv[1])
