"""Hushing library logs for a block (``pipemap.quiet``): raised inside, put back after, an exception or not."""

from __future__ import annotations

import pytest
from diffusers.utils import logging as diffusers_logging
from transformers.utils import logging as transformers_logging

from pipemap.quiet import quiet_diffusers, quiet_progress

LIBRARIES = (diffusers_logging, transformers_logging)


@pytest.fixture
def settings():
    """The libraries' settings as the test found them, put back after it (conftest hushes them for the session)."""
    level = diffusers_logging.get_verbosity()
    bars = [lib.is_progress_bar_enabled() for lib in LIBRARIES]
    yield
    diffusers_logging.set_verbosity(level)
    for lib, enabled in zip(LIBRARIES, bars):
        (lib.enable_progress_bar if enabled else lib.disable_progress_bar)()


def test_quiet_diffusers_raises_the_level_to_error_and_puts_it_back(settings):
    diffusers_logging.set_verbosity_info()
    with quiet_diffusers():
        assert diffusers_logging.get_verbosity() == diffusers_logging.ERROR
    assert diffusers_logging.get_verbosity() == diffusers_logging.INFO
    with pytest.raises(KeyError), quiet_diffusers():
        raise KeyError("boom")
    assert diffusers_logging.get_verbosity() == diffusers_logging.INFO


def test_quiet_progress_hides_both_libraries_bars_and_shows_them_again(settings):
    for lib in LIBRARIES:
        lib.enable_progress_bar()
    with quiet_progress():
        assert not any(lib.is_progress_bar_enabled() for lib in LIBRARIES)
    assert all(lib.is_progress_bar_enabled() for lib in LIBRARIES)
    with pytest.raises(KeyError), quiet_progress():
        raise KeyError("boom")
    assert all(lib.is_progress_bar_enabled() for lib in LIBRARIES)


def test_quiet_progress_leaves_a_hidden_bar_hidden(settings):
    diffusers_logging.enable_progress_bar()
    transformers_logging.disable_progress_bar()
    with quiet_progress():
        pass
    assert diffusers_logging.is_progress_bar_enabled() and not transformers_logging.is_progress_bar_enabled()


def test_import_noise_is_dropped_and_the_rest_of_those_loggers_still_shows(caplog):
    import logging

    import torch

    import pipemap  # noqa: F401  (its import installs the filters: quiet.quiet_imports)

    caplog.set_level(logging.WARNING)
    pytree, torchao = logging.getLogger("torch.utils._pytree"), logging.getLogger("torchao")
    pytree.warning("<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile")
    pytree.warning("another warning")
    pytree.error("<enum 'X'> is an Enum subclass and is now natively supported (an error: kept)")
    torchao.warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
    logging.getLogger("transformers.utils.import_utils").warning(
        "`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil`")
    logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").warning(
        "Unable to import `torchao` Tensor objects. This may affect loading checkpoints serialized with `torchao`")
    shown = [r.getMessage() for r in caplog.records]
    cuda_build = torch.version.cuda is not None  # there the kernels should load: a failure is news
    assert shown == ["another warning", "<enum 'X'> is an Enum subclass and is now natively supported (an error: "
                     "kept)"] + (["Failed to load /x/torchao/_C_mxfp8.so: Could not load this library"]
                               if cuda_build else [])
