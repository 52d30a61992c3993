"""A Hugging Face `Trainer` on a tiny BERT built from a config (no downloads) and seeded data;
`--callback` adds salus.hf.SalusCallback. Saves the model to argv[1]."""

import sys

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

torch.manual_seed(0)
config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=32, max_position_embeddings=32, num_labels=2)
model = BertForSequenceClassification(config)
generator = torch.Generator().manual_seed(1)
ids = torch.randint(0, 64, (64, 12), generator=generator)
labels = torch.randint(0, 2, (64,), generator=generator)
data = [{"input_ids": i, "labels": label} for i, label in zip(ids, labels, strict=True)]
callbacks = []
if "--callback" in sys.argv:
    import salus.hf
    callbacks.append(salus.hf.SalusCallback())
args = TrainingArguments(output_dir="hf-out", max_steps=12, per_device_train_batch_size=8,
                         learning_rate=1e-3, logging_steps=4, save_strategy="no",
                         report_to="none", use_cpu=True, seed=0, disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()
torch.save(model.state_dict(), sys.argv[1])
