"""A rich progress bar over a job's rounds, on stderr (stdout stays free for results)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from .job import RoundRecord


@contextmanager
def round_progress(rounds: int, description: str) -> Iterator[Callable[[RoundRecord], None]]:
    """Show a bar of `rounds` rounds; yields the ``on_round`` callback to pass to `run`.

    The bar shows the latest global training loss (nats per sample) and test accuracy.
    """
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}  acc {task.fields[accuracy]:.3f}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True)) as progress:
        bar = progress.add_task(description, total=rounds, loss=float("nan"), accuracy=0.0)

        def on_round(record: RoundRecord) -> None:
            progress.update(
                bar,
                completed=record.round,
                loss=record.train_loss,
                accuracy=record.test_accuracy,
            )

        yield on_round
