"""The conversion's two errors (standard library only, so the command line can name them without the model stack).
The command line prints either as one line: `ConversionError` exits with 2 (refused), `VerificationError` with 1."""


class ConversionError(ValueError):
    """A checkpoint, a flag or a destination that cannot be converted as asked; the message says why."""


class VerificationError(ConversionError):
    """The converted model's logits differ from the source's beyond the stated tolerance."""

    exit_code = 1
