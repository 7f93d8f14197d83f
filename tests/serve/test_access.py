"""serve/access.py, over real HTTP (uvicorn on a loopback port, httpx): an API key guards the /v1/ routes (401 in
OpenAI's shape without it), bodies are JSON only (415) and bounded (413, with or without a Content-Length), a
loopback server answers only local Host and Origin names (403), every answer carries an X-Request-Id (the client's,
or a new one), and ``pipemap serve`` warns when it binds beyond loopback with no key."""

from __future__ import annotations

import re
import socket

import pytest

httpx = pytest.importorskip("httpx", reason="the serve tests need httpx: pip install -e '.[test]'")
pytest.importorskip("uvicorn", reason="pipemap serve needs uvicorn: pip install -e '.[serve]'")
from starlette.datastructures import Headers  # noqa: E402

from pipemap.serve import Background, Service  # noqa: E402
from pipemap.serve.access import Access, is_local, request_id  # noqa: E402
from serving import GENERATIONS, code, pngs  # noqa: E402

KEY = "sk-test-36"
BODY = {"prompt": "a cat", "size": "32x32", "num_inference_steps": 1, "seed": 3}


@pytest.fixture(scope="module")
def keyed(service):
    """A service with an API key and a small body limit, on the module's pipeline."""
    own = Service(service.pipe, service.plan, service.running_plan, timeout=60.0,
                  access=Access(api_key=KEY, max_body=4096))
    with Background(own) as url, httpx.Client(base_url=url, timeout=60) as session:
        yield session


