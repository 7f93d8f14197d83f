"""Hushing library logs for the length of a block, where pipemap knows the warning is noise; and the one lock for
library code patched process-wide (``PATCHING``)."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

# accelerate's ``init_empty_weights`` (a dry run's stand-in models, the catalog's skeletons, diffusers' and
# transformers' own loading) swaps ``torch.nn.Module.register_parameter`` process-wide while it builds, and a dry run
# patches pipeline code (``dryrun.patches``): a load beside either could get meta weights, and two swaps interleaved
# can leave the swap in place. Loads (``dispatch.loading``), dry runs (``dryrun.run``) and skeletons (``catalog``)
# take turns on this lock (re-entrant, so a thread already holding it never waits for itself)
PATCHING = threading.RLock()

# Lines libraries log when pipemap imports them that tell its user nothing, each by its logger and its words:
# torchao's CUDA kernels (``_C_mxfp8``, ``_C_cutlass_90a``) fail to load on a CPU build of torch, as they must (on
# a CUDA build that would be a real failure, and is shown); torchao registers enums that torch now handles itself;
# transformers falls back to the PIL image processors without torchvision, which pipemap's pipelines use anyway;
# diffusers (0.42) looks for tensor classes torchao 0.16+ moved (``torchao.dtypes.NF4Tensor``) at every import of its
# torchao quantizer, with or without a torchao checkpoint in sight (loading one still fails loudly if it fails).
NOISE = (
    ("torchao", "Failed to load"),
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),
    ("transformers.utils.import_utils", "requires torchvision (not installed)"),
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects"),
)


class _Noise(logging.Filter):
    def __init__(self, words: str):
        super().__init__()
        self.words = words

    def filter(self, record: logging.LogRecord) -> bool:
        if self.words not in record.getMessage() or record.levelno >= logging.ERROR:
            return True
        if self.words == "Failed to load":  # torchao's kernels: noise only where torch has no CUDA to run them
            torch = sys.modules.get("torch")
            return torch is not None and getattr(torch.version, "cuda", None) is not None
        return False


def quiet_imports() -> None:
    """Drop the ``NOISE`` lines (each a filter on its own logger; everything else they log still shows). Called
    when pipemap is imported, before any of those libraries is: the standard library's logging only."""
    for name, words in NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Noise) and f.words == words for f in logger.filters):
            logger.addFilter(_Noise(words))


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
