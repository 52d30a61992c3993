"""salusd package."""

from importlib.metadata import PackageNotFoundError, version


def installed_version() -> str:
    """The installed salusd distribution's version ("unknown" where it is not installed)."""
    try:
        return version("salusd")
    except PackageNotFoundError:
        return "unknown"
