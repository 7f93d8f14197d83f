"""Connection-level limits: what idle, slow and oversized clients may hold, enforced in uvicorn's h11 protocol.

uvicorn bounds none of these by itself: a connection that never sends a byte, a request head sent a byte at a time,
a body shorter than its Content-Length are held with no timer; its ``limit_concurrency`` answers every request past it
(probes too) in plain text; and its head-size limit is an h11 setting that httptools, run where it is installed,
ignores. So the server pins h11 and runs ``GuardedH11``, which adds, as nginx does:

- a head timeout (from a connection's start, or from its previous answer): a connection with no complete request head
  by then is closed, with a JSON 408 when it sent part of one;
- a body timeout (from the head): a body not received whole by then is answered a JSON 408 and the connection
  closed (the app sees its client leave);
- a cap on open connections below the process's file limit: past it the oldest connection holding no request (idle
  keep-alive, never sent a byte, or a head still coming) is closed for the new one, so probes are still answered;
  when every connection holds a request, the new one gets a JSON 503 with a Retry-After and is closed;
- a request head of at most ``max_head`` bytes (h11's own limit): past it, a JSON 431;
- a bounded drain: after an answer sent before the body was read (a 413) the rest of the body is read and dropped,
  ``drain`` bytes or ``linger`` seconds at most, then the connection is closed if the body has not ended; so the
  client reads the answer rather than a reset, and a keep-alive client whose body did end keeps its connection.
"""

from __future__ import annotations

import asyncio
import json
import resource
import uuid
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .access import retry_headers

