"""What the serve test files share: asking the server for images, reading its answers and ``/metrics``, the direct
call to compare with, stalls put inside the pipeline with plain torch forward pre-hooks on its own modules (so the
server sees what a slow model would do to it), and a pipeline stand-in for the queue's own tests. Plain code,
imported as ``from serving import ...``; the fixtures (``service``, ``url``, ``client``) live in
``conftest.py`` beside it."""

from __future__ import annotations

import base64
import contextlib
import io
import re
import threading
import time
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

GENERATIONS = "/v1/images/generations"
STEPS = 2
ROOM = 8 * 2**20  # for activations: two 32x32 images with guidance take 3.2 MiB on the tiny SD


def roomy_hardware(inventory) -> str:
    """The machine that forces ``balanced_low_memory`` on ``inventory``, with ``ROOM`` bytes more on its GPU: kept as
    headroom (``headroom=ROOM``), the plan is the same, and the memory ledger admits requests' activations there."""
    from pipemap.planner import forcing_hardware

    budget = re.fullmatch(r"cuda:0=(\d+),(.*)", forcing_hardware(inventory, "balanced_low_memory"))
    assert budget is not None
    return f"cuda:0={int(budget[1]) + ROOM},{budget[2]}"


def ask(client, **fields):
    return client.post(GENERATIONS, json={"size": "32x32", "num_inference_steps": STEPS, **fields})


def pngs(response) -> list[np.ndarray]:
    assert response.status_code == 200, response.text
    return [np.array(Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))).convert("RGB"))
            for d in response.json()["data"]]


def direct(pipe, seed: int, **call) -> list[np.ndarray]:
    """The same call made on the pipeline directly, without the server."""
    images = pipe(generator=torch.Generator("cpu").manual_seed(seed), output_type="pil", width=32, height=32,
                  num_inference_steps=STEPS, **call).images
    return [np.array(image) for image in images]


def samples(text: str) -> dict[str, float]:
    """Prometheus text as ``{sample with labels: value}``."""
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def counted(client) -> dict[str, float]:
    """``/metrics`` as ``{sample with labels: value}``."""
    return samples(client.get("/metrics").text)


def code(client, status: int) -> float:
    return counted(client).get(f'pipemap_requests_total{{code="{status}"}}', 0.0)


@contextlib.contextmanager
def stalled(module):
    """``module``'s forward waits until the block exits: ``entered`` is set once a call is inside."""
    entered, release = threading.Event(), threading.Event()

    def wait(*_):
        entered.set()
        release.wait(60)

    handle = module.register_forward_pre_hook(wait)
    try:
        yield entered
    finally:
        release.set()
        handle.remove()


def in_background(function, *args, **kwargs):
    """Run ``function`` on a thread; the returned callable joins it and gives its result."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(value=function(*args, **kwargs)), daemon=True)
    thread.start()

    def join():
        thread.join(120)
        return result["value"]

    return join


def wait_until(predicate, seconds: float = 60):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "gave up waiting"
        time.sleep(0.02)


class Echo:
    """A pipeline stand-in for the queue and its worker: a call answers with its prompt, seed and images, after
    ``num_inference_steps`` steps, each waiting while ``gate`` is clear and then calling ``callback_on_step_end``;
    the prompt "fail" raises. ``entered`` is set once a call has started."""

    def __init__(self):
        self.components: dict = {}
        self.calls: list[str] = []
        self.steps = 0
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()

    def __call__(self, prompt, num_images_per_prompt=1, num_inference_steps=3, generator=None, output_type="pil",
                 callback_on_step_end=None):
        self.calls.append(prompt)
        self.entered.set()
        if prompt == "fail":
            raise RuntimeError("injected: the pipeline broke")
        for step in range(num_inference_steps):
            assert self.gate.wait(60)
            self.steps += 1
            if callback_on_step_end is not None:
                callback_on_step_end(self, step, 0, {})
        return SimpleNamespace(prompt=prompt, seed=generator.initial_seed(), output_type=output_type,
                               images=[prompt] * num_images_per_prompt)
