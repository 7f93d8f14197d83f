"""Hushing library logs for the length of a block, where pipemap knows the warning is noise."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def quiet_diffusers() -> Iterator[None]:
    """Raise diffusers' log level to ERROR inside the block, and put it back after."""
    from diffusers.utils import logging

    with _quiet(logging):
        yield


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Raise transformers' log level to ERROR inside the block, and put it back after."""
    from transformers.utils import logging

    with _quiet(logging):
        yield


@contextlib.contextmanager
def _quiet(logging: Any) -> Iterator[None]:  # diffusers' and transformers' logging modules share these calls
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Hide diffusers' and transformers' own progress bars inside the block (pipemap shows one of its own), and
    put each back as it was."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    libraries = [lib for lib in (diffusers_logging, transformers_logging) if lib.is_progress_bar_enabled()]
    for lib in libraries:
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib in libraries:
            lib.enable_progress_bar()
