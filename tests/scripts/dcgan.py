"""DCGAN, after pytorch/examples `dcgan/main.py`: two networks, two optimizers, three backwards.

Each step updates D on a real and a fake batch (two backward passes into D's gradients), then G
through D (a third). The noise is drawn inside the step, as in the example, so in salusd it is
drawn by the job and must continue the client's random stream. 16x16 synthetic "images".
Run: `python dcgan.py ADDRESS|- OUT.pt` (`-` trains directly, without salusd).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import salus.adapters.torch as salus

PATTERN = "GAN: two models, two optimizers, three backward passes per step, noise drawn in-step"
SALUS_LINES_CHANGED = 15
EPOCHS = 2
NZ, NGF, NDF = 8, 16, 16
REAL_LABEL, FAKE_LABEL = 1.0, 0.0


def weights_init(m: nn.Module) -> None:
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(NZ, NGF * 2, 4, 1, 0, bias=False),
            nn.BatchNorm2d(NGF * 2), nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 2, NGF, 4, 2, 1, bias=False),
            nn.BatchNorm2d(NGF), nn.ReLU(True),
            nn.ConvTranspose2d(NGF, 1, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(1, NDF, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(NDF * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 2, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input).view(-1, 1).squeeze(1)


def run_direct(netG: nn.Module, netD: nn.Module, optimizerG: torch.optim.Optimizer,
               optimizerD: torch.optim.Optimizer, dataloader: DataLoader) -> None:
    criterion = nn.BCELoss()
    for epoch in range(EPOCHS):
        for i, data in enumerate(dataloader):
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            real_cpu = data[0]
            batch_size = real_cpu.size(0)
            label = torch.full((batch_size,), REAL_LABEL, dtype=real_cpu.dtype)
            output = netD(real_cpu)
            errD_real = criterion(output, label)
            errD_real.backward()
            D_x = output.mean().item()
            noise = torch.randn(batch_size, NZ, 1, 1)
            fake = netG(noise)
            label.fill_(FAKE_LABEL)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            errD_fake.backward()
            D_G_z1 = output.mean().item()
            errD = errD_real + errD_fake
            optimizerD.step()
            # (2) Update G network: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(REAL_LABEL)
            output = netD(fake)
            errG = criterion(output, label)
            errG.backward()
            D_G_z2 = output.mean().item()
            optimizerG.step()
            if i % 4 == 0:
                print(f"[{epoch}/{EPOCHS}][{i}/{len(dataloader)}] Loss_D: {errD.item():.4f} "
                      f"Loss_G: {errG.item():.4f} D(x): {D_x:.4f} "
                      f"D(G(z)): {D_G_z1:.4f} / {D_G_z2:.4f}")


def run_salus(address: str, netG: nn.Module, netD: nn.Module, optimizerG: torch.optim.Optimizer,
              optimizerD: torch.optim.Optimizer, dataloader: DataLoader) -> None:
    criterion = nn.BCELoss()
    with salus.connect(name="dcgan", iterations=EPOCHS * len(dataloader),
                       address=address) as job:
        remote = job.attach(netG=netG, netD=netD, optimizerG=optimizerG, optimizerD=optimizerD)

        @remote.iteration
        def train(s, real_cpu):
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            s.netD.zero_grad()
            batch_size = real_cpu.size(0)
            label = torch.full((batch_size,), REAL_LABEL, dtype=real_cpu.dtype)
            output = s.netD(real_cpu)
            errD_real = criterion(output, label)
            errD_real.backward()
            D_x = output.mean().item()
            noise = torch.randn(batch_size, NZ, 1, 1)
            fake = s.netG(noise)
            label.fill_(FAKE_LABEL)
            output = s.netD(fake.detach())
            errD_fake = criterion(output, label)
            errD_fake.backward()
            D_G_z1 = output.mean().item()
            errD = errD_real + errD_fake
            s.optimizerD.step()
            # (2) Update G network: maximize log(D(G(z)))
            s.netG.zero_grad()
            label.fill_(REAL_LABEL)
            output = s.netD(fake)
            errG = criterion(output, label)
            errG.backward()
            D_G_z2 = output.mean().item()
            s.optimizerG.step()
            return errD, errG, D_x, D_G_z1, D_G_z2

        for epoch in range(EPOCHS):
            for i, data in enumerate(dataloader):
                errD, errG, D_x, D_G_z1, D_G_z2 = train(data[0])
                if i % 4 == 0:
                    print(f"[{epoch}/{EPOCHS}][{i}/{len(dataloader)}] Loss_D: {errD.item():.4f} "
                          f"Loss_G: {errG.item():.4f} D(x): {D_x:.4f} "
                          f"D(G(z)): {D_G_z1:.4f} / {D_G_z2:.4f}")
        remote.pull()


def main(address: str | None, out_path: str) -> None:
    torch.manual_seed(4)
    torch.set_num_threads(1)
    strokes = torch.randn(256, 1, 4, 4)
    images = torch.tanh(2 * nn.functional.interpolate(strokes, size=16, mode="bilinear"))
    dataloader = DataLoader(TensorDataset(images), batch_size=32, shuffle=True)
    netG = Generator()
    netG.apply(weights_init)
    netD = Discriminator()
    netD.apply(weights_init)
    optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    if address is None:
        run_direct(netG, netD, optimizerG, optimizerD, dataloader)
    else:
        run_salus(address, netG, netD, optimizerG, optimizerD, dataloader)
    torch.save({"netG": netG.state_dict(), "netD": netD.state_dict(),
                "optimizerG": optimizerG.state_dict(), "optimizerD": optimizerD.state_dict()},
               out_path)


if __name__ == "__main__":
    main(None if sys.argv[1] == "-" else sys.argv[1], sys.argv[2])
