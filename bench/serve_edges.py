"""``pipemap serve`` at its edges: the hostile clients of issue 49, each followed by a probe and a generation.

    python bench/serve_edges.py                  # the whole battery on the tiny SD, on CPU (well under a minute)
    python bench/serve_edges.py --no-record      # print only

Each case runs against one server (uvicorn on loopback, in this process, with ``ConnectionLimits(max_connections=
256)``, as a 256-file limit would give); while its connections are still held, ``GET /health/live`` and a 1-step
32x32 generation are timed: both must answer within 2 s. The table gives what the hostile client got (its status,
and after how long) and the two timings; the last line is ``summary: name=value ...``. The peer of each figure is
the 2 s bound, in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import torch  # noqa: E402

from pipemap import tiny  # noqa: E402
from pipemap.quiet import quiet_progress  # noqa: E402
from pipemap.serve import Background, Options, Service  # noqa: E402
from pipemap.serve.connections import ConnectionLimits  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BOUND = 2.0  # seconds: a probe and a generation after each case
POST = b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to bench/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="pipemap-bench-edges-") as root:
        with quiet_progress():
            folder = tiny.save("sd", Path(root) / "sd", variant_fp16=False)
        service = Service.load(Options(str(folder), hardware="cpu=64GiB", timeout=60.0))
        limits = ConnectionLimits(head_timeout=10.0, body_timeout=10.0, max_connections=256)
        with Background(service, connections=limits) as url:
            port = int(url.rsplit(":", 1)[1])
            _generate(url)  # the 32x32 shape measured before the battery
            rows = [(name, *case(port), *_checks(url)) for name, case in CASES]
    text = _table(rows)
    print(text)
    if not args.no_record:
        with RESULTS.open("a") as out:
            out.write("\n" + text + "\n")


def _checks(url: str) -> tuple[float, float]:
    start = time.monotonic()
    assert httpx.get(f"{url}/health/live", timeout=30).status_code == 200
    live = time.monotonic() - start
    start = time.monotonic()
    _generate(url)
    return live, time.monotonic() - start


def _generate(url: str) -> None:
    answer = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a cat", "size": "32x32",
                                                               "num_inference_steps": 1}, timeout=30)
    assert answer.status_code == 200, answer.text


# ---- the cases: each returns (what the hostile client got, seconds until it got it) -------------------------------

_held: list[socket.socket] = []  # connections a case leaves open while the checks run; closed by the next case


def _release() -> None:
    while _held:
        _held.pop().close()


def _exchange(port: int, data: bytes, seconds: float = 30) -> tuple[str, float]:
    """The status the server answered ``data`` with, and when its first byte came (else when it closed)."""
    start, first = time.monotonic(), None
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=seconds) as client:
            client.sendall(data)
            answer = b""
            while chunk := client.recv(65536):
                first = first or time.monotonic()
                answer += chunk
    except OSError as err:
        return type(err).__name__, time.monotonic() - start
    status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "closed, no answer"
    return status, (first or time.monotonic()) - start


def idle_300(port: int) -> tuple[str, float]:
    _release()
    _held.extend(socket.create_connection(("127.0.0.1", port)) for _ in range(300))
    return "held (oldest idle closed past 256)", 0.0


def slowloris(port: int) -> tuple[str, float]:
    _release()
    got: list[tuple[str, float]] = []

    def drip() -> None:
        start = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
                for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
                    client.sendall(bytes([byte]))
                    time.sleep(2.0)  # a byte every 2 s, as the client
            got.append(("never closed", time.monotonic() - start))
        except OSError as err:
            got.append((type(err).__name__, time.monotonic() - start))

    threads = [threading.Thread(target=drip, daemon=True) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return f"20 x {got[0][0]}", max(t for _, t in got)


def short_body(port: int) -> tuple[str, float]:
    _release()
    return _exchange(port, POST + b"Content-Length: 100\r\n\r\n{")


def unterminated_chunks(port: int) -> tuple[str, float]:
    _release()
    return _exchange(port, POST + b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n")


def header_100k(port: int) -> tuple[str, float]:
    return _exchange(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (100 << 10) + b"\r\n\r\n")


def size_5000_digits(port: int) -> tuple[str, float]:
    body = json.dumps({"prompt": "a cat", "size": "1" * 5000 + "x16"}).encode()
    return _exchange(port, POST + b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


def body_11mib(port: int) -> tuple[str, float]:
    body = b'{"prompt": "' + b"a" * (11 << 20) + b'"}'
    return _exchange(port, POST + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


CASES = [("300 idle connections", idle_300), ("slowloris, a byte every 2 s", slowloris),
         ("body shorter than its Content-Length", short_body), ("chunked body never terminated", unterminated_chunks),
         ("100 KiB header", header_100k), ("size of 5000 digits", size_5000_digits), ("11 MiB body", body_11mib)]


def _table(rows) -> str:
    head = (f"## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC — `bench/serve_edges.py`\n\n"
            f"- machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}\n"
            "- tiny SD on CPU, `ConnectionLimits(head_timeout=10, body_timeout=10, max_connections=256)`; after each "
            f"case, with its connections held: `/health/live` and a 1-step 32x32 generation, bound {BOUND:g} s\n")
    lines = ["| case | hostile client got | answered after (s) | /health/live (s) | generation (s) | within bound |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for name, status, took, live, made in rows:
        lines.append(f"| {name} | {status} | {took:.2f} | {live:.3f} | {made:.3f} | "
                     f"{'yes' if max(live, made) < BOUND else 'NO'} |")
    worst = max(max(live, made) for *_, live, made in rows)
    return head + "\n" + "\n".join(lines) + f"\n\n```\nsummary: edges_worst_check_s={worst:.3f} " \
        f"edges_within_bound={int(worst < BOUND)}\n```"


if __name__ == "__main__":
    sys.exit(main())
