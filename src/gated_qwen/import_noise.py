"""Import-time warnings that the package's own import, the command and `reproduce`'s workers turn off (standard
library only: it runs before the model stack is imported)."""

import contextlib
import logging
from collections.abc import Iterator

# Loggers of libraries that Transformers imports whenever they are installed (the `quant` extra's torchao) and that
# warn at import time about nothing a user can act on: torchao's C extensions built for another torch, torch's pytree
# on torchao's Enum registrations. Their errors still show.
IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def quiet_import_noise() -> None:
    """The `IMPORT_NOISE` loggers' warnings off in this process (the command and each of `reproduce`'s workers)."""
    for name in IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR)


@contextlib.contextmanager
def import_noise_quieted() -> Iterator[None]:
    """The `IMPORT_NOISE` loggers' warnings off while the block runs (the package's import of the model stack), their
    levels as they were afterwards."""
    loggers = [logging.getLogger(name) for name in IMPORT_NOISE]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.level, logging.ERROR))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
