"""Tokenizer-style dict batches and a model that returns a `ModelOutput`-like object.

Written the way Hugging Face fine-tuning loops are: `batch = tokenizer(texts, padding=True,
return_tensors="pt")`, `batch["labels"] = labels`, `outputs = model(**batch)`, then
`outputs.loss` and `outputs.logits`. `transformers` is not needed: a tiny word tokenizer and an
OrderedDict-based dataclass output (as `transformers.utils.ModelOutput` is) stand in for it.
Run: `python dict_batch_output.py ADDRESS|- OUT.pt` (`-` trains directly, without salusd).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass, fields

import torch
from torch import nn

import salus.adapters.torch as salus

PATTERN = "dict batches from a tokenizer, model(**batch) returns a ModelOutput (loss, logits)"
SALUS_LINES_CHANGED = 12
EPOCHS = 3
WORDS = ["good", "bad", "movie", "plot", "the", "was", "great", "awful", "acting", "fine"]


@dataclass
class SequenceClassifierOutput(OrderedDict):
    """Like `transformers.modeling_outputs.SequenceClassifierOutput`: a dict and a dataclass."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value


class WordTokenizer:
    def __init__(self, words: list[str]) -> None:
        self.vocab = {"[PAD]": 0, "[CLS]": 1, **{w: i + 2 for i, w in enumerate(words)}}

    def __call__(self, texts: list[str], padding: bool = True,
                 return_tensors: str = "pt") -> dict[str, torch.Tensor]:
        ids = [[1, *(self.vocab[w] for w in text.split())] for text in texts]
        width = max(len(row) for row in ids)
        return {
            "input_ids": torch.tensor([row + [0] * (width - len(row)) for row in ids]),
            "attention_mask": torch.tensor([[1] * len(row) + [0] * (width - len(row))
                                            for row in ids]),
        }


class BagOfEmbeddingsClassifier(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(vocab_size, hidden, padding_idx=0)
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor | None = None) -> SequenceClassifierOutput:
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embeddings(input_ids) * mask).sum(1) / mask.sum(1)
        logits = self.classifier(self.dropout(torch.tanh(pooled)))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


def synthetic_reviews(n: int) -> tuple[list[str], torch.Tensor]:
    texts, labels = [], []
    for _ in range(n):
        length = int(torch.randint(3, 9, ()))
        words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (length,))]
        texts.append(" ".join(words))
        score = sum(w in ("good", "great", "fine") for w in words) - sum(
            w in ("bad", "awful") for w in words)
        labels.append(int(score > 0))
    return texts, torch.tensor(labels)


def run_direct(model: nn.Module, optimizer: torch.optim.Optimizer, tokenizer: WordTokenizer,
               texts: list[str], labels: torch.Tensor) -> None:
    model.train()
    for epoch in range(EPOCHS):
        correct = 0
        for start in range(0, len(texts), 16):
            batch = tokenizer(texts[start:start + 16], padding=True, return_tensors="pt")
            batch["labels"] = labels[start:start + 16]
            outputs = model(**batch)
            loss = outputs.loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            correct += (outputs.logits.argmax(-1) == batch["labels"]).sum().item()
        print(f"epoch {epoch}: loss {loss.item():.4f}, train accuracy {correct / len(texts):.3f}")


def run_salus(address: str, model: nn.Module, optimizer: torch.optim.Optimizer,
              tokenizer: WordTokenizer, texts: list[str], labels: torch.Tensor) -> None:
    model.train()
    iterations = EPOCHS * len(range(0, len(texts), 16))
    with salus.connect(name="dict-batch", iterations=iterations, address=address) as job:
        remote = job.attach(model=model, optimizer=optimizer)

        @remote.iteration
        def train(s, batch):
            outputs = s.model(**batch)
            loss = outputs.loss
            loss.backward()
            s.optimizer.step()
            s.optimizer.zero_grad()
            return outputs

        for epoch in range(EPOCHS):
            correct = 0
            for start in range(0, len(texts), 16):
                batch = tokenizer(texts[start:start + 16], padding=True, return_tensors="pt")
                batch["labels"] = labels[start:start + 16]
                outputs = train(batch)
                loss = outputs.loss
                correct += (outputs.logits.argmax(-1) == batch["labels"]).sum().item()
            print(f"epoch {epoch}: loss {loss.item():.4f}, "
                  f"train accuracy {correct / len(texts):.3f}")
        remote.pull()


def main(address: str | None, out_path: str) -> None:
    torch.manual_seed(7)
    torch.set_num_threads(1)
    tokenizer = WordTokenizer(WORDS)
    texts, labels = synthetic_reviews(256)
    model = BagOfEmbeddingsClassifier(len(tokenizer.vocab), 32, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    if address is None:
        run_direct(model, optimizer, tokenizer, texts, labels)
    else:
        run_salus(address, model, optimizer, tokenizer, texts, labels)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, out_path)


if __name__ == "__main__":
    main(None if sys.argv[1] == "-" else sys.argv[1], sys.argv[2])
