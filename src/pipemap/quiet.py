"""Hushing library logs for the length of a block, where pipemap knows the warning is noise."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def quiet_diffusers():
    """Raise diffusers' log level to ERROR inside the block, and put it back after."""
    from diffusers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)
