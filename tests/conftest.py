"""Shared fixtures: tiny pipelines built in code, saved once per session with save_pretrained."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the ranks of a split denoiser run as worker processes by default (``ranks="auto"``); a test that is not about them
# runs them as threads (a spawned worker imports torch and diffusers: seconds on 2 cores). The tests of the worker
# path ask for processes by name (``ranks="process"``) or take this setting out (tests/hooks/test_ranks.py)
os.environ.setdefault("PIPEMAP_WORKERS", "thread")
# The suite never reads the user's caches (``pipemap doctor``'s disk.json, transfers.json, counts/, the Hub's files):
# each test process gets empty ones, set before huggingface_hub reads HF_HOME at its import. A test that means to
# read a cache writes it first.
_CACHES = tempfile.mkdtemp(prefix="pipemap-test-caches-")
atexit.register(shutil.rmtree, _CACHES, True)
os.environ["PIPEMAP_CACHE_DIR"] = os.path.join(_CACHES, "pipemap")
os.environ["HF_HOME"] = os.path.join(_CACHES, "hf")

import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers.utils import logging as diffusers_logging  # noqa: E402
from huggingface_hub import constants as hub_constants  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

import pipemap  # noqa: E402
from helpers import moving, plain_pipeline  # noqa: E402
from pipemap import tiny  # noqa: E402


@pytest.fixture(autouse=True)
def _a_ledger_of_its_own(monkeypatch):
    """Each test's placed pipelines share a memory ledger of their own. The process's one ledger (issue 39: placed
    pipelines never exceed a GPU together) would otherwise count a pipeline an earlier test on the same worker left
    placed and not yet collected: its 5 MiB GPUs shrank the next test's room (a CI run, ordered by xdist)."""
    from pipemap.runtime import admission

    monkeypatch.setattr(admission, "_SHARED", [])


@pytest.fixture(autouse=True, scope="module")
def _a_module_ledger_of_its_own():
    """The same for a module's own fixtures (a served pipeline, module-scoped): they are set up before the function
    fixture above, so without this one a service joined the ledger of whatever test ran before it on the worker, and
    a pipeline that test left placed on 5 MiB GPUs shrank the service's room (test_app's first test answered 400
    insufficient_memory, in a full run ordered by xdist)."""
    from pipemap.runtime import admission

    saved = admission._SHARED
    admission._SHARED = []
    yield
    admission._SHARED = saved


torch.set_num_threads(1)
hub_constants.HF_HOME = os.environ["HF_HOME"]  # in case a plugin imported huggingface_hub before this file ran
diffusers_logging.set_verbosity_error()
diffusers_logging.disable_progress_bar()
transformers_logging.set_verbosity_error()
transformers_logging.disable_progress_bar()


def pytest_collection_finish(session) -> None:
    """Move what collection made (torch, diffusers, transformers, the test modules: about 480,000 objects) out of the
    garbage collector's reach: each full ``gc.collect()`` (the fake CUDA's teardown, the tests of pinned memory
    given back, the interpreter's own gen-2 passes) then walks only what the tests made, 0.001 s instead of 0.3-0.5 s
    of CPU. Objects made later are collected as before; what collection made lives as long as the session anyway."""
    gc.freeze()


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory) -> dict[str, str]:
    """``{kind: folder}`` for each tiny pipeline kind, each with fp32 weights and an fp16 variant."""
    root = tmp_path_factory.mktemp("tiny")
    return {kind: str(tiny.save(kind, root / kind)) for kind in tiny.KINDS}


@pytest.fixture(scope="session")
def flux_folder(tmp_path_factory) -> str:
    """The tiny Flux-like pipeline (``tiny.ALL_KINDS``' transformer one), saved once in fp32 for every test file
    that reads it (never written)."""
    return str(tiny.save("flux", tmp_path_factory.mktemp("flux") / "flux", variant_fp16=False))


@pytest.fixture(scope="session")
def reference_outputs(tiny_folders) -> dict[str, torch.Tensor]:
    """The plain diffusers output of each tiny pipeline's default call: what every mapped run must equal."""
    outputs = {}
    for kind, folder in tiny_folders.items():
        pipe = plain_pipeline(folder)
        outputs[kind] = torch.as_tensor(pipe(**tiny.default_call(pipe, kind)).images)
    return outputs


@pytest.fixture(scope="session")
def sd_inventory(tiny_folders):
    """The tiny SD pipeline's inventory, read from its folder."""
    return pipemap.inspect(tiny_folders["sd"])


@pytest.fixture(scope="session")
def sd_plan(sd_inventory):
    """The tiny SD pipeline on two GPUs, the unet streamed to cuda:0, the text encoder and the vae to cuda:1."""
    base = pipemap.plan(sd_inventory, hardware="cuda:0=1GiB,cuda:1=1GiB,cpu=4GiB", strategy="balanced")
    return moving(base, sd_inventory, {"unet": ("stream", "cuda:0"), "text_encoder": ("stream", "cuda:1"),
                                       "vae": ("stream", "cuda:1")})


@pytest.fixture
def fake_cuda(monkeypatch, tmp_path):
    """A fake CUDA with two GPUs for one test (``tests/fakecuda.py``): pipemap's CUDA code runs on the CPU, every
    copy and read is checked for ordering, and the test fails on any race it leaves (set ``expect_races`` to look
    at them yourself). ``fake_cuda.gpus`` may be raised before anything is placed."""
    import fakecuda
    from pipemap.runtime import transfer

    monkeypatch.setenv("PIPEMAP_CACHE_DIR", str(tmp_path / "cache"))  # the transfer check's cache: not the user's
    transfer.clear_transfer_cache()
    fake = fakecuda.install(monkeypatch)
    fake.expect_races = False
    try:
        yield fake
        gc.collect()  # what the test dropped releases its pinned memory under this fake
    finally:
        fake.exit()
        transfer.clear_transfer_cache()
    if not fake.expect_races:
        fake.assert_no_races()
    assert not fake.registered, f"host memory still registered after the test: {fake.registered}"
