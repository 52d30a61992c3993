"""Hugging Face `Trainer` under `salusd run`: one line in the script.

    import salus.hf
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[salus.hf.SalusCallback()])

After each optimizer step it reports the trainer's own step count (`state.global_step`), its
planned steps (`state.max_steps`: the job's planned iterations, which SRTF reads) and the last
logged loss, which `salusd status` and the job's metrics show; with `SALUS_BOUNDARY=explicit`
each step's end is the job's iteration boundary. Outside salusd it does nothing.
`transformers` is imported here, not by salusd (the `hf` extra: `pip install 'salusd[hf]'`).
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from salus.adapters.torch.script import BOUNDARY_ENV, report, step

__all__ = ["SalusCallback"]


class SalusCallback(TrainerCallback):
    """Tells salusd the trainer's step, planned steps and last logged loss."""

    def __init__(self) -> None:
        self.loss: float | None = None

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        if os.environ.get(BOUNDARY_ENV) == "explicit":
            step()
        report(int(state.global_step), int(state.max_steps) or None, self.loss)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs and isinstance(logs.get("loss"), int | float):
            self.loss = float(logs["loss"])
            report(int(state.global_step), int(state.max_steps) or None, self.loss)
