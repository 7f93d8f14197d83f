"""A generation request: read in the OpenAI images format, checked against what this pipeline accepts.

``GenerationRequest`` checks types strictly (``n: true`` or ``2.0`` is no count; NaN and Infinity are no guidance)
and unknown fields (pydantic, ``extra="forbid"``), except OpenAI's own fields this server has no use for
(``quality``, ``style``, ...): those are taken and ignored, with a ``Warning`` header saying so. ``Limits.check``
then checks what depends on the pipeline and the server: the model name, the image size against the multiple it
accepts, ``n``, the steps and the prompt's length against the server's caps, extensions the pipeline's ``__call__``
lacks. A prompt longer than a text encoder reads is not an error: the pipeline drops the rest, and the answer says
so in a ``Warning`` header.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from ..errors import ModelNotFoundError, RequestError

# SD and SDXL's check_inputs want sides divisible by 8 whatever their VAE's scale factor (a tiny VAE has 2)
_SD_MULTIPLE = 8
# ASCII digits only (``\d`` takes full-width and other scripts' digits), five at most: a side past ``MAX_SIDE`` is
# refused by its length before any arithmetic, and no number read here can reach Python's 4300-digit limit
_SIZE = re.compile(r"^[ \t]*([0-9]{1,5})[ \t]*x[ \t]*([0-9]{1,5})[ \t]*$")
MAX_SIDE = 16384  # pixels: twice what any diffusers pipeline is trained for, and past what one device decodes
# request field -> the pipeline __call__ argument it becomes
_EXTENSIONS = {"negative_prompt": "negative_prompt", "num_inference_steps": "num_inference_steps",
               "guidance_scale": "guidance_scale", "num_frames": "num_frames"}
# OpenAI's images fields that ask for what this server does not do (quality tiers, styles, formats, moderation):
# clients send them by default, so they are ignored with a warning rather than refused (as vLLM does)
IGNORED = ("quality", "style", "background", "output_format", "output_compression", "moderation", "partial_images",
           "stream", "input_fidelity")


PER_PROMPT = ("num_images_per_prompt", "num_videos_per_prompt")  # results per prompt: a video pipeline's name second


def per_prompt(parameters) -> str:
    """The argument of a pipeline's ``__call__`` (``parameters``: its names) that asks for results per prompt."""
    return next((name for name in PER_PROMPT if name in parameters), PER_PROMPT[0])


def results_per_prompt(call) -> int:
    """The results per prompt ``call`` asks for (1 when it leaves it to the pipeline)."""
    return next((call[name] for name in PER_PROMPT if name in call), 1)


