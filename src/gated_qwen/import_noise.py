"""Import-time warnings that the command and `reproduce`'s workers turn off (standard library only: a worker runs this
before it imports the model stack)."""

import logging

# Loggers of libraries that Transformers imports whenever they are installed (the `quant` extra's torchao) and that
# warn at import time about nothing a user of the command can act on: torchao's C extensions built for another torch,
# torch's pytree on torchao's Enum registrations. Their errors still show.
IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def quiet_import_noise() -> None:
    """The `IMPORT_NOISE` loggers' warnings off in this process (the command and each of `reproduce`'s workers)."""
    for name in IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR)
