"""The script API (`salus.adapters.script`) under the torch adapter's name: the same functions,
so `salus.adapters.torch.step()` and `salus.adapters.script.step()` reach one boundary."""

from __future__ import annotations

from salus.adapters.script import BOUNDARY_ENV, RESUME_ENV, report, resume_dir, step, under_salusd

__all__ = ["BOUNDARY_ENV", "RESUME_ENV", "report", "resume_dir", "step", "under_salusd"]
