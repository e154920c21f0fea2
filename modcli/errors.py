"""Errors that the command line turns into one red line and an exit code, without a traceback."""


class UserError(Exception):
    """A mistake in what the user asked for (bad flag, missing file, wrong checkpoint): exit code 2."""

    exit_code = 2


class TrainingDiverged(Exception):
    """The loss became NaN or inf; the last good checkpoint is kept: exit code 3."""

    exit_code = 3
