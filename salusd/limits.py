"""Every bound a job request must respect, and the checks of the fields every client sends.

One module, so that the unix-socket front end (`frontend/handlers.py`), the engine, the REST
models (`rest/models.py`: pydantic validators that call these same functions) and `salusd run`'s
options (`cli/run.py`) accept the same values and refuse the others with the same words; the
commands that go through REST (`salusd submit`, `salusd priority`) print the REST models'
answer. It imports nothing of the engine and no torch: `salusd run` loads it at start.

The checks raise `BadRequest`, which the socket front end answers as it is; the REST models
turn it into pydantic's ValueError (`as_value_error`), which FastAPI answers with 422 naming
the field; the CLI into argparse's usage error (`argument`).
"""

from __future__ import annotations

import argparse
import unicodedata
from collections.abc import Callable
from typing import TypeVar

from salus.daemon.wire.errors import BadRequest

MAX_ITERATIONS = 2**53  # a planned count; also what a job that gave none is planned for
MAX_NAME_CHARS = 200
MAX_PRIORITY = 1e12  # a priority is a number in (0, MAX_PRIORITY)
DEFAULT_PRIORITY = 1.0
MAX_PATH_CHARS = 4096  # a working directory or an interpreter's path
MAX_ARGS = 4096  # a script job's command: its interpreter and arguments
MAX_ENV_BYTES = 1 << 20  # a script job's environment, names and values together
MAX_RESTARTS = 3  # the default: as many as a Kubernetes Job's backoffLimit would allow, about
MAX_RESTARTS_LIMIT = 1000
MAX_TIME_LIMIT_S = 366 * 86400.0
MAX_GRACE_S = 3600.0  # a job's own grace; a stopping salusd waits at most its --script-grace
MAX_MEM_BYTES = 2**50
MAX_ARRAY_INDEX = 2**31 - 1
MAX_AFTER = 64  # jobs one job may wait for (--after)
MAX_JOB_ID = 2**63 - 1
MAX_DEVICES = 1024  # replicas of a gang on one node, and nodes of a cluster

# Unicode categories a job name may not hold: control, format, surrogate, private use,
# unassigned, line and paragraph separators.
_UNPRINTABLE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})

T = TypeVar("T")


def check_name(name: object) -> str:
    """A job name: a string of 1-200 printable characters (no control or format characters,
    no lone surrogates). BadRequest says what is wrong."""
    if not isinstance(name, str) or not name:
        raise BadRequest("a job name must be a non-empty string")
    if len(name) > MAX_NAME_CHARS:
        raise BadRequest(f"a job name has at most {MAX_NAME_CHARS} characters, got {len(name)}")
    for ch in name:
        if unicodedata.category(ch) in _UNPRINTABLE:
            raise BadRequest(f"a job name may hold printable characters only; {ch!r} "
                             f"(U+{ord(ch):04X}) is not")
    return name


def check_iterations(iterations: object) -> int:
    """A planned iteration count: an int in [1, 2**53]."""
    if type(iterations) is not int or not 1 <= iterations <= MAX_ITERATIONS:
        raise BadRequest(f"iterations must be an integer from 1 to 2**53, got "
                         f"{str(iterations)[:40]!r}")
    return iterations


def check_priority(priority: object) -> float:
    """A job's scheduling weight under the fair policy: a number in (0, 1e12), as a float."""
    if isinstance(priority, bool) or not isinstance(priority, int | float) or not (
            0 < priority < MAX_PRIORITY):
        raise BadRequest(f"priority must be a number in (0, 1e12), got {priority!r}")
    return float(priority)


def as_value_error(check: Callable[[object], T], value: object) -> T:
    """`check(value)` for a pydantic validator: its BadRequest becomes the ValueError pydantic
    reports (as a 422 that names the field), with the same text."""
    try:
        return check(value)
    except BadRequest as exc:
        raise ValueError(str(exc)) from None


def argument(check: Callable[[object], T], parse: Callable[[str], object] = str
             ) -> Callable[[str], T]:
    """An argparse `type` that parses an option's text with `parse` (int, float) and checks it
    with `check`: a bad value is argparse's usage error, with the check's words."""
    def convert(text: str) -> T:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid "
                                             f"{getattr(parse, '__name__', 'value')}") from None
        try:
            return check(value)
        except BadRequest as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = check.__name__.removeprefix("check_")
    return convert