RESERVED_FILES = 64  # file descriptors kept from connections: the model's files, logs, pipes, the listening socket


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may hold (seconds, bytes) and how many may be open. ``max_connections`` None: the
    process's file limit less ``RESERVED_FILES``, at most 1024."""

    head_timeout: float = 10.0  # a request head, whole, from the connection's start or its previous answer
    body_timeout: float = 60.0  # a request body, whole, from its head (1 MiB at 17 KiB/s)
    keep_alive: float = 5.0  # idle seconds between two requests of one connection
    max_connections: int | None = None
    max_head: int = 64 * 1024  # bytes of a request line and headers
    drain: int = 16 << 20  # bytes of an unread body read and dropped after an early answer
    linger: float = 5.0  # seconds the drain may take

    def most_connections(self) -> int:
        """Connections open at once: ``max_connections``, below the file limit."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        room = max(8, soft - RESERVED_FILES) if soft != resource.RLIM_INFINITY else 1 << 20
        return min(self.max_connections or 1024, room)


def refusal(status: int, reason: str, message: str, code: str, retry_after: int | None = None) -> bytes:
    """A whole HTTP/1.1 answer, JSON in OpenAI's error shape, that closes its connection: written straight to the
    socket where no request cycle can answer (its head never came, or its body never will)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_busy", "param": None, "code": code}}).encode()
    lines = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
             "connection: close", f"x-request-id: {uuid.uuid4().hex}"]
    if retry_after is not None:
        lines.append(f"retry-after: {retry_after}")
    lines += [f"{name}: {value}" for name, value in retry_headers(status).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body


def protocol_for(limits: ConnectionLimits) -> type[GuardedH11]:
    """The protocol class uvicorn runs (``Config(http=...)``), holding ``limits``."""
    return type("GuardedH11", (GuardedH11,), {"limits": limits, "most": limits.most_connections()})


class _Bounded(h11.Connection):
    """h11's connection, refusing a whole request head past ``max_head`` bytes: h11 bounds only a head still
    incomplete (``max_incomplete_event_size``), and takes one that arrives whole in one read whatever its size."""

    def __init__(self, max_head: int):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head)
        self.max_head, self.too_big = max_head, False

    def next_event(self):
        event = super().next_event()
        if isinstance(event, h11.Request):
            size = len(event.method) + len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers)
            if size > self.max_head:
                self.too_big = True
                raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
        return event


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the limits of ``limits`` (``protocol_for``)."""

    limits = ConnectionLimits()
    most = 1024

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = _Bounded(self.limits.max_head)

    _timer: asyncio.TimerHandle | None = None
    _timer_for: str | None = None

    def connection_made(self, transport) -> None:
        self._timer = None
        self._draining, self._dropped, self._partial, self._refused = False, 0, False, False
        super().connection_made(transport)
        self.born = self.loop.time()
        if len(self.connections) > self.most and not self._evict():
            transport.write(refusal(503, "Service Unavailable", f"the server holds {self.most} connections, its "
                                    "most at once: retry in a few seconds", "too_many_connections", retry_after=5))
            transport.close()
            return
        self._arm(self.limits.head_timeout, self._head_late)

    def _evict(self) -> bool:
        """Close the oldest other connection that holds no request (idle, or its head still coming)."""
        idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11) and c._holds_nothing()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.born)
        oldest._close()
        return True

    def _holds_nothing(self) -> bool:
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def data_received(self, data: bytes) -> None:
        if self._refused:  # answered and half-closed (``_write_and_close``): what still comes is read and dropped
            self._dropped += len(data)
            if self._dropped > self.limits.drain:
                self._close()
            return
        if self._draining:  # the rest of a body answered early, which h11 drops: ``drain`` bytes at most
            self._dropped += len(data)
            if self._dropped > self.limits.drain:
                self._close()
                return
        super().data_received(data)
        # part of a head waits in h11's buffer (not a connection between two requests)
        self._partial = self.conn.their_state is h11.IDLE and bool(self.conn.trailing_data[0])
        self._follow()

    def _follow(self) -> None:
        """The timer for what the client owes now: a head, a body, or nothing (its request is the app's)."""
        state = self.conn.their_state
        if self._draining and state is not h11.SEND_BODY:  # the body answered early has ended: the next request
            self._draining = False
            self._arm(self.limits.head_timeout + self.limits.keep_alive, self._head_late)
        elif state is h11.SEND_BODY and self._timer_for not in ("body", "drain"):
            self._arm(self.limits.body_timeout, self._body_late, "body")
        elif state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.SEND_BODY:  # answered before its body was read (a 413): the client is still
            # sending, and h11 drops the rest as it comes; closing now would reset the connection under the answer
            self._draining, self._dropped = True, 0
            self._arm(self.limits.linger, self._close, "drain")
        elif self.conn.their_state is h11.IDLE:
            self._arm(self.limits.head_timeout + self.limits.keep_alive, self._head_late)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A malformed head, or one past ``max_head`` (h11 says which by its status hint): JSON, then closed."""
        big = getattr(self.conn, "too_big", False) or len(self.conn.trailing_data[0]) > self.limits.max_head
        if big:
            answer = refusal(431, "Request Header Fields Too Large", f"the request head is over this server's "
                             f"limit of {self.limits.max_head} bytes: send fewer or shorter headers",
                             "headers_too_large")
        else:
            answer = refusal(400, "Bad Request", f"the request is not valid HTTP/1.1 ({msg})", "invalid_http")
        self._write_and_close(answer)

    # ---- timers ----

    def _arm(self, seconds: float, late, kind: str = "head") -> None:
        self._disarm()
        self._timer, self._timer_for = self.loop.call_later(seconds, late), kind

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_for = None, None

    def _head_late(self) -> None:
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self._partial:  # part of a head came: say why it is closed
            self._write_and_close(refusal(408, "Request Timeout", f"the request head took more than "
                                          f"{self.limits.head_timeout:g} s: send it whole", "head_timeout"))
        else:
            self._close()

    def _body_late(self) -> None:
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        cycle = self.cycle
        answered = cycle is not None and cycle.response_started
        if cycle is not None:  # the app reads its client as gone
            cycle.disconnected = True
            cycle.message_event.set()
        if answered:
            self._close()
            return
        self._write_and_close(refusal(408, "Request Timeout", f"the request body took more than "
                                      f"{self.limits.body_timeout:g} s, or is shorter than its Content-Length: send "
                                      "it whole", "body_timeout"))

    # ---- closing ----

    def _write_and_close(self, answer: bytes) -> None:
        """``answer``, then a lingering close: this side shut for writing (the client reads the answer, then the
        end), what the client still sends read and dropped (``drain`` bytes, ``linger`` seconds at most), then
        closed. Closing at once while the client is still sending (the rest of a 100 KiB head after its 431) makes
        the kernel reset the connection, and a reset can reach the client before the answer it would have read."""
        self.transport.write(answer)
        if self.transport.is_closing() or not self.transport.can_write_eof():
            self._close()
            return
        self.transport.write_eof()
        self._refused, self._dropped = True, 0
        self._arm(self.limits.linger, self._close, "drain")

    def _close(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()
