"""A small Transformer encoder language model, after the PyTorch tutorial "Language Modeling
with nn.TransformerEncoder" (and `word_language_model`'s TransformerModel).

Sinusoidal positional encoding with dropout, `nn.TransformerEncoder` with a causal mask,
`clip_grad_norm_(0.5)`, SGD with `StepLR(1.0, gamma=0.95)` per epoch. The batches are cut from
a seeded token stream with a repeating structure the model can learn.
Run: `python transformer_lm.py ADDRESS|- OUT.pt` (`-` trains directly, without salusd).
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

import salus.adapters.torch as salus

PATTERN = "Transformer encoder LM: causal mask, positional dropout, clip_grad_norm_, StepLR"
SALUS_LINES_CHANGED = 15
EPOCHS = 2
BPTT = 16
NTOKENS = 32


class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, dropout: float = 0.1, max_len: int = 64) -> None:
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, 1, d_model)
        pe[:, 0, 0::2] = torch.sin(position * div_term)
        pe[:, 0, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x + self.pe[:x.size(0)])


class TransformerModel(nn.Module):
    def __init__(self, ntoken: int, d_model: int, nhead: int, d_hid: int, nlayers: int,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.pos_encoder = PositionalEncoding(d_model, dropout)
        layer = nn.TransformerEncoderLayer(d_model, nhead, d_hid, dropout)
        self.transformer_encoder = nn.TransformerEncoder(layer, nlayers,
                                                         enable_nested_tensor=False)
        self.embedding = nn.Embedding(ntoken, d_model)
        self.d_model = d_model
        self.linear = nn.Linear(d_model, ntoken)

    def forward(self, src: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        src = self.embedding(src) * math.sqrt(self.d_model)
        src = self.pos_encoder(src)
        return self.linear(self.transformer_encoder(src, src_mask))


def token_stream(length: int) -> torch.Tensor:
    motifs = torch.randint(0, NTOKENS, (6, 5))
    picks = torch.randint(0, 6, (length // 5 + 1,))
    return motifs[picks].flatten()[:length]


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    seq_len = data.size(0) // bsz
    return data[:seq_len * bsz].view(bsz, seq_len).t().contiguous()


def get_batch(source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = min(BPTT, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


def run_direct(model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.StepLR, train_data: torch.Tensor) -> None:
    criterion = nn.CrossEntropyLoss()
    num_batches = len(range(0, train_data.size(0) - 1, BPTT))
    for epoch in range(1, EPOCHS + 1):
        model.train()
        total_loss = 0.0
        for i in range(0, train_data.size(0) - 1, BPTT):
            data, targets = get_batch(train_data, i)
            src_mask = nn.Transformer.generate_square_subsequent_mask(data.size(0))
            output = model(data, src_mask)
            loss = criterion(output.view(-1, NTOKENS), targets)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            total_loss += loss.item()
        print(f"epoch {epoch}: loss {total_loss / num_batches:.3f}, "
              f"lr {scheduler.get_last_lr()[0]:.3f}")
        scheduler.step()


def run_salus(address: str, model: nn.Module, optimizer: torch.optim.Optimizer,
              scheduler: torch.optim.lr_scheduler.StepLR, train_data: torch.Tensor) -> None:
    criterion = nn.CrossEntropyLoss()
    num_batches = len(range(0, train_data.size(0) - 1, BPTT))
    with salus.connect(name="transformer-lm", iterations=EPOCHS * num_batches,
                       address=address) as job:
        remote = job.attach(model=model, optimizer=optimizer, scheduler=scheduler)

        @remote.iteration
        def train(s, data, targets, src_mask):
            s.model.train()
            output = s.model(data, src_mask)
            loss = criterion(output.view(-1, NTOKENS), targets)
            s.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(s.model.parameters(), 0.5)
            s.optimizer.step()
            return loss

        for epoch in range(1, EPOCHS + 1):
            total_loss = 0.0
            for i in range(0, train_data.size(0) - 1, BPTT):
                data, targets = get_batch(train_data, i)
                src_mask = nn.Transformer.generate_square_subsequent_mask(data.size(0))
                loss = train(data, targets, src_mask)
                total_loss += loss.item()
            lr = remote.call(lambda s: s.scheduler.get_last_lr()[0])
            print(f"epoch {epoch}: loss {total_loss / num_batches:.3f}, lr {lr:.3f}")
            remote.call(lambda s: s.scheduler.step())
        remote.pull()


def main(address: str | None, out_path: str) -> None:
    torch.manual_seed(11)
    torch.set_num_threads(1)
    train_data = batchify(token_stream(1600), 8)
    model = TransformerModel(NTOKENS, d_model=32, nhead=4, d_hid=64, nlayers=2, dropout=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1.0, gamma=0.95)
    if address is None:
        run_direct(model, optimizer, scheduler, train_data)
    else:
        run_salus(address, model, optimizer, scheduler, train_data)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, out_path)


if __name__ == "__main__":
    main(None if sys.argv[1] == "-" else sys.argv[1], sys.argv[2])
