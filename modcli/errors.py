"""Errors that the command line turns into one red line and an exit code, without a traceback."""


class ReportedError(Exception):
    """A failure the command line reports as one red line on stderr and `exit_code`, without a traceback."""

    exit_code = 1


class UserError(ReportedError):
    """A mistake in what the user asked for (bad flag, missing file, wrong checkpoint): exit code 2."""

    exit_code = 2


class TrainingDiverged(ReportedError):
    """The loss became NaN or inf; the last good checkpoint is kept: exit code 3."""

    exit_code = 3


class WriteFailed(ReportedError):
    """A file could not be written (disk full, no permission); what was saved before is intact: exit code 1."""

    exit_code = 1
