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
