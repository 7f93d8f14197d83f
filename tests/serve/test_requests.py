"""serve/requests.py: a generation request read in OpenAI's images format and checked against what this pipeline
accepts. Over HTTP, a bad request answers 400 naming its field, and a prompt longer than the text encoder reads is
truncated with a warning; directly, ``parse`` and ``Limits`` turn a request into the pipeline's call."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest

import pipemap

httpx = pytest.importorskip("httpx", reason="the serve tests need httpx: pip install -e '.[test]'")
pytest.importorskip("uvicorn", reason="pipemap serve needs uvicorn: pip install -e '.[serve]'")
from pipemap.serve import GenerationRequest, Limits, RequestError  # noqa: E402
from pipemap.serve.requests import parse  # noqa: E402
from serving import GENERATIONS, ask, code, direct, pngs  # noqa: E402


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_a_prompt_too_long_is_truncated_with_a_warning(service, client):
    prompt = "a very long prompt about a tiny cat " * 10  # 360 characters: 360 byte tokens, the encoder reads 77
    response = ask(client, prompt=prompt, seed=1)
    assert response.status_code == 200
    assert re.fullmatch(r'299 pipemap "prompt is \d+ tokens; tokenizer reads 77, the rest was dropped"',
                        response.headers["warning"])
    np.testing.assert_array_equal(pngs(response)[0], direct(service.pipe, 1, prompt=prompt)[0])


# ---- bad requests ----------------------------------------------------------------------------------------------

BAD = {
    "size not a multiple": ({"prompt": "a cat", "size": "38x32"}, "size", "multiples of 8, e.g. '40x32'"),
    "size not WxH": ({"prompt": "a cat", "size": "large"}, "size", "not WIDTHxHEIGHT"),
    "n too large": ({"prompt": "a cat", "n": 3}, "n", "at most 2 images"),
    "n below 1": ({"prompt": "a cat", "n": 0}, "n", "greater than or equal to 1"),
    "unknown field": ({"prompt": "a cat", "colour": "red"}, "colour", "unknown field 'colour'"),
    "n a boolean": ({"prompt": "a cat", "n": True}, "n", "valid integer"),
    "n a float": ({"prompt": "a cat", "n": 2.0}, "n", "valid integer"),
    "guidance NaN": ({"prompt": "a cat", "guidance_scale": float("nan")}, "guidance_scale", "finite number"),
    "guidance Infinity": ({"prompt": "a cat", "guidance_scale": float("inf")}, "guidance_scale", "finite number"),
    "steps over the cap": ({"prompt": "a cat", "num_inference_steps": 100000}, "num_inference_steps",
                           "at most 1000 steps"),  # the scheduler's num_train_timesteps
    "prompt too long": ({"prompt": "a cat " * 1000}, "prompt", "6000 characters; this server takes at most 4000"),
    "timeout not positive": ({"prompt": "a cat", "timeout": 0}, "timeout", "greater than 0"),
    "no prompt": ({"n": 1}, "prompt", "Field required"),
    "prompt not text": ({"prompt": 3}, "prompt", "valid string"),
    "url format": ({"prompt": "a cat", "response_format": "url"}, "response_format", "'b64_json'"),
    "steps below 1": ({"prompt": "a cat", "num_inference_steps": 0}, "num_inference_steps", "greater than"),
    "seed negative": ({"prompt": "a cat", "seed": -1}, "seed", "greater than"),
    "frames to an image pipeline": ({"prompt": "a cat", "num_frames": 8}, "num_frames",
                                    "this pipeline takes no num_frames"),
    "frames a boolean": ({"prompt": "a cat", "num_frames": True}, "num_frames", "valid integer"),
    # no size reaches int() unbounded nor the arithmetic past it (a 500 before: ValueError, OverflowError)
    "size in full-width digits": ({"prompt": "a cat", "size": "\uff11\uff16x\uff11\uff16"}, "size", "ASCII digits"),
    "size of 5000 digits": ({"prompt": "a cat", "size": "1" * 5000 + "x16"}, "size", "not WIDTHxHEIGHT"),
    "size past int's digits": ({"prompt": "a cat", "size": "8x" + "9" * 4300}, "size", "each side at most 16384"),
    "size of six digits": ({"prompt": "a cat", "size": "999992x8"}, "size", "not WIDTHxHEIGHT"),
    "size over the most side": ({"prompt": "a cat", "size": "16392x16392"}, "size", "sides of at most 16384"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_request_names_its_field(client, kind):
    fields, param, words = BAD[kind]
    before = code(client, 400)
    # as Python's json writes it: NaN and Infinity as bare words, which httpx's json= refuses to send
    response = client.post(GENERATIONS, content=json.dumps(fields), headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.headers["x-should-retry"] == "false"  # no retry mends it
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert words in error["message"]
    assert code(client, 400) == before + 1


def test_a_body_that_is_not_json(client):
    response = client.post(GENERATIONS, content=b"{prompt: cat", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


# ---- parse and Limits, directly -------------------------------------------------------------------------------


class _Words:
    """A tokenizer that makes one token per word."""

    def __init__(self, length: int):
        self.model_max_length = length

    def __call__(self, text: str):
        return SimpleNamespace(input_ids=text.split())


SD_CALL = frozenset({"prompt", "num_images_per_prompt", "width", "height", "negative_prompt", "num_inference_steps",
                     "guidance_scale", "generator", "output_type"})


def test_parse_reads_openais_fields_with_their_defaults():
    request = parse(b'{"prompt": "a cat", "model": "dall-e-3", "user": "me"}')
    assert isinstance(request, GenerationRequest)
    assert (request.prompt, request.n, request.size, request.response_format, request.seed) == \
        ("a cat", 1, None, "b64_json", None)
    assert request.model == "dall-e-3"  # a server holds one pipeline: any model name is taken


def test_a_request_error_names_the_field_and_a_code():
    with pytest.raises(RequestError) as refused:
        parse(b'{"prompt": "a cat", "colour": "red"}')
    assert (refused.value.param, refused.value.code) == ("colour", "unknown_field")
    assert "the fields are prompt, n, size" in refused.value.message
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, pipemap.PipemapError)
    with pytest.raises(RequestError) as refused:
        parse(b'{"prompt": "a cat", "n": "two"}')
    assert refused.value.param == "n" and refused.value.message.startswith("n: ")


def test_check_turns_a_request_into_the_pipelines_call():
    limits = Limits(8, 4, SD_CALL)
    request = GenerationRequest(prompt="a cat", n=3, size="48 x 32", negative_prompt="a dog", guidance_scale=5.0)
    generation = limits.check(request, seed=11)
    assert generation.call == {"prompt": "a cat", "num_images_per_prompt": 3, "width": 48, "height": 32,
                               "negative_prompt": "a dog", "guidance_scale": 5.0}
    assert (generation.n, generation.seed, generation.warnings) == (3, 11, ())


def test_check_refuses_what_this_pipeline_or_server_does_not_take():
    limits = Limits(16, 2, frozenset({"prompt", "num_images_per_prompt", "width", "height"}))
    for request, param, kind, words in (
            (GenerationRequest(prompt="a cat", guidance_scale=3.0), "guidance_scale", "unsupported_field",
             "this pipeline takes no guidance_scale"),
            (GenerationRequest(prompt="a cat", n=3), "n", "n_too_large", "at most 2 images"),
            (GenerationRequest(prompt="a cat", size="44x20"), "size", "invalid_size", "multiples of 16, e.g. '48x16'"),
            (GenerationRequest(prompt="a cat", size="0x32"), "size", "invalid_size", "positive multiples of 16")):
        with pytest.raises(RequestError) as refused:
            limits.check(request, seed=0)
        assert (refused.value.param, refused.value.code) == (param, kind)
        assert words in refused.value.message


def test_frames_are_a_video_pipelines_and_capped_like_the_steps():
    video = Limits(8, 1, SD_CALL | {"num_frames"}, max_frames=64)
    assert video.check(GenerationRequest(prompt="a cat", num_frames=64), seed=0).call["num_frames"] == 64
    with pytest.raises(RequestError) as refused:
        video.check(GenerationRequest(prompt="a cat", num_frames=100000), seed=0)
    assert (refused.value.param, refused.value.code) == ("num_frames", "frames_too_large")
    assert "at most 64 frames" in refused.value.message


def test_each_text_encoder_that_drops_words_is_named_in_a_warning():
    limits = Limits(8, 4, SD_CALL, (("tokenizer", _Words(4)), ("tokenizer_2", _Words(6))))
    request = GenerationRequest(prompt="one two three four five", negative_prompt="a b c d e f g")
    assert limits.check(request, seed=0).warnings == (
        "prompt is 5 tokens; tokenizer reads 4, the rest was dropped",
        "negative_prompt is 7 tokens; tokenizer reads 4, the rest was dropped",
        "negative_prompt is 7 tokens; tokenizer_2 reads 6, the rest was dropped")
    assert limits.check(GenerationRequest(prompt="a cat"), seed=0).warnings == ()


def test_limits_of_a_pipeline_read_its_vae_scale_its_call_and_its_tokenizers():
    class Pipe:
        def __init__(self, scale):
            self.image_processor = SimpleNamespace(config=SimpleNamespace(vae_scale_factor=scale))
            self.components = {"tokenizer": _Words(77), "tokenizer_2": _Words(256), "text_encoder": object(),
                               "tokenizer_3": None}

        def __call__(self, prompt, num_images_per_prompt=1, width=None, height=None):
            pass

    limits = Limits.of(Pipe(16), max_n=3)
    assert (limits.multiple, limits.max_n) == (16, 3)
    assert limits.parameters == {"prompt", "num_images_per_prompt", "width", "height"}
    assert [name for name, _ in limits.tokenizers] == ["tokenizer", "tokenizer_2"]
    assert Limits.of(Pipe(2)).multiple == 8  # SD's checks want multiples of 8 whatever the VAE's factor
    assert Limits.of(Pipe(None)).multiple == 8
