"""An LSTM language model, after pytorch/examples `word_language_model/main.py`.

The example's loop: batchify a token stream, truncated BPTT with the hidden state carried (and
detached) from batch to batch, `clip_grad_norm_`, a hand-written SGD update, and the learning
rate divided by 4 when the validation loss stops improving. A seeded Markov chain over a small
vocabulary stands in for Wikitext-2. Through salusd the hidden state travels with each call.
Run: `python lstm_lm.py ADDRESS|- OUT.pt` (`-` trains directly, without salusd).
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

import salus.adapters.torch as salus

PATTERN = "LSTM LM: truncated BPTT carrying the hidden state, clip_grad_norm_, manual SGD, lr/4"
SALUS_LINES_CHANGED = 20
EPOCHS = 3
BPTT = 12
CLIP = 0.25
NTOKENS = 40


class RNNModel(nn.Module):
    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, input: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.decoder.out_features)
        return torch.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                weight.new_zeros(self.nlayers, bsz, self.nhid))


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def markov_corpus(length: int) -> torch.Tensor:
    transitions = torch.softmax(3 * torch.randn(NTOKENS, NTOKENS), dim=1)
    tokens = [0]
    for _ in range(length - 1):
        tokens.append(int(torch.multinomial(transitions[tokens[-1]], 1)))
    return torch.tensor(tokens)


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = data.size(0) // bsz
    return data.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous()


def get_batch(source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = min(BPTT, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


def run_direct(model: RNNModel, train_data: torch.Tensor, val_data: torch.Tensor,
               lr: float) -> None:
    criterion = nn.NLLLoss()
    best_val_loss = None
    for epoch in range(1, EPOCHS + 1):
        model.train()
        hidden = model.init_hidden(train_data.size(1))
        for i in range(0, train_data.size(0) - 1, BPTT):
            data, targets = get_batch(train_data, i)
            hidden = repackage_hidden(hidden)
            model.zero_grad()
            output, hidden = model(data, hidden)
            loss = criterion(output, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
        model.eval()
        total_loss = 0.0
        hidden = model.init_hidden(val_data.size(1))
        with torch.no_grad():
            for i in range(0, val_data.size(0) - 1, BPTT):
                data, targets = get_batch(val_data, i)
                output, hidden = model(data, hidden)
                total_loss += len(data) * criterion(output, targets).item()
        val_loss = total_loss / (len(val_data) - 1)
        print(f"epoch {epoch}: valid loss {val_loss:.3f}, ppl {math.exp(val_loss):.2f}, lr {lr}")
        if not best_val_loss or val_loss < best_val_loss:
            best_val_loss = val_loss
        else:
            lr /= 4.0


def run_salus(address: str, model: RNNModel, train_data: torch.Tensor, val_data: torch.Tensor,
              lr: float) -> None:
    criterion = nn.NLLLoss()
    best_val_loss = None
    steps = EPOCHS * len(range(0, train_data.size(0) - 1, BPTT))
    with salus.connect(name="lstm-lm", iterations=steps, address=address) as job:
        remote = job.attach(model=model)

        @remote.iteration
        def train(s, data, targets, hidden, lr):
            s.model.train()
            hidden = repackage_hidden(hidden)
            s.model.zero_grad()
            output, hidden = s.model(data, hidden)
            loss = criterion(output, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(s.model.parameters(), CLIP)
            for p in s.model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            return hidden

        @remote.function
        def evaluate(s, data, targets, hidden):
            s.model.eval()
            with torch.no_grad():
                output, hidden = s.model(data, hidden)
                return criterion(output, targets).item(), hidden

        for epoch in range(1, EPOCHS + 1):
            hidden = model.init_hidden(train_data.size(1))
            for i in range(0, train_data.size(0) - 1, BPTT):
                data, targets = get_batch(train_data, i)
                hidden = train(data, targets, hidden, lr)
            total_loss = 0.0
            hidden = model.init_hidden(val_data.size(1))
            for i in range(0, val_data.size(0) - 1, BPTT):
                data, targets = get_batch(val_data, i)
                loss, hidden = evaluate(data, targets, hidden)
                total_loss += len(data) * loss
            val_loss = total_loss / (len(val_data) - 1)
            print(f"epoch {epoch}: valid loss {val_loss:.3f}, ppl {math.exp(val_loss):.2f}, "
                  f"lr {lr}")
            if not best_val_loss or val_loss < best_val_loss:
                best_val_loss = val_loss
            else:
                lr /= 4.0
        remote.pull()


def main(address: str | None, out_path: str) -> None:
    torch.manual_seed(3)
    torch.set_num_threads(1)
    corpus = markov_corpus(3000)
    train_data = batchify(corpus[:2400], 10)
    val_data = batchify(corpus[2400:], 5)
    model = RNNModel(NTOKENS, 32, 32, 2, dropout=0.2)
    if address is None:
        run_direct(model, train_data, val_data, lr=20.0)
    else:
        run_salus(address, model, train_data, val_data, lr=20.0)
    torch.save({"model": model.state_dict()}, out_path)


if __name__ == "__main__":
    main(None if sys.argv[1] == "-" else sys.argv[1], sys.argv[2])
