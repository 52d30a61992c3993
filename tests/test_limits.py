"""One set of request limits: the socket front end's checks, the REST models and the CLI's
options refuse the same values with the same words (`salus.daemon.limits`)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from salus.daemon.cli import main as cli
from salus.daemon.limits import check_iterations, check_name, check_priority
from salus.daemon.rest.models import JobSubmit, Priority
from salus.daemon.wire.errors import BadRequest

# Values at and around each bound, written out by hand: (value, accepted).
PRIORITIES = [(1e-300, True), (1.0, True), (999_999_999_999.9, True), (0.0, False),
              (-1.0, False), (1e12, False), (math.inf, False)]
ITERATIONS = [(1, True), (2**53, True), (0, False), (2**53 + 1, False), (-5, False)]
NAMES = [("a", True), ("x" * 200, True), ("", False), ("x" * 201, False), ("a\x07b", False),
         ("a\u200bb", False)]


def _socket_says(check: object, value: object) -> str | None:
    try:
        check(value)  # type: ignore[operator]
    except BadRequest as exc:
        return str(exc)
    return None


def _rest_says(field: str, value: object) -> str | None:
    body = {"name": "n", "entrypoint": "train.py:make", "iterations": 3, field: value}
    try:
        JobSubmit.model_validate(body)
    except ValidationError as exc:
        (error,) = exc.errors()
        assert error["loc"] == (field,)
        return str(error["msg"]).removeprefix("Value error, ")
    return None


def _cli_says(option: str, value: object, capsys: pytest.CaptureFixture[str]) -> str | None:
    with _maybe_exit() as exited:
        cli.build_parser().parse_args(["run", option, str(value), "--", "python", "t.py"])
    if not exited.code:
        return None
    return capsys.readouterr().err.strip().splitlines()[-1]


class _maybe_exit:
    """Catches argparse's usage error (SystemExit 2) and keeps its code (0: none)."""

    code = 0

    def __enter__(self) -> _maybe_exit:
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> bool:
        if isinstance(exc, SystemExit):
            self.code = int(exc.code or 0)
            return True
        return False


@pytest.mark.parametrize(("value", "accepted"), PRIORITIES)
def test_priority_is_one_rule(value: float, accepted: bool,
                              capsys: pytest.CaptureFixture[str]) -> None:
    said = _socket_says(check_priority, value)
    assert (said is None) == accepted
    rest_said = _rest_says("priority", value)
    if math.isfinite(value):
        assert rest_said == said
    else:  # JSON's Infinity is refused before any field's check, as every number of a body
        assert rest_said == "Input should be a finite number"
    try:
        Priority.model_validate({"priority": value})
        assert accepted
    except ValidationError as exc:
        assert said is not None and (said in str(exc) or not math.isfinite(value))
    cli_said = _cli_says("--priority", value, capsys)
    assert (cli_said is None) == accepted
    if said is not None:
        assert cli_said is not None and said in cli_said


@pytest.mark.parametrize(("value", "accepted"), ITERATIONS)
def test_iterations_is_one_rule(value: int, accepted: bool,
                                capsys: pytest.CaptureFixture[str]) -> None:
    said = _socket_says(check_iterations, value)
    assert (said is None) == accepted
    assert _rest_says("iterations", value) == said
    cli_said = _cli_says("--iterations", value, capsys)
    if said is not None:
        assert cli_said is not None and said in cli_said
    else:
        assert cli_said is None


@pytest.mark.parametrize(("value", "accepted"), NAMES)
def test_name_is_one_rule(value: str, accepted: bool,
                          capsys: pytest.CaptureFixture[str]) -> None:
    said = _socket_says(check_name, value)
    assert (said is None) == accepted
    assert _rest_says("name", value) == said
    if value:  # argparse would take an empty value for a missing one
        cli_said = _cli_says("--name", value, capsys)
        assert (cli_said is None) == accepted
        if said is not None:
            assert cli_said is not None and said.split(";")[0] in cli_said


def test_priority_refuses_what_is_not_a_number() -> None:
    for value in (True, "2", None, [1]):
        assert _socket_says(check_priority, value) == (
            f"priority must be a number in (0, 1e12), got {value!r}")
