"""A job's lifecycle (`salusd/engine/lifecycle.py`): its transitions are the only writers of
its phase and flags, and an ended job changes no more."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from salus.daemon.engine.lifecycle import Lifecycle, Phase

STEPS = ("attached", "estimating", "submitted", "reopened", "suspend", "suspend_swap", "resume",
         "await_client", "client_back", "swapped_out", "end")


def _apply(life: Lifecycle, step: str) -> None:
    if step == "end":
        life.end("cancelled", "asked to", 1.0, 2.0)
    elif step == "suspend_swap":
        life.suspend(swap=True)
    elif step == "suspend":
        life.suspend(swap=False)
    else:
        getattr(life, step)()


def test_a_suspend_with_swap_is_asked_of_a_submitted_job_and_resume_brings_it_back() -> None:
    life = Lifecycle()
    life.suspend(swap=True)  # not the scheduler's yet: nothing to swap
    assert life.held and not life.swap_requested
    life.resume()
    life.submitted()
    life.suspend(swap=True)
    assert life.held and life.swap_requested
    life.swapped_out()
    assert life.swapped and not life.swap_requested
    life.resume()
    assert not (life.held or life.swapped or life.swap_requested)


def test_an_ended_job_takes_no_other_phase() -> None:
    life = Lifecycle()
    life.end("failed", "it raised", 3.0, 4.0)
    assert not life.live and life.phase is Phase.ENDED
    assert (life.end_state, life.reason, life.ended_s, life.ended_at) == (
        "failed", "it raised", 3.0, 4.0)
    for step in ("attached", "estimating", "submitted", "reopened"):
        with pytest.raises(AssertionError, match="ended job"):
            getattr(life, step)()
    assert life.end_state == "failed"


@settings(max_examples=1000)
@given(st.lists(st.sampled_from(STEPS), max_size=30))
def test_any_sequence_of_transitions_keeps_the_flags_consistent(steps: list[str]) -> None:
    """Whatever is asked in whatever order: a swap is asked only of a held job (and only by a
    suspend with swap); once ended, the end stays as it was first said."""
    life = Lifecycle()
    ended: tuple[object, ...] | None = None
    for step in steps:
        asked = life.swap_requested
        try:
            _apply(life, step)
        except AssertionError:
            assert ended is not None  # only an ended job refuses a transition
            continue
        if step == "swapped_out":
            assert life.swapped
        if step == "end":
            ended = ended or (life.end_state, life.reason)
        if life.swap_requested:
            assert life.held and (asked or step == "suspend_swap")
        if ended is not None:
            assert not life.live and (life.end_state, life.reason) == ended