class GenerationRequest(BaseModel):
    """``POST /v1/images/generations``: OpenAI's fields, then pipemap's extensions."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    n: StrictInt = Field(1, ge=1)
    size: str | None = None
    response_format: Literal["b64_json"] = "b64_json"
    model: str | None = None  # checked against the served names (``Limits.names``)
    user: str | None = None
    negative_prompt: str | None = None
    num_inference_steps: StrictInt | None = Field(None, ge=1)
    num_frames: StrictInt | None = Field(None, ge=1)  # a video pipeline's frames
    guidance_scale: float | None = Field(None, allow_inf_nan=False)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False)  # seconds; at most the server's own
    # OpenAI's fields this server ignores (``IGNORED``): taken, then named in a warning
    quality: Any = None
    style: Any = None
    background: Any = None
    output_format: Any = None
    output_compression: Any = None
    moderation: Any = None
    partial_images: Any = None
    stream: Any = None
    input_fidelity: Any = None

    def ignored(self) -> tuple[str, ...]:
        """The OpenAI fields the client sent that this server ignores."""
        return tuple(name for name in IGNORED if name in self.model_fields_set)


def parse(body: bytes) -> GenerationRequest:
    """The request read from a JSON body; a RequestError naming the first field at fault."""
    try:
        return GenerationRequest.model_validate_json(body)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            known = ", ".join(name for name in GenerationRequest.model_fields if name not in IGNORED)
            raise RequestError(param, f"unknown field {param!r}: the fields are {known}", "unknown_field") from None
        if first["type"] == "json_invalid":
            raise RequestError(None, f"the body is not JSON: {first['msg']}", "invalid_json") from None
        where = f"{param}: " if param else ""
        raise RequestError(param, f"{where}{first['msg']}", first["type"]) from None


@dataclass(frozen=True)
class Generation:
    """A checked request: the pipeline's keyword arguments (no generator yet), the images asked for, the seed, and
    warnings for the answer's headers."""

    call: dict
    n: int
    seed: int
    warnings: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class Limits:
    """What this pipeline and server accept: side multiple, images per request, the ``__call__`` arguments, each text
    encoder's tokenizer (``{component: tokenizer}``) with its length, the most steps and prompt characters a request
    may ask for, and the model names served (the first is the one ``/v1/models`` lists; none: any name is taken)."""

    multiple: int
    max_n: int
    parameters: frozenset[str]
    tokenizers: tuple[tuple[str, Any], ...] = ()  # transformers tokenizers
    max_steps: int = 200  # a step costs a unet call: 200 is four times SD's default, and past what samplers need
    max_prompt: int = 4000  # characters, as OpenAI's dall-e-3; tokenizers read 77 to 512 tokens of it
    names: tuple[str, ...] = ()
    max_frames: int = 256  # a video's frames: 256 is about twice what video pipelines make by default (81 to 129)

    @classmethod
    def of(cls, pipe, max_n: int = 4, *, max_steps: int | None = None, max_prompt: int = 4000,
           names: tuple[str, ...] = (), max_frames: int = 256) -> Limits:
        """``pipe``'s limits; ``max_steps`` None: what its scheduler takes (``scheduler_steps``)."""
        max_steps = max_steps or scheduler_steps(pipe)
        processor = getattr(pipe, "image_processor", None)
        scale = getattr(getattr(processor, "config", None), "vae_scale_factor", None) or _SD_MULTIPLE
        tokenizers = tuple((name, value) for name, value in pipe.components.items()
                           if name.startswith("tokenizer") and hasattr(value, "model_max_length"))
        return cls(math.lcm(scale, _SD_MULTIPLE), max_n, frozenset(inspect.signature(pipe.__call__).parameters),
                   tokenizers, max_steps, max_prompt, tuple(names), max_frames)

    def check(self, request: GenerationRequest, seed: int) -> Generation:
        """The pipeline call ``request`` asks for, or a RequestError naming the field at fault."""
        self._caps(request)
        call = {"prompt": request.prompt, per_prompt(self.parameters): request.n}
        if request.size is not None:
            call["width"], call["height"] = self._size(request.size)
        for name, argument in _EXTENSIONS.items():
            value = getattr(request, name)
            if value is not None:
                if argument not in self.parameters:
                    raise RequestError(name, f"this pipeline takes no {name}: leave it out", "unsupported_field")
                call[argument] = value
        warnings = tuple(f"{name} is ignored: this server has no such option" for name in request.ignored())
        warnings += tuple(w for text, what in ((request.prompt, "prompt"), (request.negative_prompt,
                          "negative_prompt")) if text for w in self._truncation(text, what))
        return Generation(call, request.n, seed, warnings)

    def _caps(self, request: GenerationRequest) -> None:
        """The server's own caps, checked before anything costs work (a tokenizer on a long prompt, a dry run)."""
        if self.names and request.model is not None and request.model not in self.names:
            raise ModelNotFoundError(request.model, self.names)
        if request.n > self.max_n:
            raise RequestError("n", f"n is {request.n}; this server makes at most {self.max_n} images a request: "
                               "send several requests", "n_too_large")
        steps = request.num_inference_steps
        if steps is not None and steps > self.max_steps:
            raise RequestError("num_inference_steps", f"num_inference_steps is {steps}; this server runs at most "
                               f"{self.max_steps} steps a request: ask for fewer", "steps_too_large")
        frames = request.num_frames
        if frames is not None and frames > self.max_frames:
            raise RequestError("num_frames", f"num_frames is {frames}; this server makes at most {self.max_frames} "
                               "frames a request: ask for fewer", "frames_too_large")
        for name in ("prompt", "negative_prompt"):
            text = getattr(request, name)
            if text is not None and len(text) > self.max_prompt:
                raise RequestError(name, f"{name} is {len(text)} characters; this server takes at most "
                                   f"{self.max_prompt}: shorten it", "prompt_too_long")

    def _size(self, text: str) -> tuple[int, int]:
        match = _SIZE.match(text) if len(text) <= 32 else None
        if match is None:
            raise RequestError("size", f"size {text[:32]!r}{'...' if len(text) > 32 else ''} is not WIDTHxHEIGHT in "
                               f"ASCII digits, each side at most {MAX_SIDE}, e.g. '1024x1024'", "invalid_size")
        width, height = int(match[1]), int(match[2])
        if max(width, height) > MAX_SIDE:
            raise RequestError("size", f"size {text!r}: this server takes sides of at most {MAX_SIDE} pixels: ask for "
                               "a smaller size", "size_too_large")
        if width <= 0 or height <= 0 or width % self.multiple or height % self.multiple:
            raise RequestError("size", f"size {text!r}: this pipeline takes sides that are positive multiples of "
                               f"{self.multiple}, e.g. '{_round(width, self.multiple)}x"
                               f"{_round(height, self.multiple)}'", "invalid_size")
        return width, height

    def _truncation(self, text: str, what: str) -> list[str]:
        # the pipeline truncates by itself (and only logs it); the client is told which encoder dropped what
        out = []
        for name, tokenizer in self.tokenizers:
            length = len(tokenizer(text).input_ids)
            if length > tokenizer.model_max_length:
                out.append(f"{what} is {length} tokens; {name} reads {tokenizer.model_max_length}, the rest was "
                           "dropped")
        return out


def scheduler_steps(pipe) -> int:
    """The most denoising steps ``pipe``'s scheduler takes: its ``num_train_timesteps`` (DDIM, PNDM, Euler and the
    flow-matching schedulers refuse more, or repeat timesteps); 1000, their usual count, where it has none."""
    config = getattr(getattr(pipe, "scheduler", None), "config", None)
    steps = getattr(config, "num_train_timesteps", None) if config is not None else None
    return steps if isinstance(steps, int) and steps > 0 else 1000


def _round(side: int, multiple: int) -> int:
    return max(multiple, round(side / multiple) * multiple)
