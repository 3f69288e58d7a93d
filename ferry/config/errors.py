"""User-facing errors.

A `UserError` is bad input from the person running ferry (a config, a data path,
a checkpoint, a command line). The CLI prints its message without a traceback
and exits with code 2; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input that the user can fix; reported as one message, exit code 2."""

    exit_code = 2


class ConfigError(UserError):
    """A configuration value, file or override that cannot be accepted."""


def first_problem(exc) -> str:
    """`where: what` of the first error of a pydantic `ValidationError`: the dotted field and its message,
    for a one-line refusal of a file ferry reads (a manifest, a record, a lineage)."""
    first = exc.errors()[0]
    return f"{'.'.join(str(part) for part in first['loc']) or '<top level>'}: {first['msg']}"