def _bearer(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("headers", [{}, _bearer("sk-wrong"), {"Authorization": KEY}, {"Authorization": "Basic x"}])
def test_without_the_key_a_v1_route_answers_401_in_openais_shape(keyed, headers):
    before = code(keyed, 401)
    response = keyed.post(GENERATIONS, json=BODY, headers=headers)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert keyed.get("/v1/models", headers=headers).status_code == 401
    assert code(keyed, 401) == before + 1  # a generation turned away is still counted


def test_with_the_key_a_generation_is_served_and_probes_need_none(keyed):
    assert len(pngs(keyed.post(GENERATIONS, json=BODY, headers=_bearer()))) == 1
    assert keyed.get("/v1/models", headers=_bearer()).status_code == 200
    for path in ("/health", "/health/live", "/health/ready", "/metrics"):
        assert keyed.get(path).status_code == 200, path


@pytest.mark.parametrize("media", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_a_body_that_is_not_json_answers_415(keyed, media):
    headers = {**_bearer(), **({"content-type": media} if media else {})}
    response = keyed.post(GENERATIONS, content=b'{"prompt": "a cat"}', headers=headers)
    assert response.status_code == 415 and response.json()["error"]["code"] == "unsupported_media_type"


def test_a_body_over_the_limit_answers_413_with_or_without_its_length(keyed):
    big = ('{"prompt": "' + "a" * 5000 + '"}').encode()
    headers = {**_bearer(), "content-type": "application/json"}
    told = keyed.post(GENERATIONS, content=big, headers=headers)
    chunked = keyed.post(GENERATIONS, content=iter([big[:3000], big[3000:]]), headers=headers)  # no Content-Length
    for response in (told, chunked):
        assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    assert "Content-Length" not in chunked.request.headers


@pytest.mark.parametrize("header, value, kind", [("host", "evil.example", "forbidden_host"),
                                                 ("host", "attacker.test:8000", "forbidden_host"),
                                                 ("origin", "http://evil.example", "forbidden_origin")])
def test_a_loopback_server_refuses_foreign_host_and_origin_names(keyed, header, value, kind):
    response = keyed.post(GENERATIONS, json=BODY, headers={**_bearer(), header: value})
    assert response.status_code == 403 and response.json()["error"]["code"] == kind
    assert keyed.get("/health", headers={header: value}).status_code == 403  # DNS rebinding reads nothing either


def test_local_names_and_origins_pass(keyed):
    for host in ("localhost", "127.0.0.1:8000", "[::1]:8000"):
        assert keyed.get("/health", headers={"host": host}).status_code == 200, host
    assert keyed.get("/health", headers={"origin": "http://localhost:3000"}).status_code == 200


def test_every_answer_carries_a_request_id_the_clients_or_a_new_one(keyed):
    echoed = keyed.get("/nowhere", headers={"x-request-id": "trace-42"})
    assert echoed.status_code == 404 and echoed.headers["x-request-id"] == "trace-42"
    refused = keyed.post(GENERATIONS, json=BODY)  # a 401 carries one too
    made = keyed.get("/health", headers={"x-request-id": "bad id\twith spaces"})
    assert re.fullmatch(r"[0-9a-f]{32}", refused.headers["x-request-id"])
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    assert refused.headers["x-request-id"] != made.headers["x-request-id"]


def test_a_server_bound_beyond_loopback_checks_no_host_name(service):
    open_bind = Service(service.pipe, service.plan, service.running_plan, access=Access(local=False))
    with Background(open_bind) as url:
        assert httpx.get(f"{url}/health", headers={"host": "pipemap.internal"}, timeout=30).status_code == 200


def test_a_server_failure_is_a_500_in_openais_shape_with_the_request_id(service, monkeypatch):
    own = Service(service.pipe, service.plan, service.running_plan, timeout=60.0)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug of the server's own")

    monkeypatch.setattr(own, "submit", broken)
    with Background(own) as url:
        failed = httpx.post(f"{url}{GENERATIONS}", json=BODY, headers={"x-request-id": "trace-500"}, timeout=30)
    assert failed.status_code == 500 and failed.headers["x-request-id"] == "trace-500"
    assert failed.json()["error"]["code"] == "server_error" and "a bug of the server's own" in failed.text


def test_a_content_length_not_in_ascii_digits_is_no_500():
    assert Access(local=False, max_body=10).refusal("POST", "/v1/x", Headers({"content-type": "application/json",
                                                                  "content-length": "\u00b2"})) is None
    assert Access(local=False, max_body=10).refusal("POST", "/v1/x", Headers({"content-type": "application/json",
                                                                  "content-length": "9" * 5000})) is None
    assert Access(local=False, max_body=10).refusal("POST", "/v1/x", Headers({"content-type": "application/json",
                                                                  "content-length": "11"})).status_code == 413


def test_local_names_and_request_ids_directly():
    assert all(is_local(h) for h in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"))
    assert not any(is_local(h) for h in ("0.0.0.0", "::", "10.0.0.1", "evil.example", ""))
    assert request_id(Headers({"x-request-id": "abc-1"})) == "abc-1"
    assert request_id(Headers({"x-request-id": "x" * 129})) != "x" * 129  # too long: a new one


def test_pipemap_serve_warns_when_bound_beyond_loopback_without_a_key(tmp_path, capsys, monkeypatch):
    from pipemap.cli import main

    missing = str(tmp_path / "no-such-pipeline")  # the warning comes before the load, which then fails
    monkeypatch.delenv("PIPEMAP_API_KEY", raising=False)
    assert main(["serve", missing, "--host", "0.0.0.0"]) == 2  # the missing folder is still the error it was
    warned = capsys.readouterr().err
    assert "WARNING: serving on 0.0.0.0" in warned and "--api-key-file" in warned
    monkeypatch.setenv("PIPEMAP_API_KEY", KEY)
    for argv in (["serve", missing, "--host", "0.0.0.0"], ["serve", missing]):
        assert main(argv) == 2 and "WARNING" not in capsys.readouterr().err


def test_a_raw_text_plain_post_from_a_page_is_refused_before_any_work(keyed, service):
    # what a browser's cross-site form post sends: no preflight, text/plain, no key; nothing reaches the pipeline
    calls = []
    handle = service.pipe.unet.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        host, port = keyed.base_url.host, keyed.base_url.port
        with socket.create_connection((host, port), timeout=30) as raw:
            body = b'{"prompt": "a cat", "size": "32x32"}'
            raw.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: localhost\r\nOrigin: http://evil.example\r\n"
                        b"Content-Type: text/plain\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            head = raw.recv(65536).split(b"\r\n", 1)[0]
    finally:
        handle.remove()
    assert head.startswith(b"HTTP/1.1 403") and calls == []


def test_the_official_openai_client_with_the_key(keyed):
    openai = pytest.importorskip("openai", reason="the OpenAI client test needs openai: pip install openai")
    url = f"{keyed.base_url}/v1"
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
    made = client.images.generate(prompt="a cat", size="32x32", n=1, response_format="b64_json", quality="hd",
                                  extra_body={"seed": 3, "num_inference_steps": 1})
    assert len(made.data) == 1 and made.data[0].b64_json
    assert [m.id for m in client.models.list()] == ["pipemap"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0).images.generate(prompt="a cat", size="32x32")
    with pytest.raises(openai.BadRequestError, match="at most 1000 steps") as refused:
        client.images.generate(prompt="a cat", size="32x32", extra_body={"num_inference_steps": 10_000})
    assert (refused.value.code, refused.value.param) == ("steps_too_large", "num_inference_steps")
    # a 504 past the request's own timeout is not retried by the client's default retries (x-should-retry: false)
    retrying = openai.OpenAI(base_url=url, api_key=KEY, max_retries=2, timeout=60)
    before = code(keyed, 504)
    with pytest.raises(openai.InternalServerError) as late:
        retrying.images.generate(prompt="a cat", size="32x32", extra_body={"timeout": 0.001})
    assert late.value.status_code == 504 and code(keyed, 504) == before + 1  # asked once, not three times
