#!/usr/bin/env python3
"""smoke_test: end-to-end checks and benchmarks for websearch_ring.py. Standard library only.

The server is run exactly as an MCP client runs it: ``[sys.executable, websearch_ring.py]`` as a
child process, newline-delimited JSON-RPC 2.0 over binary stdin/stdout pipes.

Usage:
  python smoke_test.py --offline   protocol checks against a loopback fake Tavily (no network)
  python smoke_test.py --bench     the performance figures of DESIGN section 10, fan-out, web_fetch
                                   and web_answer (no network; about two minutes, one of them a
                                   60 s answer that measures progress notifications)
  python smoke_test.py --soak 600  ten minutes of calls with 30% upstream faults: RSS after the
                                   first minute and at the end (no network)
  python smoke_test.py "query"     one real web_search with the default configuration

Contents:
  constants and small helpers;  FakeUpstream, a scriptable loopback HTTP server on 127.0.0.1 that
  test_websearch_ring.py imports too (response specs or handler functions per route, every request
  recorded);  the fakes built on it: FakeTavily, and for --bench FakeEngines (tavily, bing,
  duckduckgo and exa with overlapping results), FakeSite (a generated ~100 KB article) and FakeChat
  (a streaming chat endpoint);  RpcClient (JSON-RPC over pipes);  process probes (RSS, CPU);
  offline checks;  benchmarks;  real query;  main.

--offline prints one line per check (``ok  name`` / ``FAIL name: detail``), then ``N passed, M failed``,
and exits 1 on any failure. Every wait is bounded by a timeout, every loop by a count, and every
child process is killed in a ``finally`` (and by a watchdog if a phase overruns).
"""

import argparse
import base64
import collections
import contextlib
import hashlib
import json
import math
import os
import queue
import select
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
import zlib
from html import escape as html_escape
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import TCPServer
from urllib.parse import parse_qs, quote, urlsplit

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER_PATH = os.path.join(HERE, "websearch_ring.py")

PROTOCOL_VERSION = "2025-06-18"
CLIENT_INFO = {"name": "websearch-ring-smoke-test", "version": "1"}

# Waits. A healthy server answers in milliseconds; these only bound a broken one.
RPC_TIMEOUT_S = 10.0
# The fake's "slow" queries sleep this long, long enough to cancel them, short enough to bound a run.
SLOW_QUERY_S = 5.0
# A cancelled request must stay unanswered at least this long (brief: "~1.5 s").
CANCEL_SILENCE_S = 1.5
# Hard ceiling on one server process's life; the watchdog kills it after that.
OFFLINE_LIFETIME_S = 120.0
BENCH_PHASE_LIFETIME_S = 180.0
REAL_QUERY_TIMEOUT_S = 90.0

# Inherited variables that would change what the offline server talks to or how.
_CLEARED_PREFIXES = ("WEBSEARCH_", "TAVILY_", "EXA_", "GROK_", "BRAVE_", "SERPER_", "YEP_",
                     "SEARXNG_", "JINA_")
_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


class CheckError(Exception):
    """A check's expectation did not hold; the message is the FAIL detail."""


def wait_until(predicate, timeout=10.0, what="condition"):
    """Poll predicate() in 5 ms slices until it is true; AssertionError after `timeout` seconds.

    For state nothing can wait on (a counter, a list another thread appends to). Where there is
    something to wait on, wait on it: FakeUpstream.wait_for_requests, a response, an Event.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %.1fs waiting for %s" % (timeout, what))
        time.sleep(0.005)


def _short(obj, limit=300):
    """A one-line, bounded rendering of obj for FAIL details."""
    text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, default=repr)
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit] + "..."


def _median(values):
    return statistics.median(values) if values else float("nan")


def offline_env(fake_url, **overrides):
    """The server's environment for loopback runs: our fake Tavily only, no proxies, no keys."""
    env = {}
    for name, value in os.environ.items():
        upper = name.upper()
        if upper.startswith(_CLEARED_PREFIXES) or upper in _PROXY_VARS:
            continue
        env[name] = value
    env.update({
        "WEBSEARCH_VENDORS": "tavily",
        "WEBSEARCH_TAVILY_URL": fake_url,
        "WEBSEARCH_JINA_URL": "http://127.0.0.1:9",     # no page ever leaves the machine
        "NO_PROXY": "*",
        "no_proxy": "*",
    })
    env.update({k: str(v) for k, v in overrides.items()})
    return env


# ----------------------------------------------------------------------------------------------
# FakeUpstream: one scriptable loopback HTTP server, shared with test_websearch_ring.py
# ----------------------------------------------------------------------------------------------
# The unit tests import it from here (``from smoke_test import FakeUpstream``), so it stays
# standard library only and independent of the checks below.

FAKE_TIMEOUT_S = 10.0  # default bound for every wait on a fake
_HOLD_POLL_S = 0.02    # how often a held response looks for a client that hung up
_SHUTDOWN_POLL_S = 0.005  # how often the accept loop looks for close(): the time each close() takes

# Keys a response spec may carry; anything else is a mistake in the caller and fails loudly.
SPEC_KEYS = frozenset({
    "fixture", "status", "headers", "body", "delay_s", "drip", "chunked", "truncate", "close",
    "size", "block_until", "block_timeout_s",
})


def resolve_spec(spec, fixtures=None):
    """Normalise one response spec (a fixture name or a dict) into a complete dict.

    Spec keys:
      fixture          name in `fixtures` ({name: {"status", "headers", "body"}}); its status,
                       headers and body are the defaults
      status           HTTP status (default 200)
      headers          dict, added to (and overriding) the fixture's headers
      body             str (sent as UTF-8), bytes, or a dict/list (sent as JSON)
      delay_s          wait this long before sending the status line
      drip             (chunk_bytes, pause_s): send the body in small pieces with pauses
      chunked          True: Transfer-Encoding: chunked
      truncate         True: declare a Content-Length 1000 bytes longer than the body, send the
                       body, close. An int n: declare the full length, send only n bytes, close.
                       With chunked, the terminating zero-length chunk is never sent.
      close            True: read the request, then close the connection without answering
      size             generate a body of exactly this many bytes (the body repeated, or "x")
      block_until      threading.Event: hold the request open (before the status line) until
                       it is set, at most block_timeout_s (default FAKE_TIMEOUT_S), then answer
    While delayed or held, a client that closes its socket is noticed and recorded in
    ``FakeUpstream.disconnects`` (how cancellation tests see an abort).
    """
    if isinstance(spec, str):
        spec = {"fixture": spec}
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise ValueError("unknown response spec keys: %s" % sorted(unknown))
    resolved = {
        "status": 200, "headers": {}, "body": b"", "delay_s": 0.0, "drip": None,
        "chunked": False, "truncate": False, "close": False, "size": None,
        "block_until": None, "block_timeout_s": FAKE_TIMEOUT_S,
    }
    if "fixture" in spec:
        if fixtures is None or spec["fixture"] not in fixtures:
            raise ValueError("no fixture named %r" % spec["fixture"])
        fixture = fixtures[spec["fixture"]]
        if fixture["status"] is None:
            raise ValueError("%s is a decode table, not a response" % spec["fixture"])
        resolved.update(status=fixture["status"], headers=dict(fixture["headers"]),
                        body=fixture["body"])
    for key, value in spec.items():
        if key == "headers":
            resolved["headers"] = {**resolved["headers"], **value}
        elif key != "fixture":
            resolved[key] = value
    body = resolved["body"]
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode("utf-8")
        resolved["headers"].setdefault("Content-Type", "application/json")
    elif isinstance(body, str):
        body = body.encode("utf-8")
    resolved["body"] = body
    if resolved["size"] is not None:
        pattern = body or b"x"
        resolved["body"] = (pattern * (resolved["size"] // len(pattern) + 1))[:resolved["size"]]
    if resolved["drip"] is not None and len(resolved["drip"]) != 2:
        raise ValueError("drip is (chunk_bytes, pause_s)")
    return resolved


class RecordedRequest:
    """One request a FakeUpstream received (and how much of its answer's body went out)."""

    def __init__(self, method, path, headers, body):
        self.method = method          # "GET", "POST", ...
        self.path = path              # as sent, with the query string
        self.headers = headers        # http.client.HTTPMessage: case-insensitive .get()
        self.body = body              # bytes
        parts = urlsplit(path)
        self.route_path = parts.path  # what routes match on
        self.query = parse_qs(parts.query, keep_blank_values=True)
        self.body_sent = 0            # bytes of the answer's body written so far

    def header(self, name, default=None):
        """A request header, case-insensitive."""
        return self.headers.get(name, default)

    def json(self):
        """The body parsed as JSON."""
        return json.loads(self.body.decode("utf-8"))

    def form(self):
        """The body parsed as an urlencoded form: {name: first value}."""
        fields = parse_qs(self.body.decode("utf-8"), keep_blank_values=True)
        return {name: values[0] for name, values in fields.items()}

    def __repr__(self):
        return "<RecordedRequest %s %s %d bytes>" % (self.method, self.path, len(self.body))


def _peer_closed(sock):
    """True when the client has closed its end (readable with nothing to read)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _matches(request, method, path):
    return ((method is None or request.method == method.upper())
            and (path is None or request.route_path == path))


class _FakeHandler(BaseHTTPRequestHandler):
    """One exchange with a FakeUpstream: a scripted response spec, or a route's handler function.

    A handler function gets this object, with ``body``, ``query``, ``route_path`` and
    ``headers`` of the request, and answers with :meth:`reply`, :meth:`reply_json` or
    :meth:`stream`.
    """

    protocol_version = "HTTP/1.1"  # keep-alive and chunked, like the real vendors
    server_version = "FakeUpstream/1"
    timeout = 30  # socket timeout: a stuck client cannot hold a handler thread forever
    # Headers and body go out in separate writes; without TCP_NODELAY, Nagle's algorithm and the
    # client's delayed ACK stall every kept-alive answer ~40 ms (real API front ends disable it too).
    disable_nagle_algorithm = True

    def log_message(self, format, *args):  # noqa: A002 (signature fixed by the base class)
        """Quiet: failures show up as assertions, not as access-log noise."""

    def _serve(self):
        fake = self.server.fake
        self.recorded = RecordedRequest(self.command, self.path, self.headers, self._read_body())
        self.body, self.query = self.recorded.body, self.recorded.query
        self.route_path = self.recorded.route_path
        answer = fake._record_and_pick(self.recorded)
        try:
            if callable(answer):
                answer(self)
            else:
                self._answer(answer, self.recorded)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            fake._record_disconnect(self.recorded)
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    def _read_body(self):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            data = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(data)
                data += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    # -- for handler functions --

    def reply(self, status, content_type, data):
        """One answer with a Content-Length; the connection stays open."""
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the server aborted the request (cancellation): nothing to tell
            self.close_connection = True

    def reply_json(self, status, obj):
        self.reply(status, "application/json", json.dumps(obj).encode("utf-8"))

    def stream(self, content_type, pieces):
        """Send 200 and each piece of the iterable as it comes; False if the client hung up."""
        self.close_connection = True
        try:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for piece in pieces:
                self.wfile.write(piece)
        except OSError:  # a client may stop reading once it has the end marker
            return False
        return True

    # -- for response specs --

    def _hold(self, event, timeout_s, request):
        """Wait until `event` is set or `timeout_s` passes; False if the client left meanwhile."""
        fake = self.server.fake
        deadline = time.monotonic() + timeout_s
        while event is None or not event.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            if fake.stopping.is_set():
                self.close_connection = True
                return False
            if _peer_closed(self.connection):
                fake._record_disconnect(request)
                self.close_connection = True
                return False
            (event or fake.stopping).wait(min(_HOLD_POLL_S, remaining))
        return True

    def _answer(self, spec, request):
        if spec["block_until"] is not None:
            if not self._hold(spec["block_until"], spec["block_timeout_s"], request):
                return
        if spec["delay_s"] and not self._hold(None, spec["delay_s"], request):
            return
        if spec["close"]:
            self.close_connection = True
            return
        body, truncate, chunked = spec["body"], spec["truncate"], spec["chunked"]
        self.send_response(spec["status"])
        for name, value in spec["headers"].items():
            self.send_header(name, value)
        explicit = {name.lower() for name in spec["headers"]}
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        elif "content-length" not in explicit:
            declared = len(body) + 1000 if truncate is True else len(body)
            self.send_header("Content-Length", str(declared))
        if truncate is not False and truncate is not True:
            body = body[:truncate]
        if truncate:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        chunk_bytes, pause_s = spec["drip"] or (65536, 0)
        for start in range(0, len(body), chunk_bytes):
            piece = body[start:start + chunk_bytes]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if pause_s:
                self.wfile.flush()
                self.server.fake._record_body_sent(request, len(piece))
                if not self._hold(None, pause_s, request):
                    return
        if chunked and not truncate:
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        if not pause_s:
            self.server.fake._record_body_sent(request, len(body))


class _FakeHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # Port 0 never needs SO_REUSEADDR, and on Windows it means something else (another socket
    # may bind the same port while this one listens), so only POSIX keeps HTTPServer's default.
    # SO_REUSEPORT (port sharing, whatever a Python version's HTTPServer defaults to) stays off.
    allow_reuse_address = sys.platform != "win32"
    allow_reuse_port = False
    # A burst of connections (fan-out, concurrent calls, the benches) must not overflow the listen
    # queue: Windows refuses what does not fit, macOS and Linux drop the SYN and the client waits ~1 s.
    request_queue_size = 256

    def server_bind(self):
        # HTTPServer.server_bind calls socket.getfqdn(), a reverse DNS lookup that can stall.
        TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, socket.timeout)):
            return  # the client went away: normal in timeout and cancellation tests
        self.fake.errors.append(traceback.format_exc())


class FakeUpstream:
    """A loopback HTTP server on 127.0.0.1, port 0, whose answers are scripted per route.

        with FakeUpstream(fixtures=FIXTURES) as fake:
            fake.route("POST", "/search", ["tavily/rate_limited.json",
                                           "tavily/search_success.json"])
            ... point the server at fake.url ...
            assert fake.hits("POST", "/search") == 2

    A route answers with response specs (see :func:`resolve_spec`), served in order with the
    last one repeating, or with a handler function that writes its own answer (see
    ``_FakeHandler``). Routes match on method and path without the query string; a ``prefix``
    route matches every path that starts with it. An unrouted request gets a 404 JSON body.

    Every request is kept in ``requests`` (a RecordedRequest); clients that hung up while a
    response was held or dripped in ``disconnects``; unexpected handler exceptions in ``errors``.
    Handler functions may count requests under keys of their own with :meth:`visit` (``visits``,
    ``active`` and ``max_active``), and delay with :meth:`pause`, which :meth:`close` cuts short.
    """

    name = "fake-upstream"

    def __init__(self, *, fixtures=None, latency_s=0.0):
        self.fixtures = fixtures
        self.latency_s = latency_s
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # any recorded change; guards what follows
        self._routes = {}      # (METHOD, path) -> route
        self._prefixes = []    # (METHOD, path prefix, route)
        self.requests = []
        self.disconnects = []
        self.errors = []
        self.visits = collections.Counter()
        self.active = 0
        self.max_active = 0
        self._httpd = _FakeHTTPServer(("127.0.0.1", 0), _FakeHandler)
        self._httpd.fake = self
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": _SHUTDOWN_POLL_S},
            name="%s:%d" % (self.name, self.port), daemon=True)
        self._thread.start()

    @property
    def port(self):
        """The port the fake listens on."""
        return self._httpd.server_address[1]

    @property
    def url(self):
        """``http://127.0.0.1:PORT``, the base URL to configure."""
        return "http://127.0.0.1:%d" % self.port

    def route(self, method, path, responses, *, prefix=False):
        """Script `method path`: a handler function, one response spec or a list of them."""
        if callable(responses):
            route = {"handler": responses}
        else:
            specs = responses if isinstance(responses, list) else [responses]
            if not specs:
                raise ValueError("a route needs at least one response")
            # A typo fails here, not in a handler thread.
            route = {"specs": [resolve_spec(spec, self.fixtures) for spec in specs], "served": 0}
        with self._lock:
            if prefix:
                self._prefixes.append((method.upper(), path, route))
            else:
                self._routes[(method.upper(), path)] = route

    # -- what arrived --

    def requests_to(self, method=None, path=None):
        """The recorded requests, optionally only those for `method` and/or `path`."""
        with self._lock:
            return [r for r in self.requests if _matches(r, method, path)]

    def hits(self, method, path):
        """How many requests `method path` received."""
        return len(self.requests_to(method, path))

    def _wait(self, done, timeout, failure):
        """Wait until done() (called under the lock) is true; AssertionError(failure()) at `timeout`."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not done():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(failure())
                self._changed.wait(remaining)

    def wait_for_requests(self, n=1, *, method=None, path=None, timeout=FAKE_TIMEOUT_S):
        """Wait until at least `n` matching requests arrived; return them."""
        def found():
            return [r for r in self.requests if _matches(r, method, path)]
        self._wait(lambda: len(found()) >= n, timeout, lambda: (
            "FakeUpstream: %d of %d requests (%s %s) within %.1fs; got %r"
            % (len(found()), n, method, path, timeout, self.requests)))
        return self.requests_to(method, path)

    def expect_no_more_requests(self, n, *, within_s, method=None, path=None):
        """Assert that no more than `n` matching requests arrive within `within_s` seconds."""
        deadline = time.monotonic() + within_s
        with self._changed:
            while True:
                count = sum(1 for r in self.requests if _matches(r, method, path))
                remaining = deadline - time.monotonic()
                if count > n or remaining <= 0:
                    break
                self._changed.wait(remaining)
        assert count <= n, "FakeUpstream: %d requests (%s %s), expected at most %d" % (
            count, method, path, n)

    def wait_for_body_sent(self, nbytes, *, method=None, path=None, timeout=FAKE_TIMEOUT_S):
        """Wait until a matching request's answer has sent `nbytes` of its body; return it."""
        def sent():
            return [r for r in self.requests if _matches(r, method, path) and r.body_sent >= nbytes]
        self._wait(lambda: sent(), timeout, lambda: (
            "FakeUpstream: no answer to %s %s sent %d body bytes within %.1fs"
            % (method, path, nbytes, timeout)))
        with self._lock:
            return sent()[0]

    def wait_for_disconnects(self, n=1, *, timeout=FAKE_TIMEOUT_S):
        """Wait until `n` clients hung up on a held or dripping response; return those requests."""
        self._wait(lambda: len(self.disconnects) >= n, timeout, lambda: (
            "FakeUpstream: %d of %d disconnects within %.1fs" % (len(self.disconnects), n, timeout)))
        with self._lock:
            return list(self.disconnects)

    # -- for handler functions --

    @contextlib.contextmanager
    def visit(self, key):
        """Count one request under `key` and hold it as active while the body runs."""
        with self._changed:
            self.visits[key] += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self._changed.notify_all()
        try:
            yield
        finally:
            with self._lock:
                self.active -= 1

    def visits_for(self, key):
        """How many requests were counted under `key`."""
        with self._lock:
            return self.visits[key]

    def wait_for_visit(self, key, timeout_s):
        """True once a request was counted under `key` (False after `timeout_s`)."""
        try:
            self._wait(lambda: self.visits[key] > 0, timeout_s, lambda: "")
        except AssertionError:
            return False
        return True

    def reset_peak(self):
        """Start a new max_active measurement from the requests active now."""
        with self._lock:
            self.max_active = self.active

    def pause(self, seconds):
        """Sleep up to `seconds`; ends at once when the fake closes."""
        if seconds > 0:
            self.stopping.wait(seconds)

    # -- lifetime --

    def close(self):
        """Stop serving; held, delayed and paused responses are dropped at once."""
        self.stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(FAKE_TIMEOUT_S)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    # -- called by the handler threads --

    def _record_and_pick(self, request):
        """Record `request`; return its route's handler function or its next response spec."""
        with self._changed:
            self.requests.append(request)
            self._changed.notify_all()
            key = (request.method, request.route_path)
            route = self._routes.get(key) or next(
                (r for m, p, r in self._prefixes if m == key[0] and key[1].startswith(p)), None)
            if route is None:
                message = "FakeUpstream has no route for %s %s" % key
                return resolve_spec({"status": 404, "body": {"error": message}})
            if "handler" in route:
                return route["handler"]
            specs = route["specs"]
            spec = specs[min(route["served"], len(specs) - 1)]
            route["served"] += 1
            return spec

    def _record_disconnect(self, request):
        with self._changed:
            self.disconnects.append(request)
            self._changed.notify_all()

    def _record_body_sent(self, request, nbytes):
        with self._changed:
            request.body_sent += nbytes
            self._changed.notify_all()


# ----------------------------------------------------------------------------------------------
# Fake upstreams of the checks and benchmarks: each speaks one upstream's real wire format
# ----------------------------------------------------------------------------------------------

def _tavily_query(request):
    """(query, max_results) of a Tavily /search body, or (None, None) when it is malformed."""
    try:
        body = json.loads(request.body.decode("utf-8"))
        query = body["query"]
        if not isinstance(query, str):
            raise TypeError("query is not a string")
    except (ValueError, KeyError, TypeError):
        return None, None
    return query, body.get("max_results")


def _tavily_body(query, results):
    """Tavily's /search answer for results given as (title, url, content, score)."""
    return {"query": query, "follow_up_questions": None, "answer": None, "images": [],
            "results": [{"title": title, "url": url, "content": content, "score": score, "raw_content": None}
                        for title, url, content, score in results],
            "response_time": 0.1}


class FakeTavily(FakeUpstream):
    """Loopback stand-in for api.tavily.com (POST /search), counting requests per query.

    Results depend on the query, so distinct queries give distinct results. ``latency_s`` delays
    every answer; a query containing "slow" sleeps ``slow_s`` instead (bounded, and cut short by
    ``close()``) so cancellation can be tested.
    """

    name = "fake-tavily"

    def __init__(self, *, latency_s=0.0, slow_s=SLOW_QUERY_S, pages_at=None):
        super().__init__(latency_s=latency_s)
        self.slow_s = slow_s
        self.pages_at = pages_at     # a FakeSite URL: results link to its articles instead of *.test hosts
        self.route("POST", "/search", self._search)

    def _search(self, request):
        query, max_results = _tavily_query(request)
        if query is None:
            request.reply_json(400, {"detail": {"error": "400 Bad Request"}})
            return
        with self.visit(query):
            self.pause(self.slow_s if "slow" in query else self.latency_s)
            request.reply_json(200, self.build_response(query, max_results))

    def result_url(self, query, rank):
        tag = hashlib.sha1(query.encode("utf-8")).hexdigest()[:10]
        if self.pages_at:
            return "%s/article/%s-%d" % (self.pages_at, tag, rank)
        return "https://example-%s.test/page/%d" % (tag, rank)

    def build_response(self, query, max_results):
        if isinstance(max_results, bool) or not isinstance(max_results, int):
            max_results = 5  # Tavily's default
        count = max(0, min(20, max_results))
        return _tavily_body(query, [(
            "%s - result %d" % (query, rank), self.result_url(query, rank),
            "Snippet %d about %s, served by the loopback fake." % (rank, query), round(0.95 - 0.04 * rank, 4))
            for rank in range(1, count + 1)])


# The fan-out bench's engines, in ring order, and how their 20 results overlap.
FANOUT_ENGINES = ("tavily", "bing", "duckduckgo", "exa")
ENGINE_RESULTS = 20
SHARED_BY_ALL = 5      # URLs every engine returns, each spelling them its own way
SHARED_WITH_NEXT = 3   # URLs each engine shares with the next one in the ring


class FakeEngines(FakeUpstream):
    """Four search engines on one loopback port, each in its own wire format, all after `latency_s`.

    POST /search: Tavily JSON.  GET /search?q=: Bing's result page (``li.b_algo``, ``/ck/a`` links).
    POST /html/: DuckDuckGo's HTML page (``div.web-result``, ``uddg`` links).  POST /mcp: Exa's hosted
    MCP endpoint (a JSON-RPC result in one server-sent event).  Requests are counted per
    (engine, query); :meth:`results` says what each engine returns for a query.
    """

    name = "fake-engines"

    def __init__(self, *, latency_s=0.1):
        super().__init__(latency_s=latency_s)
        self.route("POST", "/search", self._tavily)
        self.route("GET", "/search", self._bing)
        self.route("POST", "/html/", self._duckduckgo)
        self.route("POST", "/mcp", self._exa)

    @staticmethod
    def pages(engine):
        """The page ids one engine returns, best first: shared ones, then its own."""
        index, count = FANOUT_ENGINES.index(engine), len(FANOUT_ENGINES)
        shared = ["all-%d" % k for k in range(SHARED_BY_ALL)]
        ids = shared[index:] + shared[:index]  # engines rank the common pages differently
        ids += ["pair%d-%d" % (index, k) for k in range(SHARED_WITH_NEXT)]
        ids += ["pair%d-%d" % ((index - 1) % count, k) for k in range(SHARED_WITH_NEXT)]
        return ids + ["own%d-%d" % (index, k) for k in range(ENGINE_RESULTS - len(ids))]

    @classmethod
    def results(cls, engine, query):
        """ENGINE_RESULTS (title, url, snippet) of one engine for a query.

        A shared page's URL differs between engines only in what URL normalisation removes:
        ``www.`` and a trailing slash (bing), ``utm_*`` parameters (duckduckgo), a text fragment (exa).
        """
        index = FANOUT_ENGINES.index(engine)
        tag = hashlib.sha1(query.encode("utf-8")).hexdigest()[:8]
        out = []
        for rank, page in enumerate(cls.pages(engine), 1):
            host, path = "%s.site-%s.test" % (page.split("-")[0], tag), "/articles/%s" % page
            url = "https://%s%s" % (host, path)
            if not page.startswith("own"):
                url = (url, "https://www.%s%s/" % (host, path),
                       "%s?utm_source=%s&utm_medium=organic" % (url, engine),
                       "%s#:~:text=%s" % (url, quote(query)))[index % 4]
            out.append(("%s: %s (%s #%d)" % (query, page, engine, rank), url,
                        "What %s says about %s in result %d: a sentence or two of snippet text." % (
                            engine, query, rank)))
        return out

    @classmethod
    def expected_duplicates(cls):
        """Results that de-duplication by normalized URL removes from the four lists."""
        pages = [page for engine in FANOUT_ENGINES for page in cls.pages(engine)]
        return len(pages) - len(set(pages))

    def _answer(self, engine, query, request, content_type, render):
        with self.visit((engine, query)):
            self.pause(self.latency_s)
            request.reply(200, content_type, render(self.results(engine, query)).encode("utf-8"))

    def _tavily(self, request):
        query, _ = _tavily_query(request)
        if query is None:
            request.reply_json(400, {"detail": {"error": "400 Bad Request"}})
            return
        self._answer("tavily", query, request, "application/json", lambda results: json.dumps(_tavily_body(
            query, [(t, u, s, round(0.9 - 0.01 * i, 3)) for i, (t, u, s) in enumerate(results)])))

    def _bing(self, request):
        query = (request.query.get("q") or [""])[0]

        def render(results):
            items = "".join(
                '<li class="b_algo" data-bm="%d"><h2><a target="_blank" href="%s" h="ID=SERP,%d.1">%s</a></h2>'
                '<div class="b_caption"><p class="b_lineclamp3">%s</p></div></li>\n' % (
                    rank, html_escape(_bing_link(url)), 5000 + rank, html_escape(title), html_escape(snippet))
                for rank, (title, url, snippet) in enumerate(results, 1))
            return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>%s - Search</title></head>'
                    '<body><main aria-label="Search Results"><div id="b_content"><ol id="b_results">\n%s</ol>'
                    '</div></main></body></html>' % (html_escape(query), items))
        self._answer("bing", query, request, "text/html; charset=utf-8", render)

    def _duckduckgo(self, request):
        query = (parse_qs(request.body.decode("utf-8", "replace")).get("q") or [""])[0]

        def render(results):
            items = "".join(
                '<div class="result results_links results_links_deep web-result ">'
                '<div class="links_main links_deep result__body"><h2 class="result__title">'
                '<a rel="nofollow" class="result__a" href="%s">%s</a></h2>'
                '<a class="result__snippet" href="%s">%s</a></div></div>\n' % (
                    html_escape(_ddg_link(url)), html_escape(title), html_escape(_ddg_link(url)),
                    html_escape(snippet)) for title, url, snippet in results)
            return ('<!DOCTYPE html><html><head><meta http-equiv="content-type" content="text/html; charset=UTF-8">'
                    '<title>%s at DuckDuckGo</title></head><body class="body--html"><div class="serp__results">'
                    '<div id="links" class="results">\n%s</div></div></body></html>' % (html_escape(query), items))
        self._answer("duckduckgo", query, request, "text/html; charset=utf-8", render)

    def _exa(self, request):
        try:
            call = json.loads(request.body.decode("utf-8"))
            query, rpc_id = call["params"]["arguments"]["query"], call["id"]
        except (ValueError, KeyError, TypeError):
            request.reply_json(400, {"jsonrpc": "2.0", "id": None,
                                     "error": {"code": -32700, "message": "Parse error"}})
            return

        def render(results):
            text = "\n\n---\n\n".join("Title: %s\nURL: %s\nPublished: N/A\nAuthor: N/A\nHighlights:\n%s" % r
                                      for r in results)
            message = {"jsonrpc": "2.0", "id": rpc_id, "result": {"content": [{"type": "text", "text": text}]}}
            return "event: message\ndata: %s\n\n" % json.dumps(message)
        self._answer("exa", query, request, "text/event-stream", render)


def _bing_link(url):
    """Bing's click-tracking form of a result link: /ck/a?...&u=a1<base64url of the target>."""
    encoded = base64.urlsafe_b64encode(url.encode("utf-8")).decode("ascii").rstrip("=")
    return "https://www.bing.com/ck/a?!&&p=%s&ptn=3&ver=2&u=a1%s&ntb=1" % (
        hashlib.sha1(url.encode("utf-8")).hexdigest(), encoded)


def _ddg_link(url):
    """DuckDuckGo's redirect form of a result link: //duckduckgo.com/l/?uddg=<quoted target>."""
    return "//duckduckgo.com/l/?uddg=%s&rut=%s" % (quote(url, safe=""), hashlib.sha1(url.encode()).hexdigest())


ARTICLE_BYTES = 100 * 1024
_WORDS = ("request deadline retry budget socket upstream cache vendor parser stream token header latency "
          "backoff jitter proxy failover ranking snippet extractor paragraph cookie timeout session client "
          "server answer result").split()
_TOPICS = ("Timeouts that add up", "Retry budgets", "Circuit breakers", "Connection pools", "Caching results",
           "Coalescing requests", "Parsing streams", "Rate limits", "Proxies and TLS", "Measuring latency")
_CODE = (
    ("python", 'def fetch_{n}(url, timeout_s=10.0):\n    """Fetch one page within a deadline."""\n'
               '    deadline = time.monotonic() + timeout_s\n    for attempt in range(3):\n'
               '        if time.monotonic() >= deadline:\n            raise TimeoutError("budget {n} spent")\n'
               '        if attempt < 2 and status in (429, 503):\n            continue\n\n    return {{"ok": True}}'),
    ("javascript", 'async function fetch{n}(url) {{\n  const ctrl = new AbortController();\n'
                   '  const timer = setTimeout(() => ctrl.abort(), 10_000);\n'
                   '  try {{\n    return await fetch(url, {{ signal: ctrl.signal }});\n'
                   '  }} finally {{\n    clearTimeout(timer);\n  }}\n}}'),
    ("bash", 'for i in $(seq 1 {n}); do\n  curl -sS --max-time 5 "https://example.test/?page=$i&size=20" \\\n'
             '    | jq \'.results[] | select(.score > 0.5)\' >> out.json && echo "page $i ok"\ndone'),
    ("json", '{{\n  "section": {n},\n  "retries": {{"max": 3, "backoff_ms": [100, 200, 400]}},\n'
             '  "vendors": ["tavily", "bing", "duckduckgo", "exa"],\n  "html": "<b>escaped</b> & kept"\n}}'),
    ("go", 'func fetch{n}(ctx context.Context, url string) (*http.Response, error) {{\n'
           '\tctx, cancel := context.WithTimeout(ctx, 10*time.Second)\n\tdefer cancel()\n'
           '\treq, err := http.NewRequestWithContext(ctx, "GET", url, nil)\n\tif err != nil && n < {n} {{\n'
           '\t\treturn nil, err\n\t}}\n\treturn http.DefaultClient.Do(req)\n}}'),
)


def _prose(seed, sentences):
    """Deterministic filler: `sentences` sentences of twelve words."""
    out = []
    for s in range(sentences):
        words = [_WORDS[(seed * 31 + s * 7 + i * i + 3 * i) % len(_WORDS)] for i in range(12)]
        out.append(" ".join(words).capitalize() + ".")
    return " ".join(out)


def build_article(target_bytes=ARTICLE_BYTES):
    """A long HTML article inside page chrome, and what its Markdown must keep.

    The chrome: head with style and script, a cookie banner, a site header with navigation,
    breadcrumbs, a sidebar, a footer. The article: sections with h2 and h3 headings, paragraphs
    with links and emphasis, figures, nested lists, tables and code blocks, added until the page
    is `target_bytes` long. Returns ``(html bytes, expected)``: expected maps ``headings``,
    ``table_rows`` and ``list_items`` to Markdown lines, ``code_blocks`` to fenced blocks.
    """
    title = "Designing resilient web clients: a field guide"
    expected = {"headings": ["# " + title], "table_rows": [], "code_blocks": [], "list_items": []}
    head = [
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1"><title>%s | Example Engineering</title>'
        % title,
        "<style>body{font:16px/1.5 system-ui} .cookie-consent{position:fixed;bottom:0} pre{overflow:auto}</style>",
        '<script>window.dataLayer=window.dataLayer||[];function gtag(){dataLayer.push(arguments)}</script>',
        '</head><body><div id="cookie-banner" class="cookie-consent" role="dialog"><p>We use cookies to improve '
        'your experience. <a href="/privacy">Privacy policy</a></p><button>Accept all</button></div>',
        '<header class="site-header"><a class="logo" href="/"><img src="/logo.svg" alt="Example Engineering"></a>'
        '<nav aria-label="Main"><ul><li><a href="/blog">Blog</a></li><li><a href="/docs">Docs</a></li>'
        '<li><a href="/about">About</a></li></ul></nav></header>',
        '<nav class="breadcrumbs"><a href="/">Home</a> &rsaquo; <a href="/blog">Blog</a></nav>',
        '<main id="content"><article class="post"><h1>%s</h1>' % title,
        '<p class="byline">By Ada Example &middot; <time datetime="2026-03-01">1 March 2026</time></p>',
    ]
    tail = [
        "</article>",
        '<aside class="sidebar"><h2>Related posts</h2><ul><li><a href="/blog/1">Retries</a></li>'
        '<li><a href="/blog/2">Timeouts</a></li></ul></aside></main>',
        '<footer class="site-footer"><p>&copy; 2026 Example Engineering</p><ul><li><a href="/terms">Terms</a></li>'
        '<li><a href="/privacy">Privacy</a></li></ul></footer>',
        '<script src="/static/analytics.js" async></script></body></html>',
    ]
    body, size, n = [], sum(map(len, head + tail)), 0
    while size < target_bytes:
        n += 1
        section = _article_section(n, expected)
        body.append(section)
        size += len(section)
    return "\n".join(head + body + tail).encode("utf-8"), expected


def _article_section(n, expected):
    """One section of the article (h2, paragraphs, a figure, h3 subsections, a list, a code block,
    a table every other section); records what its Markdown must keep in `expected`."""
    topic = _TOPICS[n % len(_TOPICS)]
    heading = "Part %d: %s" % (n, topic)
    expected["headings"].append("## " + heading)
    parts = ['<section id="part-%d"><h2>%s</h2>' % (n, html_escape(heading))]
    for p in range(3):
        seed = n * 10 + p
        parts.append('<p>%s See <a href="/docs/%d-%d">the notes on %s</a>, where <strong>%s</strong> meets '
                     '<em>%s</em> and <code>timeout_s=%d</code> applies. %s</p>' % (
                         _prose(seed, 2), n, p, topic.lower(), _WORDS[seed % len(_WORDS)],
                         _WORDS[(seed + 5) % len(_WORDS)], n + p, _prose(seed + 1, 2)))
    parts.append('<figure><img src="/images/part-%d.png" alt="Diagram %d: %s" width="640" height="360">'
                 "<figcaption>Figure %d. How %s behaves under load.</figcaption></figure>" % (
                     n, n, topic, n, topic.lower()))
    for k in (1, 2):
        sub = "Detail %d.%d: %s, case %d" % (n, k, topic, k)
        expected["headings"].append("### " + sub)
        parts.append("<h3>%s</h3><p>%s</p>" % (html_escape(sub), _prose(n * 10 + k + 5, 3)))
    items = ["Keep %s bounded in section %d" % (_WORDS[(n + i) % len(_WORDS)], n) for i in range(4)]
    steps = ["Step %d of part %d: check the %s" % (i, n, _WORDS[(n * 3 + i) % len(_WORDS)]) for i in (1, 2, 3)]
    parts.append("<ul>\n  <li>%s</li>\n  <li>%s with <code>retry=%d</code>\n    <ol>%s</ol>\n  </li>\n"
                 "  <li>%s</li>\n  <li>%s</li>\n</ul>" % (
                     items[0], items[1], n, "".join("<li>%s</li>" % s for s in steps), items[2], items[3]))
    expected["list_items"] += ["- " + items[0], "- %s with `retry=%d`" % (items[1], n)]
    expected["list_items"] += ["%d. %s" % (i, s) for i, s in enumerate(steps, 1)]
    expected["list_items"] += ["- " + items[2], "- " + items[3]]
    lang, template = _CODE[n % len(_CODE)]
    code = template.format(n=n)
    expected["code_blocks"].append("```%s\n%s\n```" % (lang, code))
    parts.append('<pre class="highlight"><code class="language-%s">%s\n</code></pre>' % (lang, html_escape(code)))
    if n % 2:
        rows = [["Vendor", "Median (ms)", "p95 (ms)", "Errors (%)"]]
        rows += [[engine, str(80 + (n * 7 + r * 13) % 90), str(200 + (n * 11 + r * 17) % 300),
                  "%.1f" % ((n + r) % 7 / 2.0)] for r, engine in enumerate(FANOUT_ENGINES + ("brave", "serper"))]
        expected["table_rows"] += ["| " + " | ".join(row) + " |" for row in rows]
        parts.append('<div class="table-wrap"><table><thead><tr>%s</tr></thead><tbody>%s</tbody></table></div>' % (
            "".join("<th>%s</th>" % c for c in rows[0]),
            "".join("<tr>%s</tr>" % "".join("<td>%s</td>" % c for c in row) for row in rows[1:])))
    parts.append("</section>")
    return "\n".join(parts)


def article_coverage(markdown, expected):
    """{kind: [what is missing]} for each kind of piece `expected` lists (see build_article)."""
    lines = {line.strip() for line in markdown.split("\n")}
    missing = {kind: [e for e in expected[kind] if e not in lines] for kind in ("headings", "table_rows",
                                                                                 "list_items")}
    missing["code_blocks"] = [c for c in expected["code_blocks"] if c not in markdown]
    return missing


class FakeSite(FakeUpstream):
    """A web site for web_fetch: GET /article/<anything> serves the same ~100 KB article.

    Requests are counted per path, so each path is a distinct URL with the same content;
    ``latency_s`` delays the answer (to keep a fetch in flight while identical ones arrive).
    """

    name = "fake-site"

    def __init__(self, *, latency_s=0.0):
        super().__init__(latency_s=latency_s)
        self.article, self.expected = build_article()
        self.route("GET", "/article/", self._article, prefix=True)

    def _article(self, request):
        with self.visit(request.route_path):
            self.pause(self.latency_s)
            request.reply(200, "text/html; charset=utf-8", self.article)


# The crawl bench's site (see FakeCrawlSite).
CRAWL_SITE_PAGES = 300
CRAWL_PAGE_S = 0.05          # every page answers after this long
CRAWL_BENCH_PAGES = 50       # pages of one timed crawl
CRAWL_RSS_PAGES = 100        # pages of the crawl whose RSS growth is measured
CRAWL_RUNS = 3


class FakeCrawlSite(FakeUpstream):
    """A site for web_crawl: CRAWL_SITE_PAGES articles of a few KB at /p/N, each linking to the next
    five, all listed in /sitemap.xml; every page answers after CRAWL_PAGE_S (robots.txt is a 404)."""

    name = "fake-crawl-site"

    def __init__(self):
        super().__init__()
        urls = "".join("<url><loc>%s/p/%d</loc></url>" % (self.url, i) for i in range(CRAWL_SITE_PAGES))
        self.route("GET", "/sitemap.xml", {"headers": {"Content-Type": "application/xml"},
                                           "body": "<urlset>%s</urlset>" % urls})
        self.route("GET", "/p/", self._page, prefix=True)

    def _page(self, request):
        with self.visit("page"):
            self.pause(CRAWL_PAGE_S)
            n = int(request.route_path.rsplit("/", 1)[1] or 0)
            links = "".join("<a href=\"/p/%d\">Page %d</a> " % (j % CRAWL_SITE_PAGES, j % CRAWL_SITE_PAGES)
                            for j in range(n + 1, n + 6))
            body = ("<html><head><title>Page %d</title></head><body><nav>%s</nav><main><h1>Page %d</h1>%s</main>"
                    "</body></html>" % (n, links, n, "".join(
                        "<p>Paragraph %d of page %d: a crawler reads every page of the site once, politely.</p>"
                        % (k, n) for k in range(40))))
            request.reply(200, "text/html; charset=utf-8", body.encode("utf-8"))


# The answer bench's streams (see FakeChat).
ANSWER_STREAM_S = 0.2        # a normal answer streams for this long
ANSWER_CHUNKS = 20
BIG_STREAM_BYTES = 1 << 20   # the "big" answer: this much SSE of small deltas
SLOW_ANSWER_S = 60.0         # the "slow" answer: a few characters every SLOW_TICK_S for this long
SLOW_TICK_S = 2.0


def _delta_line(text):
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).encode("utf-8") + b"\n\n"


_FINISH_LINES = (b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n', b"data: [DONE]\n\n")


def big_answer_stream(size=BIG_STREAM_BYTES):
    """About `size` bytes of chat-completion SSE in small deltas (a few characters each), with its end."""
    words = ("The", " circuit", " breaker", " opens", " after", " two", " distinct", " keys", " fail", ";",
             " see", " [the", " docs](https://example.test/docs)", " for", " the", " details", ".", "\n")
    lines, total, i = [], 0, 0
    while total < size:
        line = _delta_line(words[i % len(words)])
        lines.append(line)
        total += len(line)
        i += 1
    return b"".join(lines) + b"".join(_FINISH_LINES)


class FakeChat(FakeUpstream):
    """An OpenAI-compatible answer endpoint: POST /v1/chat/completions, streamed like xAI.

    The stream is ``data:`` delta chunks, a chunk with ``finish_reason``, then ``data: [DONE]``.
    The question (the ``question`` field of the user message) chooses it: "big ..." sends
    :func:`big_answer_stream` at once; "slow ..." a few characters every SLOW_TICK_S for
    SLOW_ANSWER_S; anything else ANSWER_CHUNKS deltas spread over ANSWER_STREAM_S. Requests are
    counted per question; ``stream_s[question]`` is how long the fake took, request to finish chunk.
    """

    name = "fake-chat"

    def __init__(self):
        super().__init__()
        self.big = big_answer_stream()
        self.stream_s = {}
        self.route("POST", "/v1/chat/completions", self._chat)

    @staticmethod
    def question(request):
        try:
            messages = json.loads(request.body.decode("utf-8"))["messages"]
            text = messages[-1]["content"]
        except (ValueError, KeyError, TypeError, IndexError):
            return None
        try:
            return json.loads(text)["question"]
        except (ValueError, KeyError, TypeError):
            return text

    def _chat(self, request):
        question = self.question(request)
        if not isinstance(question, str):
            request.reply_json(400, {"error": {"message": "messages are required", "code": "invalid_request"}})
            return
        started = time.monotonic()
        with self.visit(question):
            if question.startswith("big"):
                pieces = (self.big[i:i + 16384] for i in range(0, len(self.big), 16384))
            elif question.startswith("slow"):
                pieces = self._paced(started, SLOW_ANSWER_S, int(SLOW_ANSWER_S / SLOW_TICK_S), "tick. ")
            else:
                pieces = self._paced(started, ANSWER_STREAM_S, ANSWER_CHUNKS,
                                     "Part of the answer [source](https://example.test/a). ")
            request.stream("text/event-stream", self._timed(question, started, pieces))

    def _paced(self, started, duration_s, chunks, text):
        """`chunks` deltas of `text`, the k-th at started + k * duration_s / chunks; then the end."""
        for k in range(1, chunks + 1):
            self.pause(started + k * duration_s / chunks - time.monotonic())
            if self.stopping.is_set():
                return
            yield _delta_line(text)
        yield b"".join(_FINISH_LINES)

    def _timed(self, question, started, pieces):
        """Pass `pieces` through and record when the last one (with the finish chunk) was handed over."""
        for piece in pieces:
            yield piece
        self.stream_s[question] = time.monotonic() - started


# ----------------------------------------------------------------------------------------------
# RpcClient: JSON-RPC 2.0 over a child process's pipes
# ----------------------------------------------------------------------------------------------

def is_jsonrpc_message(msg):
    """True if msg is a JSON-RPC 2.0 request, notification or response (or a batch of them)."""
    if isinstance(msg, list):
        return bool(msg) and all(is_jsonrpc_message(m) for m in msg)
    if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0":
        return False
    if "method" in msg:
        return isinstance(msg["method"], str)
    return "id" in msg and (("result" in msg) != ("error" in msg))


def _id_key(rpc_id):
    return rpc_id if isinstance(rpc_id, (int, str, type(None))) else repr(rpc_id)


class RpcClient:
    """Runs the server and talks JSON-RPC to it over binary pipes.

    Threaded mode (the default) starts a reader thread that routes responses by id into per-id
    queues and collects notifications, so many calls can be in flight. ``threaded=False`` reads
    stdout in the calling thread (``call_sync``), which keeps thread hand-offs out of latency
    figures. Either way a watchdog kills the process after ``lifetime_s``, so no read or write
    can block forever. Every stdout line is checked for JSON-RPC 2.0 validity.
    """

    def __init__(self, argv, env, *, threaded=True, lifetime_s=OFFLINE_LIFETIME_S, cwd=None):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env, cwd=cwd)
        self._write_lock = threading.Lock()  # one message per write, never interleaved
        self._lock = threading.Lock()        # guards _queues, _next_id
        self._queues = {}
        self._next_id = 0
        self.notifications = []              # list.append is atomic; read after the fact
        self.notification_times = []         # time.monotonic() when notifications[i] arrived
        self.bad_lines = []                  # stdout lines that are not JSON-RPC 2.0
        self.line_count = 0
        self.eof = threading.Event()
        self.stderr_tail = collections.deque(maxlen=60)
        self.watchdog_fired = False
        self._watchdog = threading.Timer(lifetime_s, self._on_watchdog)
        self._watchdog.daemon = True
        self._watchdog.start()
        self._threads = [threading.Thread(target=self._drain_stderr, name="rpc-stderr", daemon=True)]
        if threaded:
            self._threads.append(threading.Thread(target=self._read_stdout, name="rpc-stdout", daemon=True))
        for thread in self._threads:
            thread.start()

    # -- process -----------------------------------------------------------------------------

    @property
    def pid(self):
        return self.proc.pid

    def _on_watchdog(self):
        self.watchdog_fired = True
        self.kill()

    def kill(self):
        try:
            if self.proc.poll() is None:
                self.proc.kill()
        except OSError:
            pass

    def close_stdin(self):
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def wait_exit(self, timeout_s):
        """The exit code, or None if the process is still running after timeout_s."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def close(self):
        """Close stdin, give the server a moment to exit, then kill it. Safe to call twice."""
        self.close_stdin()
        if self.wait_exit(3.0) is None:
            self.kill()
            self.wait_exit(5.0)
        self._watchdog.cancel()
        for thread in self._threads:
            thread.join(timeout=2.0)
        for stream in (self.proc.stdout, self.proc.stderr):
            try:
                stream.close()
            except OSError:
                pass

    def _drain_stderr(self):
        for line in iter(self.proc.stderr.readline, b""):
            self.stderr_tail.append(line.decode("utf-8", "replace").rstrip())

    # -- reading -----------------------------------------------------------------------------

    def _parse_line(self, line):
        """Parse one stdout line; record it as bad unless it is a JSON-RPC 2.0 message."""
        self.line_count += 1
        try:
            msg = json.loads(line.decode("utf-8"))
        except ValueError:
            msg = None
        if not line.endswith(b"\n") or not is_jsonrpc_message(msg):
            self.bad_lines.append(_short(line.decode("utf-8", "replace"), 200))
            return None
        return msg

    def _queue_for(self, rpc_id):
        with self._lock:
            return self._queues.setdefault(_id_key(rpc_id), queue.Queue())

    def _route(self, msg):
        for item in (msg if isinstance(msg, list) else [msg]):
            if "method" in item:  # notification, or a request from the server
                self.notification_times.append(time.monotonic())
                self.notifications.append(item)
            else:
                self._queue_for(item.get("id")).put(item)

    def _read_stdout(self):
        try:
            for line in iter(self.proc.stdout.readline, b""):
                msg = self._parse_line(line)
                if msg is not None:
                    self._route(msg)
        except (OSError, ValueError):
            pass
        finally:
            self.eof.set()

    def wait(self, rpc_id, timeout_s=RPC_TIMEOUT_S):
        """The response with this id, or None after timeout_s (or sooner once stdout has ended)."""
        q = self._queue_for(rpc_id)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                return q.get(timeout=min(0.1, remaining))
            except queue.Empty:
                if self.eof.is_set() and q.empty():
                    return None

    # -- writing -----------------------------------------------------------------------------

    def send_raw(self, data):
        try:
            with self._write_lock:
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
        except (OSError, ValueError) as exc:  # broken pipe, or stdin already closed
            raise CheckError("cannot write to the server: %s%s" % (exc, self.exit_note())) from None

    def send(self, msg):
        self.send_raw(json.dumps(msg, separators=(",", ":")).encode("utf-8") + b"\n")

    def new_id(self):
        with self._lock:
            self._next_id += 1
            return self._next_id

    def request(self, method, params=None):
        """Send a request and return its id without waiting."""
        rpc_id = self.new_id()
        msg = {"jsonrpc": "2.0", "id": rpc_id, "method": method}
        if params is not None:
            msg["params"] = params
        self.send(msg)
        return rpc_id

    def notify(self, method, params=None):
        msg = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            msg["params"] = params
        self.send(msg)

    def call(self, method, params=None, timeout_s=RPC_TIMEOUT_S):
        """Send a request and wait for its response; raise CheckError if none comes in time."""
        rpc_id = self.request(method, params)
        resp = self.wait(rpc_id, timeout_s)
        if resp is None:
            when = "before stdout closed" if self.eof.is_set() else "within %.1f s" % timeout_s
            raise CheckError("no response to %s (id %s) %s%s" % (method, rpc_id, when, self.exit_note()))
        return resp

    def call_sync(self, method, params=None):
        """Unthreaded mode: send a request, read stdout here until its response arrives."""
        rpc_id = self.request(method, params)
        return self._read_sync([rpc_id], method)[rpc_id]

    def burst_sync(self, method, params_list):
        """Unthreaded mode: send these requests in one write, as a client with calls in parallel
        does, then read stdout here until each has its response; the responses, in order."""
        ids = [self.new_id() for _ in params_list]
        self.send_raw(b"".join(json.dumps({"jsonrpc": "2.0", "id": rpc_id, "method": method, "params": params},
                                          separators=(",", ":")).encode("utf-8") + b"\n"
                               for rpc_id, params in zip(ids, params_list)))
        answers = self._read_sync(ids, method)
        return [answers[rpc_id] for rpc_id in ids]

    def _read_sync(self, ids, method):
        """``{id: response}`` for every id, read from stdout here (notifications are kept)."""
        pending, answers = set(ids), {}
        for _ in range(100000):  # notifications may come first; bounded all the same
            if not pending:
                return answers
            line = self.proc.stdout.readline()
            if not line:
                raise CheckError("server closed stdout before answering %s%s" % (method, self.exit_note()))
            msg = self._parse_line(line)
            if isinstance(msg, dict) and "method" not in msg and msg.get("id") in pending:
                pending.discard(msg["id"])
                answers[msg["id"]] = msg
            elif msg is not None:
                self.notification_times.append(time.monotonic())
                self.notifications.append(msg)
        raise CheckError("no response to %s among 100000 lines" % method)

    def exit_note(self):
        """Why the server may have gone quiet: '' while it runs, else its exit or the watchdog."""
        code = self.proc.poll()
        if self.watchdog_fired:
            return " (watchdog killed the server)"
        return "" if code is None else " (server exited with code %s)" % code

    # -- MCP helpers -------------------------------------------------------------------------

    def initialize_params(self, version=PROTOCOL_VERSION):
        return {"protocolVersion": version, "capabilities": {}, "clientInfo": CLIENT_INFO}

    def handshake(self):
        """initialize + notifications/initialized (threaded mode); returns the initialize response."""
        resp = self.call("initialize", self.initialize_params())
        self.notify("notifications/initialized")
        return resp

    def handshake_sync(self):
        resp = self.call_sync("initialize", self.initialize_params())
        self.notify("notifications/initialized")
        return resp


def start_server(env, *, server_path=SERVER_PATH, threaded=True, lifetime_s=OFFLINE_LIFETIME_S):
    return RpcClient([sys.executable, server_path], env, threaded=threaded, lifetime_s=lifetime_s)


def search_params(query, **arguments):
    arguments["query"] = query
    return {"name": "web_search", "arguments": arguments}


def fanout_params(query):
    return search_params(query, mode="fanout", numResults=ENGINE_RESULTS)


def fetch_params(url, **arguments):
    arguments["url"] = url
    return {"name": "web_fetch", "arguments": arguments}


def answer_params(question):
    return {"name": "web_answer", "arguments": {"query": question}}


# ----------------------------------------------------------------------------------------------
# Process probes: RSS and CPU of a running child
# ----------------------------------------------------------------------------------------------

def rss_kb(pid):
    """Resident set size in KiB: /proc on Linux, `ps -o rss=` on macOS and other POSIX systems,
    None if unknown (Windows: a `ps` on PATH there is Git's or MSYS's, with other options and
    other process ids)."""
    try:
        with open("/proc/%d/status" % pid, "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    if os.name != "nt" and shutil.which("ps"):
        try:
            out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True,
                                 text=True, timeout=5)
            return int(out.stdout.strip())
        except (OSError, ValueError, subprocess.SubprocessError):
            pass
    return None


def cpu_seconds(pid):
    """User + system CPU seconds of a running process from /proc/<pid>/stat; None off Linux
    (the bench then prints n/a)."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2:].split()  # fields[0] is field 3, "state"
        ticks = int(fields[11]) + int(fields[12])     # utime, stime: fields 14 and 15
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _mb(kb):
    return "n/a" if kb is None else "%.1f MB" % (kb / 1024.0)


# ----------------------------------------------------------------------------------------------
# Offline checks
# ----------------------------------------------------------------------------------------------

def expect(condition, detail):
    if not condition:
        raise CheckError(detail)


def tool_result(resp):
    """The result of a tools/call response (raises CheckError on a JSON-RPC error)."""
    expect("result" in resp, "JSON-RPC error instead of a result: %s" % _short(resp.get("error")))
    result = resp["result"]
    expect(isinstance(result, dict), "result is not an object: %s" % _short(result))
    return result


def structured(resp):
    result = tool_result(resp)
    sc = result.get("structuredContent")
    expect(isinstance(sc, dict), "no structuredContent: %s" % _short(result))
    return sc


def result_text(result):
    parts = [c.get("text", "") for c in result.get("content") or [] if isinstance(c, dict)]
    return "\n".join(parts)


def expect_success(resp):
    """structuredContent of a successful web_search, after checking its status fields."""
    sc = structured(resp)
    result = resp["result"]
    expect(result.get("isError") is False and sc.get("status") == "success",
           "not a success: isError=%s status=%s error=%s attempts=%s" % (
               result.get("isError"), sc.get("status"), sc.get("error"), _short(sc.get("attempts"), 200)))
    expect(isinstance(sc.get("results"), list) and sc["results"], "no results: %s" % _short(sc))
    return sc


def expect_rpc_error(resp, code):
    err = resp.get("error")
    expect(isinstance(err, dict), "expected JSON-RPC error %d, got %s" % (code, _short(resp)))
    expect(err.get("code") == code, "expected error code %d, got %s" % (code, _short(err)))
    return err


def expect_validation_issue(resp, path):
    sc = structured(resp)
    expect(resp["result"].get("isError") is True, "isError is not true: %s" % _short(resp["result"]))
    expect(sc.get("status") == "error" and sc.get("error") == "invalid_arguments",
           "status/error = %s/%s, expected error/invalid_arguments" % (sc.get("status"), sc.get("error")))
    issues = (sc.get("validation") or {}).get("issues")
    expect(isinstance(issues, list) and issues, "no validation.issues: %s" % _short(sc.get("validation")))
    expect(issues[0].get("path") == path, "issues[0].path = %r, expected %r (issues: %s)"
           % (issues[0].get("path"), path, _short(issues)))


class Report:
    """Prints one line per check and counts the outcome."""

    def __init__(self):
        self.passed = 0
        self.failed = 0

    def run(self, name, check):
        try:
            check()
        except CheckError as exc:
            self.fail(name, str(exc))
        except Exception as exc:  # a broken pipe or a bad reply is a failed check, not a crash
            self.fail(name, "%s: %s" % (type(exc).__name__, exc))
        else:
            self.passed += 1
            print("ok  %s" % name, flush=True)

    def fail(self, name, detail):
        self.failed += 1
        print("FAIL %s: %s" % (name, detail), flush=True)


class OfflineChecks:
    """The --offline checks, in order, against one server process and one fake upstream."""

    CANCEL_QUERY = "smoke slow cancel"  # "slow": the fake holds it for SLOW_QUERY_S

    def __init__(self, client, fake):
        self.client = client
        self.fake = fake

    def checks(self):
        return [
            ("initialize", self.check_initialize),
            ("ping", self.check_ping),
            ("tools/list web_search", self.check_tools_list),
            ("search returns results", self.check_search),
            ("keyless tavily request", self.check_keyless_headers),
            ("repeat is cached", self.check_cached),
            ("identical concurrent calls coalesce", self.check_coalescing),
            ("empty query -> /query issue", self.check_empty_query),
            ('numResults "8" is read as 8; "eight" -> /numResults issue', self.check_numresults_string),
            ("unknown tool -> -32602", self.check_unknown_tool),
            ("unknown method -> -32601", self.check_unknown_method),
            ("non-JSON line -> -32700", self.check_parse_error),
            ("cancelled call gets no response", self.check_cancellation),
            ("cancelled call not cached", self.check_cancel_not_cached),
            ("EOF: a call still running after the 2 s grace is cancelled, exit 0", self.check_eof),
            ("stdout purity", self.check_stdout_purity),
        ]

    def check_initialize(self):
        resp = self.client.call("initialize", self.client.initialize_params())
        self.client.notify("notifications/initialized")
        expect("result" in resp, "error: %s" % _short(resp.get("error")))
        result = resp["result"]
        expect(result.get("protocolVersion") == PROTOCOL_VERSION,
               "protocolVersion %r, expected %r" % (result.get("protocolVersion"), PROTOCOL_VERSION))
        info = result.get("serverInfo")
        expect(isinstance(info, dict) and info.get("name") and info.get("version"),
               "serverInfo lacks name/version: %s" % _short(info))
        caps = result.get("capabilities")
        expect(isinstance(caps, dict) and isinstance(caps.get("tools"), dict),
               "capabilities.tools missing: %s" % _short(caps))

    def check_ping(self):
        resp = self.client.call("ping")
        expect(resp.get("result") == {}, "ping result %s, expected {}" % _short(resp))

    def check_tools_list(self):
        resp = self.client.call("tools/list", {})
        tools = (resp.get("result") or {}).get("tools")
        expect(isinstance(tools, list), "no tools list: %s" % _short(resp))
        by_name = {t.get("name"): t for t in tools if isinstance(t, dict)}
        expect("web_search" in by_name, "web_search not listed (tools: %s)" % sorted(map(str, by_name)))
        schema = by_name["web_search"].get("inputSchema")
        expect(isinstance(schema, dict) and schema.get("type") == "object",
               "inputSchema is not an object schema: %s" % _short(schema))
        expect("query" in (schema.get("properties") or {}), "inputSchema has no query property")
        expect("query" in (schema.get("required") or []), "query is not required in inputSchema")

    def check_search(self):
        query = "smoke alpha"
        sc = expect_success(self.client.call("tools/call", search_params(query)))
        expect(sc.get("cached") is False, "cached = %r, expected false" % sc.get("cached"))
        expect(sc.get("vendor") == "tavily", "vendor = %r, expected tavily" % sc.get("vendor"))
        first = sc["results"][0]
        expect(first.get("url") == self.fake.result_url(query, 1),
               "first url %r is not the fake's %r" % (first.get("url"), self.fake.result_url(query, 1)))
        expect(self.fake.visits_for(query) == 1, "upstream hits = %d, expected 1" % self.fake.visits_for(query))

    def check_keyless_headers(self):
        sent = self.fake.requests_to("POST", "/search")
        expect(sent, "no request reached the fake Tavily")
        mode = sent[-1].header("X-Tavily-Access-Mode")
        expect(mode == "keyless", "X-Tavily-Access-Mode = %r, expected keyless" % mode)
        expect(sent[-1].header("Authorization") is None, "an Authorization header was sent without a key")

    def check_cached(self):
        query = "smoke alpha"
        resp = self.client.call("tools/call", search_params(query))
        sc = expect_success(resp)
        expect(sc.get("cached") is True, "cached = %r, expected true" % sc.get("cached"))
        expect(self.fake.visits_for(query) == 1,
               "upstream hits = %d after the repeat, expected 1" % self.fake.visits_for(query))
        first_line = result_text(resp["result"]).split("\n", 1)[0]
        expect("cached" in first_line, "text first line does not say cached: %r" % first_line)

    def check_coalescing(self):
        query = "smoke coalesce"
        self.fake.latency_s = 0.3  # keep the leader in flight while the followers arrive
        try:
            ids = [self.client.request("tools/call", search_params(query)) for _ in range(10)]
            deadline = time.monotonic() + RPC_TIMEOUT_S
            resps = [self.client.wait(i, max(0.0, deadline - time.monotonic())) for i in ids]
        finally:
            self.fake.latency_s = 0.0
        missing = [i for i, r in zip(ids, resps) if r is None]
        expect(not missing, "no response for ids %s" % missing)
        scs = [expect_success(r) for r in resps]
        hits = self.fake.visits_for(query)
        expect(hits == 1, "upstream hits = %d for 10 identical concurrent calls, expected 1" % hits)
        coalesced = sum(1 for sc in scs if sc.get("coalesced") is True)
        expect(coalesced >= 1, "no result has coalesced true (cached: %d)"
               % sum(1 for sc in scs if sc.get("cached") is True))
        urls = {tuple(r.get("url") for r in sc["results"]) for sc in scs}
        expect(len(urls) == 1, "the 10 calls returned %d different result lists" % len(urls))

    def check_empty_query(self):
        expect_validation_issue(self.client.call("tools/call", search_params("")), "/query")

    def check_numresults_string(self):
        sc = _sc(self.client.call("tools/call", search_params("smoke numresults", numResults="8")))
        expect(sc.get("status") == "success" and len(sc.get("results") or ()) == 8,
               "numResults \"8\" was not read as 8: %s" % _short(json.dumps(sc), 200))
        expect([a.get("used") for a in sc.get("adjustments") or ()] == [8],
               "the string was not listed in adjustments: %r" % sc.get("adjustments"))
        resp = self.client.call("tools/call", search_params("smoke numresults", numResults="eight"))
        expect_validation_issue(resp, "/numResults")

    def check_unknown_tool(self):
        resp = self.client.call("tools/call", {"name": "no_such_tool", "arguments": {}})
        expect_rpc_error(resp, -32602)

    def check_unknown_method(self):
        expect_rpc_error(self.client.call("no/such/method", {}), -32601)

    def check_parse_error(self):
        self.client.send_raw(b"this is not json {\n")
        resp = self.client.wait(None, RPC_TIMEOUT_S)
        expect(resp is not None, "no response with id null within %.0f s" % RPC_TIMEOUT_S)
        expect_rpc_error(resp, -32700)

    def check_cancellation(self):
        query = self.CANCEL_QUERY
        rpc_id = self.client.request("tools/call", search_params(query))
        # Cancel only once the upstream request is really in flight.
        expect(self.fake.wait_for_visit(query, 5.0), "the slow query never reached the upstream")
        cancelled_at = time.monotonic()
        self.client.notify("notifications/cancelled", {"requestId": rpc_id, "reason": "smoke test cancel"})
        # The server keeps serving (a slow runner may take a while to answer: RPC_TIMEOUT_S) ...
        ping = self.client.call("ping")
        expect(ping.get("result") == {}, "ping after cancel: %s" % _short(ping))
        # ... and the cancelled call stays unanswered for the rest of the silence window (its
        # queue is looked at at least once, even when the ping used the whole window).
        late = self.client.wait(rpc_id, max(0.05, cancelled_at + CANCEL_SILENCE_S - time.monotonic()))
        expect(late is None, "cancelled request %s was answered: %s" % (rpc_id, _short(late)))

    def check_cancel_not_cached(self):
        # If the cancelled call were still running, this identical call would join it (coalesced,
        # slow); if it had been cached, this would be cached. Either way the hit count shows it.
        query = self.CANCEL_QUERY
        before = self.fake.visits_for(query)
        self.fake.slow_s = 0.2
        try:
            started = time.monotonic()
            sc = expect_success(self.client.call("tools/call", search_params(query)))
            elapsed = time.monotonic() - started
        finally:
            self.fake.slow_s = SLOW_QUERY_S
        expect(sc.get("cached") is False and sc.get("coalesced") is False,
               "cached=%r coalesced=%r after %.1f s, expected a fresh call"
               % (sc.get("cached"), sc.get("coalesced"), elapsed))
        expect(self.fake.visits_for(query) == before + 1,
               "upstream hits %d -> %d, expected one new request" % (before, self.fake.visits_for(query)))

    def check_eof(self):
        """stdin EOF: a call in flight gets a 2 s grace; one still running then is cancelled and the process exits 0."""
        query = "smoke eof"
        self.fake.latency_s = 5.0
        try:
            rpc_id = self.client.request("tools/call", search_params(query))
            self.client.close_stdin()
            started = time.monotonic()
            code = self.client.wait_exit(10.0)
            took = time.monotonic() - started
        finally:
            self.fake.latency_s = 0.0
        expect(code is not None, "server still running 10 s after stdin EOF")
        expect(code == 0, "exit code %s after EOF, expected 0" % code)
        expect(took < 3.5, "exit took %.1f s after EOF with a 5 s upstream call in flight" % took)
        expect(self.client.wait(rpc_id, 0.2) is None, "the cancelled call was answered after EOF")

    def check_stdout_purity(self):
        self.client.eof.wait(5.0)
        expect(not self.client.bad_lines, "%d non-JSON-RPC stdout line(s), first: %s"
               % (len(self.client.bad_lines), self.client.bad_lines[0] if self.client.bad_lines else ""))
        expect(self.client.line_count > 0, "no stdout lines at all")


def run_offline(server_path):
    """--offline: every check against one server and one fake; returns the exit code."""
    report = Report()
    if not os.path.isfile(server_path):
        report.fail("server present", "%s not found" % server_path)
        print("%d passed, %d failed" % (report.passed, report.failed))
        return 1
    fake = FakeTavily()
    client = None
    try:
        client = start_server(offline_env(fake.url), server_path=server_path)
        suite = OfflineChecks(client, fake)
        for index, (name, check) in enumerate(suite.checks()):
            if index > 0 and report.passed == 0:  # no handshake: nothing else can mean anything
                report.fail(name, "not run: initialize failed")
                continue
            report.run(name, check)
    finally:
        if client is not None:
            client.close()
        fake.close()
    if report.failed and client is not None and client.stderr_tail:
        print("server stderr (last lines):", file=sys.stderr)
        for line in list(client.stderr_tail)[-20:]:
            print("  " + line, file=sys.stderr)
    print("%d passed, %d failed" % (report.passed, report.failed), flush=True)
    return 1 if report.failed else 0


# ----------------------------------------------------------------------------------------------
# Benchmarks (DESIGN section 10)
# ----------------------------------------------------------------------------------------------

STARTUP_RUNS = 15
LATENCY_CALLS = 200
LATENCY_ROUNDS = 3
CONCURRENT_CALLS = 200
CONCURRENT_INFLIGHT = 16
CONCURRENT_LATENCY_S = 0.1
CONCURRENT_ROUNDS = 3
COALESCE_CALLS = 50
COALESCE_ROUNDS = 3
GROWTH_QUERIES = 5000
GROWTH_CHECKPOINT = 1000
GROWTH_WINDOW = 20  # calls in flight at once while filling the cache
FANOUT_CALLS = 10
FANOUT_LATENCY_S = 0.1   # every fake engine answers after this long
FUSION_RUNS = 1000
FETCH_BATCH = 20         # distinct URLs per CPU measurement
FETCH_ROUNDS = 3
PAGES_LATENCY_S = 0.1    # several-pages bench: the search and every page answer after this long
PAGES_ROUNDS = 5
FETCH_COALESCE_CALLS = 20
FETCH_WHOLE = 1000000    # a max_length that returns the whole article in one page
DEFAULT_PAGE_CHARS = 20000  # the server's default max_length
PAGE_CALLS = 500
ANSWER_CALLS = 10
BIG_ANSWER_RUNS = 3
ANSWER_COALESCE_CALLS = 20
SHUTDOWN_RUNS = 5


# The floor of --bench: the least a stdio MCP server can do for the same web_search (one Tavily
# request on a kept-alive connection, its results as text and structured content), standard
# library only.  The server's CPU per call is compared with this one's, side by side.
FLOOR_SERVER = r'''
import http.client, json, os, sys, urllib.parse
target = urllib.parse.urlsplit(os.environ["WEBSEARCH_TAVILY_URL"])
conn = None


def search(query):
    global conn
    body = json.dumps({"query": query, "max_results": 8, "search_depth": "basic"})
    for attempt in (0, 1):
        if conn is None:
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
        try:
            conn.request("POST", "/search", body, {"Content-Type": "application/json"})
            data = json.loads(conn.getresponse().read())
            break
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = None
            if attempt:
                raise
    results = [{"title": r.get("title"), "url": r.get("url"), "snippet": r.get("content")}
               for r in data.get("results") or []]
    text = "\n\n".join("%d. %s\n%s\n%s" % (i, r["title"], r["url"], r["snippet"]) for i, r in enumerate(results, 1))
    return {"content": [{"type": "text", "text": text}], "structuredContent": {"results": results}, "isError": False}


for line in sys.stdin.buffer:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    if msg.get("method") == "initialize":
        result = {"protocolVersion": msg["params"]["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "floor", "version": "0"}}
    elif msg.get("method") == "tools/call":
        result = search(msg["params"]["arguments"]["query"])
    else:
        result = {}
    sys.stdout.buffer.write(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}).encode() + b"\n")
    sys.stdout.buffer.flush()
'''
FLOOR_ROUNDS = 5          # rounds of LATENCY_CALLS calls, taking turns between the three servers
FLOOR_BURST = 20          # under load: calls sent at once (more than the 16 upstream slots)


class Bench:
    """Measures and collects rows of (metric, value, target, verdict) for a compact table."""

    def __init__(self, server_path, fake):
        self.server_path = server_path
        self.fake = fake
        self.rows = []
        self._serial = 0

    def row(self, metric, value, target="", verdict=""):
        self.rows.append((metric, value, target, verdict))
        print("  measured: %s = %s" % (metric, value), file=sys.stderr, flush=True)

    def section(self, title):
        """Start a titled group of rows."""
        self.rows.append((title,))

    def fresh_query(self, prefix):
        self._serial += 1
        return "%s %d" % (prefix, self._serial)

    def server(self, threaded, **env):
        self.fake.latency_s = 0.0
        return self.spawn(offline_env(self.fake.url, **env), threaded)

    def spawn(self, env, threaded):
        return start_server(env, server_path=self.server_path, threaded=threaded, lifetime_s=BENCH_PHASE_LIFETIME_S)

    # -- start-up, idle RSS ------------------------------------------------------------------

    def startup(self):
        with open(self.server_path, "rb") as f:
            source = f.read()
        compile_ms = []
        for _ in range(STARTUP_RUNS):
            t0 = time.perf_counter()
            compile(source, self.server_path, "exec", dont_inherit=True)
            compile_ms.append((time.perf_counter() - t0) * 1000)

        baseline_ms, spawn_ms, import_ms = [], [], []
        env = offline_env(self.fake.url)
        script_argv = [sys.executable, self.server_path]
        baseline_argv = [sys.executable, "-c", "import json, threading"]
        # The launch config and install write, with cached bytecode, from a private copy so no .pyc
        # lands in the repo. (PYTHONPYCACHEPREFIX would do that too, but it also moves the stdlib's cache.)
        import_dir = _TempDir("smoke-import-")
        try:
            import_argv = _import_launch(self.server_path, import_dir.path, env)
            for _ in range(STARTUP_RUNS):  # interleaved, so drift hits all three alike
                baseline_ms.append(_time_run(baseline_argv, env))
                spawn_ms.append(_time_init(script_argv, env))
                import_ms.append(_time_init(import_argv, env, import_dir.path))
            idle = _idle_rss_kb(script_argv, env)
            import_idle = _idle_rss_kb(import_argv, env, import_dir.path)
        finally:
            import_dir.remove()
        spawn, base, comp = _median(spawn_ms), _median(baseline_ms), _median(compile_ms)
        budget = base + comp + 10.0
        self.row("python -c 'import json, threading'", "%.1f ms" % base)
        self.row("compile(websearch_ring.py)", "%.1f ms" % comp)
        self.row("spawn -> initialize answered", "%.1f ms" % spawn, "<= %.1f ms (base+compile+10)" % budget,
                 _verdict(spawn <= budget))
        # No target: DESIGN sets none (unmarshalling the bytecode is not free either).
        self.row("  same as config/install start it (imported, cached .pyc)", "%.1f ms" % _median(import_ms))
        self.row("idle RSS", _mb(idle), "< 20 MB", "" if idle is None else _verdict(idle < 20 * 1024))
        self.row("  same as config/install start it (imported, cached .pyc)", _mb(import_idle))
        self.row("  python -c 'import json, threading'", _mb(_baseline_rss_kb(env)))

    # -- round trips and CPU -----------------------------------------------------------------

    def latency(self):
        client = self.server(threaded=False)
        try:
            client.handshake_sync()
            client.call_sync("tools/call", search_params(self.fresh_query("bench first")))
            self.row("RSS after first search", _mb(rss_kb(client.pid)))
            for _ in range(20):  # warm-up: lazy imports, first connections
                client.call_sync("tools/call", search_params(self.fresh_query("bench warm")))
            ping_ms, uncached_ms, cpu_ms_per_call, cached_ms = [], [], [], []
            for _ in range(LATENCY_ROUNDS * LATENCY_CALLS):
                t0 = time.perf_counter()
                client.call_sync("ping")
                ping_ms.append((time.perf_counter() - t0) * 1000)
            errors = 0
            for _ in range(LATENCY_ROUNDS):
                cpu0 = cpu_seconds(client.pid)
                for _ in range(LATENCY_CALLS):
                    query = self.fresh_query("bench uncached")
                    t0 = time.perf_counter()
                    resp = client.call_sync("tools/call", search_params(query))
                    uncached_ms.append((time.perf_counter() - t0) * 1000)
                    errors += _is_tool_error(resp)
                cpu1 = cpu_seconds(client.pid)
                if cpu0 is not None and cpu1 is not None:
                    cpu_ms_per_call.append((cpu1 - cpu0) * 1000 / LATENCY_CALLS)
            # Fetched right before the loop: an early query may have left the LRU by now.
            cached_query = self.fresh_query("bench cached")
            client.call_sync("tools/call", search_params(cached_query))
            cached_flags = 0
            for _ in range(LATENCY_ROUNDS * LATENCY_CALLS):
                t0 = time.perf_counter()
                resp = client.call_sync("tools/call", search_params(cached_query))
                cached_ms.append((time.perf_counter() - t0) * 1000)
                cached_flags += ((resp.get("result") or {}).get("structuredContent") or {}).get("cached") is True
        finally:
            client.close()
        note = "" if not errors else " (%d errors)" % errors
        self.row("ping round trip (protocol floor)", "%.3f ms" % _median(ping_ms))
        self.row("uncached web_search round trip", "%.2f ms%s" % (_median(uncached_ms), note))
        cached = _median(cached_ms)
        self.row("cached web_search round trip", "%.3f ms (%d/%d cached)" % (cached, cached_flags, len(cached_ms)),
                 "< 0.3 ms", _verdict(cached < 0.3 and cached_flags == len(cached_ms)))
        if cpu_ms_per_call:
            cpu = _median(cpu_ms_per_call)
            self.row("server CPU per uncached call", "%.2f ms" % cpu, "< 1 ms", _verdict(cpu < 1.0))
        else:
            self.row("server CPU per uncached call", "n/a", "< 1 ms")

    # -- side by side with the floor: a minimal stdlib MCP server making the same request -----

    def floor(self):
        """CPU per uncached call and round trips of the floor server, this one as a script and as
        config/install start it (imported), all three running at once and taking turns, so drift hits
        them alike."""
        env = offline_env(self.fake.url)
        work = _TempDir("smoke-floor-")
        clients = {}
        try:
            floor_path = os.path.join(work.path, "floor_server.py")
            with open(floor_path, "w") as f:
                f.write(FLOOR_SERVER)
            import_argv = _import_launch(self.server_path, work.path, env)
            for name, argv in (("floor", [sys.executable, floor_path]), ("script", [sys.executable, self.server_path]),
                               ("imported", import_argv)):
                clients[name] = RpcClient(argv, env, threaded=False, lifetime_s=BENCH_PHASE_LIFETIME_S, cwd=work.path)
            figures = self._floor_rounds(clients)
        finally:
            for client in clients.values():
                client.close()
            work.remove()
        self._floor_rows(figures)

    def _floor_rounds(self, clients):
        """``{server: {"cpu": [ms per round], "burst_cpu": [ms per round], "rtt": [ms], "cached": [ms]}}``:
        each round, LATENCY_CALLS calls one at a time, then as many under load, in bursts of FLOOR_BURST."""
        figures = {name: {"cpu": [], "burst_cpu": [], "rtt": [], "cached": []} for name in clients}
        for name, client in clients.items():
            client.handshake_sync()
            for _ in range(20):  # warm-up: lazy imports, first connections, worker threads
                client.call_sync("tools/call", search_params(self.fresh_query("floor warm")))
            client.burst_sync("tools/call", [search_params(self.fresh_query("floor warm")) for _ in range(FLOOR_BURST)])
        for _ in range(FLOOR_ROUNDS):
            for name, client in clients.items():
                cpu0 = cpu_seconds(client.pid)
                for _ in range(LATENCY_CALLS):
                    params = search_params(self.fresh_query("floor uncached"))
                    t0 = time.perf_counter()
                    client.call_sync("tools/call", params)
                    figures[name]["rtt"].append((time.perf_counter() - t0) * 1000)
                cpu1 = cpu_seconds(client.pid)
                for _ in range(LATENCY_CALLS // FLOOR_BURST):
                    client.burst_sync("tools/call", [search_params(self.fresh_query("floor burst"))
                                                     for _ in range(FLOOR_BURST)])
                cpu2 = cpu_seconds(client.pid)
                if None not in (cpu0, cpu1, cpu2):
                    figures[name]["cpu"].append((cpu1 - cpu0) * 1000)
                    figures[name]["burst_cpu"].append((cpu2 - cpu1) * 1000)
                if name != "floor":
                    params = search_params("floor cached")
                    client.call_sync("tools/call", params)
                    for _ in range(LATENCY_CALLS // 4):
                        t0 = time.perf_counter()
                        client.call_sync("tools/call", params)
                        figures[name]["cached"].append((time.perf_counter() - t0) * 1000)
        return figures

    def _floor_rows(self, figures):
        # CPU per call over every round: the kernel counts CPU in ticks (10 ms on Linux), a fifth of
        # the floor's 200 calls of a round, too coarse for a median of rounds.
        def per_call(rounds):
            return sum(rounds) / (len(rounds) * LATENCY_CALLS) if rounds else None
        floor = figures["floor"]
        floor_cpu, floor_burst = per_call(floor["cpu"]), per_call(floor["burst_cpu"])
        floor_rtt = _median(floor["rtt"])
        self.row("floor: CPU per uncached call", "n/a" if floor_cpu is None else "%.3f ms" % floor_cpu)
        self.row("floor: same, in bursts of %d" % FLOOR_BURST, "n/a" if floor_burst is None else "%.3f ms" % floor_burst)
        self.row("floor: uncached round trip", "%.3f ms" % floor_rtt)
        for name in ("script", "imported"):
            f = figures[name]
            for what, mine, base in (("CPU per uncached call", per_call(f["cpu"]), floor_cpu),
                                     ("same, in bursts of %d" % FLOOR_BURST, per_call(f["burst_cpu"]), floor_burst)):
                if mine and base:
                    self.row("%s: %s" % (name, what), "%.3f ms = %.2fx floor" % (mine, mine / base),
                             "<= 1.4x", _verdict(mine / base <= 1.4))
            rtt, cached = _median(f["rtt"]), _median(f["cached"])
            self.row("%s: uncached round trip" % name, "%.3f ms = %.2fx floor" % (rtt, rtt / floor_rtt))
            self.row("%s: cached round trip" % name, "%.3f ms = %.2fx floor's uncached" % (cached, cached / floor_rtt),
                     "<= 0.5x", _verdict(cached / floor_rtt <= 0.5))

    # -- concurrency and coalescing ----------------------------------------------------------

    def concurrency(self):
        client = self.server(threaded=True, WEBSEARCH_MAX_INFLIGHT=CONCURRENT_INFLIGHT)
        ideal_s = math.ceil(CONCURRENT_CALLS / CONCURRENT_INFLIGHT) * CONCURRENT_LATENCY_S
        ratios, peaks, problems = [], [], []
        hits_per_round, coalesced_per_round = [], []
        try:
            client.handshake()
            client.call("tools/call", search_params(self.fresh_query("bench warm")))
            self.fake.latency_s = CONCURRENT_LATENCY_S
            for _ in range(CONCURRENT_ROUNDS):
                self.fake.reset_peak()
                queries = [self.fresh_query("bench concurrent") for _ in range(CONCURRENT_CALLS)]
                t0 = time.perf_counter()
                resps = _fan_out(client, [search_params(q) for q in queries], timeout_s=60.0)
                elapsed = time.perf_counter() - t0
                ratios.append(elapsed / ideal_s)
                peaks.append(self.fake.max_active)
                problems.append(sum(1 for r in resps if r is None or _is_tool_error(r)))
            self.fake.latency_s = 0.2  # the leader stays in flight while 49 followers arrive
            for _ in range(COALESCE_ROUNDS):
                query = self.fresh_query("bench coalesce")
                resps = _fan_out(client, [search_params(query)] * COALESCE_CALLS, timeout_s=30.0)
                hits_per_round.append(self.fake.visits_for(query))
                coalesced_per_round.append(sum(
                    1 for r in resps if r and ((r.get("result") or {}).get("structuredContent") or {})
                    .get("coalesced") is True))
        finally:
            self.fake.latency_s = 0.0
            client.close()
        ratio = _median(ratios)
        note = "" if not any(problems) else ", failed calls per round %s" % problems
        self.row("%d concurrent distinct @%d ms, inflight %d" % (CONCURRENT_CALLS, CONCURRENT_LATENCY_S * 1000,
                                                                  CONCURRENT_INFLIGHT),
                 "%.2f s = %.2fx ideal %.2f s%s" % (ratio * ideal_s, ratio, ideal_s, note), "<= 1.15x",
                 _verdict(ratio <= 1.15 and not any(problems)))
        self.row("  peak concurrent upstream requests", ", ".join(map(str, peaks)), "<= %d" % CONCURRENT_INFLIGHT,
                 _verdict(max(peaks) <= CONCURRENT_INFLIGHT))
        self.row("%d identical concurrent -> upstream hits" % COALESCE_CALLS,
                 "%s (coalesced %s)" % (", ".join(map(str, hits_per_round)),
                                        ", ".join(map(str, coalesced_per_round))),
                 "exactly 1", _verdict(all(h == 1 for h in hits_per_round)))

    # -- memory growth -----------------------------------------------------------------------

    def growth(self):
        client = self.server(threaded=True)
        checkpoints = []
        failures = 0
        try:
            client.handshake()
            for _ in range(20):
                client.call("tools/call", search_params(self.fresh_query("bench warm")))
            checkpoints.append((0, rss_kb(client.pid)))
            done = 0
            while done < GROWTH_QUERIES:
                batch = [self.fresh_query("bench growth") for _ in range(min(GROWTH_WINDOW, GROWTH_QUERIES - done))]
                failures += sum(1 for r in _fan_out(client, [search_params(q) for q in batch], timeout_s=30.0)
                                if r is None or _is_tool_error(r))
                done += len(batch)
                if done % GROWTH_CHECKPOINT == 0:
                    checkpoints.append((done, rss_kb(client.pid)))
        finally:
            client.close()
        if any(kb is None for _, kb in checkpoints):
            self.row("RSS growth over %d distinct queries" % GROWTH_QUERIES, "n/a", "< 8 MB, flat")
            return
        labels = "/".join("%dk" % (n // 1000) for n, _ in checkpoints)
        series = "/".join("%.1f" % (kb / 1024.0) for _, kb in checkpoints)
        total = (checkpoints[-1][1] - checkpoints[0][1]) / 1024.0
        after_full = (checkpoints[-1][1] - checkpoints[1][1]) / 1024.0
        note = "" if not failures else " (%d failed calls)" % failures
        self.row("RSS at %s queries" % labels, series + " MB" + note)
        self.row("RSS growth over %d distinct queries" % GROWTH_QUERIES, "%+.1f MB" % total, "< 8 MB",
                 _verdict(total < 8.0))
        self.row("  growth 1k -> 5k (cache full at 512)", "%+.1f MB" % after_full, "flat (< 1 MB)",
                 _verdict(after_full < 1.0))

    # -- fan-out over four engines ---------------------------------------------------------------

    def fanout(self):
        engines = FakeEngines(latency_s=FANOUT_LATENCY_S)
        env = offline_env(engines.url, WEBSEARCH_VENDORS=",".join(FANOUT_ENGINES), WEBSEARCH_BING_URL=engines.url,
                          WEBSEARCH_DUCKDUCKGO_URL=engines.url, WEBSEARCH_EXA_MCP_URL=engines.url + "/mcp")
        client = self.spawn(env, threaded=False)
        wall_ms, removed, problems = [], set(), []
        try:
            client.handshake_sync()
            for _ in range(2):  # warm-up: lazy imports, one kept-alive connection per engine
                client.call_sync("tools/call", fanout_params(self.fresh_query("bench fanout warm")))
            cpu0 = cpu_seconds(client.pid)
            for _ in range(FANOUT_CALLS):
                t0 = time.perf_counter()
                resp = client.call_sync("tools/call", fanout_params(self.fresh_query("bench fanout")))
                wall_ms.append((time.perf_counter() - t0) * 1000)
                sc = _sc(resp)
                removed.add(sc.get("duplicates_removed"))
                if sc.get("status") != "success" or len(sc.get("vendors") or ()) != len(FANOUT_ENGINES):
                    problems.append("%s via %s" % (sc.get("status"), ",".join(sc.get("vendors") or ()) or "none"))
            cpu1 = cpu_seconds(client.pid)
        finally:
            client.close()
            engines.close()
        wall = _median(wall_ms)
        note = "" if not problems else " (%d calls short of 4 engines: %s)" % (len(problems), problems[0])
        self.row("fan-out round trip, median of %d" % FANOUT_CALLS, "%.1f ms = slowest engine %.0f ms + %.1f ms%s" % (
            wall, FANOUT_LATENCY_S * 1000, wall - FANOUT_LATENCY_S * 1000, note))
        if cpu0 is not None and cpu1 is not None:
            self.row("  server CPU per fan-out call", "%.2f ms" % ((cpu1 - cpu0) * 1000 / FANOUT_CALLS))
        total, expected = ENGINE_RESULTS * len(FANOUT_ENGINES), FakeEngines.expected_duplicates()
        values = sorted(r for r in removed if isinstance(r, int))
        self.row("  duplicates_removed", "%s of %d results = %.0f%% overlap" % (
            "/".join(map(str, values)) or "missing", total, 100.0 * values[-1] / total if values else 0.0),
            "= %d (the fakes' overlap)" % expected, _verdict(removed == {expected}))
        self.fusion()

    def fusion(self):
        """In-process: fuse_rrf on four lists of 20 results shaped by the module's make_result."""
        ring = _load_server_module(self.server_path)
        lists = {engine: [ring.make_result(title, url, snippet) for title, url, snippet in
                          FakeEngines.results(engine, "bench fusion")] for engine in FANOUT_ENGINES}
        run_us = []
        for _ in range(FUSION_RUNS):
            t0 = time.thread_time()  # CPU time: a busy machine's preemptions stay out of it
            ring.fuse_rrf(lists, ENGINE_RESULTS)
            run_us.append((time.thread_time() - t0) * 1e6)
        _, removed = ring.fuse_rrf(lists, ENGINE_RESULTS)
        self.row("server CPU for fusion of 4 x 20 results", "%.0f us (fuse_rrf in-process, CPU time, median of %d; %d removed)"
                 % (_median(run_us), FUSION_RUNS, removed))

    # -- web_fetch of a ~100 KB article ----------------------------------------------------------

    def fetch(self):
        site = FakeSite()
        env = offline_env(self.fake.url, WEBSEARCH_FETCH_PROVIDERS="direct", WEBSEARCH_ALLOW_PRIVATE_URLS="1")
        self.row("article served", "%.1f KB of HTML: %d headings, %d table rows, %d code blocks, %d list items" % (
            len(site.article) / 1024.0, *(len(site.expected[k]) for k in
                                          ("headings", "table_rows", "code_blocks", "list_items"))))
        try:
            self._fetch_cpu(site, env)
            self._fetch_coalescing(site, env)
        finally:
            site.close()

    def crawl(self):
        site = FakeCrawlSite()
        env = offline_env(self.fake.url, WEBSEARCH_FETCH_PROVIDERS="direct", WEBSEARCH_MAP_PROVIDERS="direct",
                          WEBSEARCH_ALLOW_PRIVATE_URLS="1", WEBSEARCH_CRAWL_MAX_CHARS="1000000")
        try:
            self._crawl_time(site, env)
            self._crawl_rss(site, env)
        finally:
            site.close()

    def _crawl_time(self, site, env):
        """50 pages against the ideal for 2 requests at once; every page's Markdown against web_fetch's."""
        client = self.spawn(env, threaded=False)
        runs, pages = [], []
        try:
            client.handshake_sync()
            for _ in range(CRAWL_RUNS):
                t0 = time.perf_counter()
                resp = client.call_sync("tools/call", {"name": "web_crawl", "arguments": {
                    "url": site.url + "/p/0", "max_pages": CRAWL_BENCH_PAGES, "max_depth": 3,
                    "max_chars_per_page": 20000}})
                runs.append(time.perf_counter() - t0)
                pages = _sc(resp).get("pages") or []
        finally:
            client.close()
        ideal = CRAWL_BENCH_PAGES * CRAWL_PAGE_S / 2
        took = _median(runs)
        self.row("web_crawl %d pages of a %d-page site (%.0f ms a page)" % (
            CRAWL_BENCH_PAGES, CRAWL_SITE_PAGES, CRAWL_PAGE_S * 1000), "%.2f s (%d read)" % (took, len(pages)),
            "<= %.2f s (1.5x ideal %.2f s)" % (1.5 * ideal, ideal), _verdict(took <= 1.5 * ideal))
        self.row("  at most 2 requests at once to the site", "max %d" % site.max_active, "<= 2",
                 _verdict(site.max_active <= 2))
        fresh = self.spawn(env, threaded=False)
        same = 0
        try:
            fresh.handshake_sync()
            for page in pages:
                sc = _sc(fresh.call_sync("tools/call", fetch_params(page["url"], max_length=1000000)))
                same += sc.get("content") == page["content"] and sc.get("cached") is False
        finally:
            fresh.close()
        self.row("  pages whose Markdown equals a fresh web_fetch", "%d of %d" % (same, len(pages)), "all",
                 _verdict(same == len(pages) and pages))

    def _crawl_rss(self, site, env):
        client = self.spawn(env, threaded=False)
        try:
            client.handshake_sync()
            client.call_sync("tools/call", {"name": "web_crawl", "arguments": {
                "url": site.url + "/p/200", "max_pages": 5, "max_depth": 1}})
            before = rss_kb(client.pid)
            resp = client.call_sync("tools/call", {"name": "web_crawl", "arguments": {
                "url": site.url + "/p/0", "max_pages": CRAWL_RSS_PAGES, "max_depth": 5, "timeout": 60}})
            after = rss_kb(client.pid)
        finally:
            client.close()
        read = len(_sc(resp).get("pages") or [])
        if before is None or after is None:
            self.row("RSS growth of a %d-page crawl" % CRAWL_RSS_PAGES, "n/a", "< 30 MB")
            return
        growth = (after - before) / 1024.0
        self.row("RSS growth of a %d-page crawl (%d read)" % (CRAWL_RSS_PAGES, read), "%+.1f MB" % growth,
                 "< 30 MB", _verdict(growth < 30.0))

    def _fetch_cpu(self, site, env):
        client = self.spawn(env, threaded=False)
        first_ms, cpu_ms, page_ms, urls, errors = [], [], [], [], []
        try:
            client.handshake_sync()
            t0 = time.perf_counter()
            resp = client.call_sync("tools/call", fetch_params(site.url + "/article/cold"))
            cold_ms = (time.perf_counter() - t0) * 1000
            first = _sc(resp)
            total, next_start = first.get("total_length") or 0, first.get("next_start_index")
            for _ in range(FETCH_ROUNDS):
                cpu0 = cpu_seconds(client.pid)
                for _ in range(FETCH_BATCH):
                    urls.append(site.url + "/article/" + self.fresh_query("first").replace(" ", "-"))
                    t0 = time.perf_counter()
                    resp = client.call_sync("tools/call", fetch_params(urls[-1]))
                    first_ms.append((time.perf_counter() - t0) * 1000)
                    sc = _sc(resp)
                    if sc.get("status") != "success" or sc.get("cached") is not False:
                        errors.append("%s cached=%s %s" % (sc.get("status"), sc.get("cached"), sc.get("error")))
                cpu1 = cpu_seconds(client.pid)
                if cpu0 is not None and cpu1 is not None:
                    cpu_ms.append((cpu1 - cpu0) * 1000 / FETCH_BATCH)
            # Further pages of the documents fetched above, every one from the cache.
            starts = list(range(next_start, total, DEFAULT_PAGE_CHARS)) if next_start else []
            cached = 0
            cpu0 = cpu_seconds(client.pid)
            for i in range(PAGE_CALLS if starts else 0):
                t0 = time.perf_counter()
                resp = client.call_sync("tools/call", fetch_params(urls[i % len(urls)], start_index=starts[
                    i % len(starts)]))
                page_ms.append((time.perf_counter() - t0) * 1000)
                cached += _sc(resp).get("cached") is True
            cpu1 = cpu_seconds(client.pid)
            whole = _sc(client.call_sync("tools/call", fetch_params(urls[0], max_length=FETCH_WHOLE)))
        finally:
            client.close()
        note = "" if not errors else " (%d failed: %s)" % (len(errors), errors[0])
        self.row("first web_fetch in a fresh server (lazy imports)", "%.1f ms" % cold_ms)
        self.row("web_fetch of the article, round trip", "%.1f ms (median of %d distinct URLs)%s" % (
            _median(first_ms), len(first_ms), note))
        if cpu_ms:
            cpu = _median(cpu_ms)
            self.row("  server CPU per fetch (%d batches of %d)" % (FETCH_ROUNDS, FETCH_BATCH), "%.1f ms" % cpu,
                     "< 100 ms", _verdict(cpu < 100 and not errors))
        if page_ms:
            self.row("further page (start_index, cached), round trip", "%.3f ms (%d/%d cached, %d chars of %d)" % (
                _median(page_ms), cached, len(page_ms), DEFAULT_PAGE_CHARS, total))
            if cpu0 is not None and cpu1 is not None:
                page_cpu = (cpu1 - cpu0) * 1000 / len(page_ms)
                self.row("  server CPU per further page", "%.3f ms" % page_cpu, "< 1 ms",
                         _verdict(page_cpu < 1.0 and cached == len(page_ms)))
        else:
            self.row("further page (start_index, cached)", "n/a: the document fits one page (%d chars)" % total)
        missing = article_coverage(whole.get("content") or "", site.expected)
        self.row("Markdown completeness (whole document, %d chars)" % len(whole.get("content") or ""),
                 _coverage_text(site.expected, missing), "all present",
                 _verdict(whole.get("status") == "success" and not any(missing.values())))

    def _fetch_coalescing(self, site, env):
        client = self.spawn(env, threaded=True)
        hits, coalesced = [], []
        try:
            client.handshake()
            client.call("tools/call", fetch_params(site.url + "/article/warm"))
            site.latency_s = 0.3  # the leader stays in flight while the followers arrive
            for _ in range(COALESCE_ROUNDS):
                path = "/article/" + self.fresh_query("coalesce").replace(" ", "-")
                resps = _fan_out(client, [fetch_params(site.url + path)] * FETCH_COALESCE_CALLS, timeout_s=30.0)
                hits.append(site.visits_for(path))
                coalesced.append(sum(1 for r in resps if _sc(r).get("coalesced") is True))
        finally:
            site.latency_s = 0.0
            client.close()
        self.row("%d identical concurrent fetches -> upstream requests" % FETCH_COALESCE_CALLS,
                 "%s (coalesced %s)" % (", ".join(map(str, hits)), ", ".join(map(str, coalesced))), "exactly 1",
                 _verdict(all(h == 1 for h in hits)))

    # -- several pages in one call: include_content, urls -----------------------------------------

    def pages(self):
        site = FakeSite(latency_s=PAGES_LATENCY_S)
        search = FakeTavily(latency_s=PAGES_LATENCY_S, pages_at=site.url)
        client = self.spawn(offline_env(search.url, WEBSEARCH_FETCH_PROVIDERS="direct",
                                        WEBSEARCH_ALLOW_PRIVATE_URLS="1"), threaded=False)
        alone, with_content, one_call, separate, problems = [], [], [], [], []
        try:
            client.handshake_sync()
            for _ in range(PAGES_ROUNDS):
                t0 = time.perf_counter()
                client.call_sync("tools/call", search_params(self.fresh_query("bench alone"), numResults=5))
                alone.append((time.perf_counter() - t0) * 1000)
                t0 = time.perf_counter()
                sc = _sc(client.call_sync("tools/call", search_params(
                    self.fresh_query("bench content"), numResults=5, include_content=5)))
                with_content.append((time.perf_counter() - t0) * 1000)
                statuses = [r.get("content_status") for r in sc.get("results") or ()]
                if statuses != ["success"] * 5:
                    problems.append("include_content: %s" % statuses)
                urls = [site.url + "/article/" + self.fresh_query("many").replace(" ", "-") for _ in range(10)]
                t0 = time.perf_counter()
                sc = _sc(client.call_sync("tools/call", {"name": "web_fetch", "arguments": {"urls": urls}}))
                one_call.append((time.perf_counter() - t0) * 1000)
                if sc.get("succeeded") != 10:
                    problems.append("urls: %s of 10" % sc.get("succeeded"))
                t0 = time.perf_counter()
                for url in urls:
                    client.call_sync("tools/call", fetch_params(url + "-again"))
                separate.append((time.perf_counter() - t0) * 1000)
        finally:
            client.close()
            search.close()
            site.close()
        note = "" if not problems else " (%d problems: %s)" % (len(problems), problems[0])
        base = _median(alone)
        self.row("web_search of 5 results, round trip", "%.0f ms" % base)
        self.row("  with include_content=5 (five ~100 KB pages)", "%.0f ms = search + %.0f ms for all five pages%s" % (
            _median(with_content), _median(with_content) - base, note))
        self.row("web_fetch of 10 URLs in one call (urls)", "%.0f ms" % _median(one_call))
        self.row("  the same 10 pages in 10 calls, one after another", "%.0f ms = %.1fx the one call" % (
            _median(separate), _median(separate) / _median(one_call)))

    # -- web_answer over a streaming chat endpoint ---------------------------------------------

    def answer_env(self, chat, folder):
        return offline_env(self.fake.url, GROK_API_URL=chat.url + "/v1", GROK_API_KEY="test-key-123456",
                           WEBSEARCH_CONFIG_FILE=os.path.join(folder, "config.json"))

    def answer(self):
        chat = FakeChat()
        folder = _TempDir("smoke-answer-")
        try:
            env = self.answer_env(chat, folder.path)
            self._answer_latency(chat, env)
            self._answer_coalescing(chat, env)
        finally:
            folder.remove()
            chat.close()

    def _answer_latency(self, chat, env):
        client = self.spawn(env, threaded=False)
        overhead_ms, round_ms, stream_ms, big_cpu_ms, errors = [], [], [], [], []
        try:
            client.handshake_sync()
            client.call_sync("tools/call", answer_params(self.fresh_query("warm-up question")))
            for _ in range(ANSWER_CALLS):
                question = self.fresh_query("bench question")
                t0 = time.perf_counter()
                resp = client.call_sync("tools/call", answer_params(question))
                elapsed = (time.perf_counter() - t0) * 1000
                if _sc(resp).get("status") != "success" or question not in chat.stream_s:
                    errors.append("%s %s" % (_sc(resp).get("status"), _sc(resp).get("error")))
                    continue
                round_ms.append(elapsed)
                stream_ms.append(chat.stream_s[question] * 1000)
                overhead_ms.append(elapsed - stream_ms[-1])
            content_chars = set()
            for _ in range(BIG_ANSWER_RUNS):
                cpu0 = cpu_seconds(client.pid)
                resp = client.call_sync("tools/call", answer_params(self.fresh_query("big question")))
                cpu1 = cpu_seconds(client.pid)
                content_chars.add(len(_sc(resp).get("content") or ""))
                if cpu0 is not None and cpu1 is not None and _sc(resp).get("status") == "success":
                    big_cpu_ms.append((cpu1 - cpu0) * 1000)
        finally:
            client.close()
        note = "" if not errors else " (%d failed: %s)" % (len(errors), errors[0])
        self.row("streamed web_answer overhead over the fake's stream",
                 "%.1f ms (round trip %.1f ms - stream %.1f ms, median of %d)%s" % (
                     _median(overhead_ms), _median(round_ms), _median(stream_ms), len(overhead_ms), note))
        events = chat.big.count(b"\n\n")
        if big_cpu_ms:
            self.row("server CPU per 1 MB answer stream (%d events)" % events, "%.0f ms (median of %d; %s chars)" % (
                _median(big_cpu_ms), len(big_cpu_ms), "/".join(map(str, sorted(content_chars)))))
        ring = _load_server_module(self.server_path)
        lines = chat.big.decode("utf-8").split("\n")
        parse_ms, chars = [], 0
        for _ in range(BIG_ANSWER_RUNS):
            parser = ring.AnswerStreamParser("chat", ring.DEFAULT_RETRYABLE_CODES)
            t0 = time.thread_time()
            for line in lines:
                if parser.feed_line(line):
                    break
            parser.flush()
            parse_ms.append((time.thread_time() - t0) * 1000)
            chars = len(parser.result().content) if parser.done else -1
        self.row("  AnswerStreamParser.feed_line over its lines (in-process)", "%.0f ms = %.1f us per event (%s)" % (
            _median(parse_ms), _median(parse_ms) * 1000 / events,
            "%d chars" % chars if chars >= 0 else "stream NOT complete"))

    def _answer_coalescing(self, chat, env):
        client = self.spawn(env, threaded=True)
        hits, coalesced = [], []
        try:
            client.handshake()
            for _ in range(COALESCE_ROUNDS):
                question = self.fresh_query("coalesced question")
                resps = _fan_out(client, [answer_params(question)] * ANSWER_COALESCE_CALLS, timeout_s=30.0)
                hits.append(chat.visits_for(question))
                coalesced.append(sum(1 for r in resps if _sc(r).get("coalesced") is True))
        finally:
            client.close()
        self.row("%d identical concurrent questions -> upstream calls" % ANSWER_COALESCE_CALLS,
                 "%s (coalesced %s)" % (", ".join(map(str, hits)), ", ".join(map(str, coalesced))), "exactly 1",
                 _verdict(all(h == 1 for h in hits)))

    def progress(self):
        """One SLOW_ANSWER_S answer with a progressToken: when do notifications/progress arrive?"""
        chat = FakeChat()
        folder = _TempDir("smoke-answer-")
        client = self.spawn(self.answer_env(chat, folder.path), threaded=True)
        token = "bench-progress"
        try:
            client.handshake()
            params = dict(answer_params(self.fresh_query("slow question")), _meta={"progressToken": token})
            sent = time.monotonic()
            resp = client.call("tools/call", params, timeout_s=SLOW_ANSWER_S + 30.0)
            answered = time.monotonic()
        finally:
            client.close()
            folder.remove()
            chat.close()
        arrivals = [at for at, msg in zip(client.notification_times, client.notifications)
                    if msg.get("method") == "notifications/progress"
                    and (msg.get("params") or {}).get("progressToken") == token]
        intervals = [b - a for a, b in zip(arrivals, arrivals[1:])]
        silences = [b - a for a, b in zip([sent] + arrivals, arrivals + [answered])]
        status = _sc(resp).get("status")
        self.row("progress during a %.0f s answer (%s)" % (answered - sent, status),
                 "%d notifications, interval median %.2f s, max %.2f s; longest silence %.2f s" % (
                     len(arrivals), _median(intervals), max(intervals, default=float("nan")),
                     max(silences, default=float("nan"))))

    def shutdown(self):
        """The client goes (stdin EOF, SIGTERM) while a long answer streams: how soon does the process exit?"""
        chat = FakeChat()
        folder = _TempDir("smoke-shutdown-")
        how = ["stdin EOF"] + (["SIGTERM"] if os.name != "nt" else [])
        try:
            for way in how:
                seconds = []
                for _ in range(SHUTDOWN_RUNS):
                    client = self.spawn(self.answer_env(chat, folder.path), threaded=True)
                    try:
                        client.handshake()
                        params = dict(answer_params(self.fresh_query("slow question")), _meta={"progressToken": "p"})
                        client.send({"jsonrpc": "2.0", "id": 77, "method": "tools/call", "params": params})
                        wait_until(lambda: any("characters received" in str((m.get("params") or {}).get("message"))
                                               for m in list(client.notifications)), RPC_TIMEOUT_S, "the stream")
                        started = time.monotonic()
                        if way == "SIGTERM":
                            client.proc.terminate()
                        else:
                            client.close_stdin()
                        code = client.wait_exit(RPC_TIMEOUT_S)
                        seconds.append(time.monotonic() - started)
                        if code != 0:
                            raise CheckError("exit status %r after %s" % (code, way))
                    finally:
                        client.close()
                # stdin EOF first gives the call its 2 s grace to finish and be answered; SIGTERM does not.
                limit = 3.0 if way == "stdin EOF" else 1.0
                self.row("%s to exit, a %.0f s web_answer streaming" % (way, SLOW_ANSWER_S),
                         "%.1f ms" % (_median(seconds) * 1000), "< %.0f s" % limit, _verdict(_median(seconds) < limit))
        finally:
            folder.remove()
            chat.close()


class _TempDir:
    """A private temporary directory (tempfile is imported only when a bench needs it)."""

    def __init__(self, prefix):
        import tempfile
        self.path = tempfile.mkdtemp(prefix=prefix)

    def remove(self):
        shutil.rmtree(self.path, ignore_errors=True)


def _idle_rss_kb(argv, env, cwd=None):
    """RSS of a server after initialize and tools/list, half a second later."""
    client = RpcClient(argv, env, threaded=False, lifetime_s=30.0, cwd=cwd)
    try:
        client.handshake_sync()
        client.call_sync("tools/list", {})
        time.sleep(0.5)
        return rss_kb(client.pid)
    finally:
        client.close()


def _baseline_rss_kb(env):
    """RSS of a bare interpreter that imported json and threading, for comparison with idle RSS."""
    code = "import json, threading, sys; print('ready', flush=True); sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    timer = threading.Timer(30.0, proc.kill)  # bounds the readline below
    timer.daemon = True
    timer.start()
    try:
        proc.stdout.readline()
        time.sleep(0.2)
        return rss_kb(proc.pid)
    finally:
        timer.cancel()
        proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        proc.stdout.close()


def _time_run(argv, env, timeout_s=30.0):
    """Milliseconds from spawning argv to its exit.

    A blocking wait() bounded by a kill timer: wait(timeout=...) polls with sleeps of up to
    50 ms, which would swamp the figure being measured.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    timer = threading.Timer(timeout_s, proc.kill)
    timer.daemon = True
    timer.start()
    try:
        proc.wait()
    finally:
        timer.cancel()
    return (time.perf_counter() - t0) * 1000


def _import_launch(server_path, directory, env):
    """Copy the server into directory, byte-compile it there; return the argv that `config` gives a
    client for that copy (the imported form, which starts from the bytecode)."""
    import py_compile
    copy = os.path.join(directory, "websearch_ring.py")
    shutil.copyfile(server_path, copy)
    py_compile.compile(copy, doraise=True)
    done = subprocess.run([sys.executable, copy, "config", "cursor"], env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    expect(done.returncode == 0, "config cursor exited %d: %s" % (done.returncode, _short(done.stderr)))
    entry = json.loads(done.stdout.decode("utf-8"))["mcpServers"]["websearch-ring"]
    return [entry["command"]] + entry["args"]


def _time_init(argv, env, cwd=None):
    """Milliseconds from spawning argv to its initialize response (unthreaded client)."""
    t0 = time.perf_counter()
    client = RpcClient(argv, env, threaded=False, lifetime_s=30.0, cwd=cwd)
    try:
        resp = client.call_sync("initialize", client.initialize_params())
        elapsed = (time.perf_counter() - t0) * 1000
        expect("result" in resp, "initialize failed: %s" % _short(resp))
        return elapsed
    finally:
        client.close()


def _fan_out(client, calls, timeout_s):
    """Send one tools/call per params in `calls` at once; return the responses in order (None if missing)."""
    ids = [client.request("tools/call", params) for params in calls]
    deadline = time.monotonic() + timeout_s
    return [client.wait(i, max(0.0, deadline - time.monotonic())) for i in ids]


def _is_tool_error(resp):
    return "result" not in resp or bool(resp["result"].get("isError"))


def _sc(resp):
    """structuredContent of a tools/call response, {} when there is none (or no response)."""
    return ((resp or {}).get("result") or {}).get("structuredContent") or {}


def _load_server_module(path, _loaded={}):
    """websearch_ring imported from `path` for in-process timings, without writing a .pyc next to it."""
    if path not in _loaded:
        import types
        module = types.ModuleType("websearch_ring")
        module.__file__ = path
        with open(path, "rb") as f:
            exec(compile(f.read(), path, "exec"), module.__dict__)
        _loaded[path] = module
    return _loaded[path]


def _coverage_text(expected, missing):
    """'all N headings, ... present', or what is missing of each kind."""
    kinds = (("headings", "headings"), ("table_rows", "table rows"), ("code_blocks", "code blocks"),
             ("list_items", "list items"))
    if not any(missing.values()):
        return "all " + ", ".join("%d %s" % (len(expected[k]), name) for k, name in kinds) + " present"
    return "; ".join("%d/%d %s missing, first %s" % (len(missing[k]), len(expected[k]), name,
                                                    _short(missing[k][0], 60))
                     for k, name in kinds if missing[k])


def _verdict(ok):
    return "ok" if ok else "MISS"


def print_table(rows):
    """Rows are (metric, value, target, verdict); a row (title,) starts a section."""
    headers = ("metric", "value", "target", "")
    body = [r for r in rows if len(r) == 4]
    widths = [max(len(str(r[i])) for r in body + [headers]) for i in range(4)]
    line = "  ".join("%-*s" % (w, h) for w, h in zip(widths, headers)).rstrip()
    print(line)
    print("-" * len(line))
    for r in rows:
        if len(r) == 1:
            print("%s:" % r[0])
        else:
            print("  ".join("%-*s" % (w, c) for w, c in zip(widths, r)).rstrip())


# ----------------------------------------------------------------------------------------------
# PDF reader: AES cost and hostile documents (in process)
# ----------------------------------------------------------------------------------------------

PDF_BENCH_PAGES = 80            # pages of the synthetic document (~5 MB of Flate content)
PDF_BENCH_RUNS = 3


def _load_module(server_path):
    """websearch_ring.py loaded from ``server_path`` as a module of this process."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("websearch_ring_bench", server_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pdf_bytes(objects, trailer=b""):
    out = bytearray(b"%PDF-1.7\n")
    offsets = []
    for num, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (num, body)
    start = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % off for off in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R %s >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, trailer, start)
    return bytes(out)


def _pdf_stream(body, extra=b""):
    return b"<< /Length %d %s >>\nstream\n%s\nendstream" % (len(body), extra, body)


def _pdf_bench_document(ring, pages, key=None):
    """A document of ``pages`` pages of text (Flate streams with incompressible numbers, so that
    the file is megabytes); with ``key`` (32 bytes), every stream encrypted with AES-256 (V5 R5,
    empty user password)."""
    kids = b" ".join(b"%d 0 R" % (4 + 2 * i) for i in range(pages))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, pages),
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    for i in range(pages):
        lines = b"".join(b"0 -14 Td (Line %d of page %d: %s) Tj\n" % (n, i, base64.b64encode(
            hashlib.sha512(b"%d %d" % (i, n)).digest() * 3)) for n in range(300))
        body = zlib.compress(b"BT /F1 12 Tf 72 760 Td\n" + lines + b"ET", 6)
        if key is not None:
            iv = hashlib.md5(b"%d" % i).digest()
            pad = 16 - len(body) % 16
            body = iv + ring._pdf_aes_cbc_encrypt(key, iv, body + bytes([pad]) * pad)
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
                       b"/Contents %d 0 R >>" % (5 + 2 * i))
        objects.append(_pdf_stream(body, b"/Filter /FlateDecode"))
    if key is None:
        return _pdf_bytes(objects)
    salts = [hashlib.md5(b"salt%d" % n).digest()[:8] for n in range(4)]
    user = hashlib.sha256(salts[0]).digest() + salts[0] + salts[1]
    user_e = ring._pdf_aes_cbc_encrypt(hashlib.sha256(salts[1]).digest(), bytes(16), key)
    owner = hashlib.sha256(b"owner" + salts[2] + user).digest() + salts[2] + salts[3]
    owner_e = ring._pdf_aes_cbc_encrypt(hashlib.sha256(b"owner" + salts[3] + user).digest(), bytes(16), key)
    objects.append(b"<< /Filter /Standard /V 5 /R 5 /Length 256 /P -4 /O <%s> /U <%s> /OE <%s> /UE <%s> "
                   b"/CF << /StdCF << /CFM /AESV3 /AuthEvent /DocOpen /Length 32 >> >> /StmF /StdCF /StrF /StdCF >>"
                   % tuple(v.hex().encode() for v in (owner, user, owner_e, user_e)))
    return _pdf_bytes(objects, b"/Encrypt %d 0 R /ID [<00> <00>]" % len(objects))


def _pdf_nested_forms(levels=20, fanout=10):
    """A hostile document: a page drawing form XObjects that each draw the next ten times."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 4 0 R >> "
               b"/XObject << /X 6 0 R >> >> /Contents 5 0 R >>",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
               _pdf_stream(b"BT /F1 12 Tf 72 700 Td (start) Tj ET /X Do")]
    for i in range(levels):
        inner = b"/Resources << /XObject << /X %d 0 R >> /Font << /F1 4 0 R >> >>" % (7 + i) if i < levels - 1 else b""
        objects.append(_pdf_stream(b"/X Do " * fanout + b"BT (x) Tj ET",
                                   b"/Type /XObject /Subtype /Form /BBox [0 0 10 10] " + inner))
    return _pdf_bytes(objects)


def _pdf_number_runs(count):
    """A hostile document for memory: a page whose two content streams hold ``count`` numbers and no operator."""
    body = zlib.compress(b"1 " * count, 9)
    return _pdf_bytes([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
                       b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents [4 0 R 5 0 R] >>",
                       _pdf_stream(body, b"/Filter /FlateDecode"), _pdf_stream(body, b"/Filter /FlateDecode")])


def _cpu_median(fn, runs):
    times = []
    for _ in range(runs):
        started = time.process_time()
        fn()
        times.append(time.process_time() - started)
    return _median(times)


def _stopped_after(ring, data, stop_at_s, cancel):
    """Seconds pdf_to_text runs on ``data`` when its deadline (or a cancel) comes after ``stop_at_s``."""
    token, started = ring.CancelToken(), time.monotonic()
    if cancel:
        timer = threading.Timer(stop_at_s, token.cancel)
        timer.start()
        check = token.check
    else:
        def check():
            if time.monotonic() - started > stop_at_s:
                raise TimeoutError("deadline")
    try:
        ring.pdf_to_text(data, check=check)
    except (TimeoutError, ring.Cancelled):
        pass
    return time.monotonic() - started


def bench_pdf(bench):
    """AES throughput, the cost of an encrypted document against the same one in the clear, and
    hostile documents (time to stop at a deadline or a cancel, memory)."""
    import tracemalloc
    ring = _load_module(bench.server_path)
    for size in (16, 32):
        key, data = bytes(range(size)), os.urandom(4 << 20)
        cpu = _cpu_median(lambda: ring._pdf_aes_cbc_decrypt(key, bytes(16), data), PDF_BENCH_RUNS)
        bench.row("AES-%d-CBC decryption, 4 MB" % (size * 8), "%.1f MB/s" % (len(data) / cpu / 1e6))
    plain = _pdf_bench_document(ring, PDF_BENCH_PAGES)
    secret = _pdf_bench_document(ring, PDF_BENCH_PAGES, hashlib.sha256(b"bench").digest())
    if ring.pdf_to_text(plain) != ring.pdf_to_text(secret):
        raise AssertionError("the encrypted document reads differently")
    cpu_plain = _cpu_median(lambda: ring.pdf_to_text(plain), PDF_BENCH_RUNS)
    cpu_secret = _cpu_median(lambda: ring.pdf_to_text(secret), PDF_BENCH_RUNS)
    bench.row("pdf_to_text, %.1f MB, %d pages, in the clear" % (len(plain) / 1e6, PDF_BENCH_PAGES),
              "%.2f s CPU" % cpu_plain)
    bench.row("the same encrypted with AES-256 (R5)", "%.2f s CPU = %.2fx" % (cpu_secret, cpu_secret / cpu_plain),
              "< 2x", "ok" if cpu_secret < 2 * cpu_plain else "OVER")
    forms = _pdf_nested_forms()
    took = _stopped_after(ring, forms, 1.0, cancel=False)
    bench.row("%.1f KB of nested forms, deadline at 1 s" % (len(forms) / 1e3), "stopped at %.2f s" % took,
              "< 2 s", "ok" if took < 2.0 else "OVER")
    took = _stopped_after(ring, forms, 0.3, cancel=True)
    bench.row("the same, cancelled at 0.3 s", "%.2f s after the cancel" % (took - 0.3), "< 0.5 s",
              "ok" if took - 0.3 < 0.5 else "OVER")
    runs = _pdf_number_runs(16 << 20)
    cpu = _cpu_median(lambda: _pdf_read_or_fail(ring, runs), 1)
    bench.row("%.0f KB holding 2 x 16 M numbers, no operator" % (len(runs) / 1e3), "%.2f s CPU" % cpu)
    runs = _pdf_number_runs(2 << 20)            # traced, smaller: tracemalloc slows the lexer tenfold
    tracemalloc.start()
    _pdf_read_or_fail(ring, runs)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    bench.row("the same with 2 x 2 M numbers, memory", "%.0f MB peak (tracemalloc)" % (peak / 1e6), "< 128 MB",
              "ok" if peak < 128e6 else "OVER")


def _pdf_read_or_fail(ring, data):
    try:
        ring.pdf_to_text(data)
    except ring.PdfError:
        pass


# --bench: serve --http (Streamable HTTP) and the persistent cache
# ----------------------------------------------------------------------------------------------

HTTP_CLIENTS, HTTP_CALLS_EACH = 50, 20          # calls per second: 50 clients, cached calls
MANY_CLIENTS, MANY_CALLS = 100, 10              # correctness: 100 clients x 10 calls at once
HTTP_SESSIONS_CHURN = 1000


class HttpMcpClient:
    """One Streamable HTTP client of ``serve --http``: a keep-alive connection and a session."""

    def __init__(self, port):
        import http.client
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.sid = None
        self.next_id = 0

    def post(self, message):
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.sid:
            headers.update({"Mcp-Session-Id": self.sid, "MCP-Protocol-Version": "2025-11-25"})
        self.conn.request("POST", "/mcp", body=json.dumps(message), headers=headers)
        response = self.conn.getresponse()
        body = response.read()
        if response.getheader("Mcp-Session-Id"):
            self.sid = response.getheader("Mcp-Session-Id")
        if response.getheader("Content-Type", "").startswith("text/event-stream"):
            body = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")][-1].encode()
        return response.status, json.loads(body) if body else None

    def initialize(self):
        status, _ = self.post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}})
        expect(status == 200 and self.sid, "initialize over HTTP failed: %s" % status)
        self.post({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def call(self, query):
        self.next_id += 1
        status, answer = self.post({"jsonrpc": "2.0", "id": self.next_id, "method": "tools/call",
                                    "params": search_params(query)})
        return self.next_id, status, answer

    def close(self, delete=True):
        if delete and self.sid:
            self.conn.request("DELETE", "/mcp", headers={"Mcp-Session-Id": self.sid})
            self.conn.getresponse().read()
        self.conn.close()


def spawn_http_server(server_path, env):
    """``serve --http 127.0.0.1:0`` as a child: (process, port), the port read from its first stderr line."""
    proc = subprocess.Popen([sys.executable, server_path, "serve", "--http", "127.0.0.1:0"], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    line = proc.stderr.readline().decode("utf-8", "replace")
    port = line.rsplit("127.0.0.1:", 1)[-1].split("/", 1)[0]
    expect(port.isdigit(), "serve --http did not say where it listens: %r" % line)
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    return proc, int(port)


def _in_threads(n, work):
    """Run work(i) for i < n on n threads at once; the results in order (an exception is a result)."""
    results = [None] * n
    start = threading.Barrier(n)

    def run(i):
        try:
            start.wait(30)
            results[i] = work(i)
        except Exception as exc:  # reported by the caller
            results[i] = exc
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def _bench_http(bench):
    """HTTP round trip of a cached call, calls per second with 50 clients, 100 clients x 10 calls (every
    id answered once, identical queries coalesced across clients), 1,000 sessions opened and closed."""
    bench.fake.latency_s = 0.0
    proc, port = spawn_http_server(bench.server_path, offline_env(bench.fake.url))
    try:
        one = HttpMcpClient(port)
        one.initialize()
        query = bench.fresh_query("bench http")
        one.call(query)
        times = []
        for _ in range(300):
            t0 = time.perf_counter()
            _, status, answer = one.call(query)
            times.append((time.perf_counter() - t0) * 1000)
            expect(status == 200 and answer["result"]["structuredContent"]["cached"], "cached call failed")
        one.close()
        bench.row("cached web_search round trip over HTTP (keep-alive)", "%.3f ms" % _median(times[50:]))
        _bench_http_clients(bench, port, query)
        _bench_http_many(bench, port)
        _bench_http_sessions(bench, port, proc.pid)
    finally:
        proc.terminate()
        proc.wait(10)


def _bench_http_clients(bench, port, query):
    def client(i):
        c = HttpMcpClient(port)
        c.initialize()
        t0 = time.perf_counter()
        for _ in range(HTTP_CALLS_EACH):
            _, status, answer = c.call(query)
            expect(status == 200 and "result" in answer, "a call failed")
        elapsed = time.perf_counter() - t0
        c.close()
        return elapsed
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        results = _in_threads(HTTP_CLIENTS, client)
        wall = time.perf_counter() - t0
        failed = [r for r in results if isinstance(r, Exception)]
        expect(not failed, "HTTP clients failed: %s" % failed[:3])
        rates.append(HTTP_CLIENTS * HTTP_CALLS_EACH / wall)
    bench.row("%d clients x %d cached calls (session each)" % (HTTP_CLIENTS, HTTP_CALLS_EACH),
              "%.0f calls/s" % _median(rates))


def _bench_http_many(bench, port):
    """100 clients x 10 calls at once: the first call of every client is one shared query."""
    bench.fake.latency_s = 0.2
    shared = bench.fresh_query("bench http shared")
    queries = [[shared] + [bench.fresh_query("bench http c%d" % i) for _ in range(MANY_CALLS - 1)]
               for i in range(MANY_CLIENTS)]

    def client(i):
        c = HttpMcpClient(port)
        c.initialize()
        answered = []
        for q in queries[i]:
            msg_id, status, answer = c.call(q)
            ok = status == 200 and answer.get("id") == msg_id and not answer["result"]["isError"]
            answered.append((msg_id, ok))
        c.close()
        return answered
    try:
        results = _in_threads(MANY_CLIENTS, client)
    finally:
        bench.fake.latency_s = 0.0
    errors = [r for r in results if isinstance(r, Exception)]
    answers = [a for r in results if not isinstance(r, Exception) for a in r]
    ok = not errors and len(answers) == MANY_CLIENTS * MANY_CALLS and all(good for _, good in answers)
    hits = bench.fake.visits_for(shared)
    bench.row("%d clients x %d calls at once" % (MANY_CLIENTS, MANY_CALLS),
              "%d answered, %d failed; shared query upstream %d time(s)" % (
                  len(answers), len(errors) + sum(1 for _, good in answers if not good), hits),
              "all, once", _verdict(ok and hits == 1))


def _bench_http_sessions(bench, port, pid):
    before = rss_kb(pid)
    c = HttpMcpClient(port)
    for _ in range(HTTP_SESSIONS_CHURN):
        c.sid = None
        c.initialize()
        c.conn.request("DELETE", "/mcp", headers={"Mcp-Session-Id": c.sid})
        c.conn.getresponse().read()
    c.close(delete=False)
    after = rss_kb(pid)
    if before is not None and after is not None:
        bench.row("%d sessions opened and closed: RSS change" % HTTP_SESSIONS_CHURN,
                  "%+.1f MB" % ((after - before) / 1024.0), "< 10 MB", _verdict(after - before < 10 * 1024))


def _bench_cache_db(bench, n=21):
    """A second process answers from the first one's WEBSEARCH_CACHE_DB without going upstream: the
    round trip of each query the first one asked (its first call also pays the process's warm-up)."""
    import tempfile
    folder = tempfile.mkdtemp(prefix="websearch-ring-bench-")
    try:
        env = offline_env(bench.fake.url, WEBSEARCH_CACHE_DB=os.path.join(folder, "cache.sqlite"))
        queries = [bench.fresh_query("bench cache db") for _ in range(n)]
        first = bench.spawn(env, threaded=True)
        try:
            first.handshake()
            for query in queries:
                first.call("tools/call", search_params(query))
        finally:
            first.close()
        second = bench.spawn(env, threaded=True)
        times, cached = [], 0
        try:
            second.handshake()
            for query in queries:
                t0 = time.perf_counter()
                resp = second.call("tools/call", search_params(query))
                times.append((time.perf_counter() - t0) * 1000)
                cached += _sc(resp).get("cached") is True
        finally:
            second.close()
        upstream = sum(bench.fake.visits_for(q) for q in queries)
        median = _median(times[1:])
        bench.row("second process answers the first one's queries (WEBSEARCH_CACHE_DB)",
                  "%.2f ms median round trip (first call %.1f ms), %d/%d cached, upstream %d for %d queries" % (
                      median, times[0], cached, n, upstream, n),
                  "< 2 ms, upstream once each", _verdict(cached == n and median < 2.0 and upstream == n))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_bench(server_path):
    """--bench: measure every figure, print a table; exit 1 only if a measurement broke."""
    if not os.path.isfile(server_path):
        print("FAIL server present: %s not found" % server_path)
        return 1
    fake = FakeTavily()
    bench = Bench(server_path, fake)
    broken = []
    phases = (
        ("start-up", None, bench.startup),
        ("latency", None, bench.latency),
        ("floor", "side by side: a minimal stdlib MCP server making the same Tavily request (the floor)",
         bench.floor),
        ("concurrency", None, bench.concurrency),
        ("memory growth", None, bench.growth),
        ("fan-out", "web_search mode=fanout over tavily, bing, duckduckgo, exa (each %d results after %.0f ms)"
         % (ENGINE_RESULTS, FANOUT_LATENCY_S * 1000), bench.fanout),
        ("web_fetch", "web_fetch, direct provider, ~%.0f KB article" % (ARTICLE_BYTES / 1024.0), bench.fetch),
        ("web_crawl", "web_crawl of a loopback site, built-in crawler", bench.crawl),
        ("several pages", "several pages in one call (search and every page answer after %.0f ms)"
         % (PAGES_LATENCY_S * 1000), bench.pages),
        ("web_answer", "web_answer over a streaming chat endpoint (~%.0f ms per normal answer)"
         % (ANSWER_STREAM_S * 1000), bench.answer),
        ("shutdown", "the client going away while a %.0f s web_answer streams" % SLOW_ANSWER_S, bench.shutdown),
        ("pdf", "PDF reader in process: AES, and hostile documents", lambda: bench_pdf(bench)),


        ("serve --http", "serve --http: MCP Streamable HTTP, one server for many clients",
         lambda: _bench_http(bench)),
        ("persistent cache", "WEBSEARCH_CACHE_DB", lambda: _bench_cache_db(bench)),
        # Last: it takes a minute.
        ("web_answer progress cadence (one %.0f s answer, please wait)" % SLOW_ANSWER_S, None, bench.progress),
    )
    try:
        for name, title, phase in phases:
            print("bench: %s ..." % name, file=sys.stderr, flush=True)
            if title:
                bench.section(title)
            try:
                phase()
            except Exception as exc:  # report and go on: the other figures are still worth having
                broken.append(name)
                bench.row("%s phase" % name, "ERROR %s: %s" % (type(exc).__name__, _short(str(exc), 120)))
    finally:
        fake.close()
    print("python %s on %s; medians of several runs" % (sys.version.split()[0], sys.platform))
    print_table(bench.rows)
    return 1 if broken else 0


# ----------------------------------------------------------------------------------------------
# Soak: a long run with faults, watching the server's memory
# ----------------------------------------------------------------------------------------------

SOAK_FAULT_RATE = 0.3       # share of upstream answers that go wrong
SOAK_WORKERS = 4            # client threads calling at once
SOAK_SAMPLE_S = 5.0         # RSS sampled this often
SOAK_WARMUP_S = 60.0        # growth is measured from here on
SOAK_GROWTH_MB = 10.0       # target: at most this much growth after the warm-up
# The page cache is made small enough to fill during the warm-up (every page of the soak is a
# new URL): what grows after it is not a cache filling up to its bound.
SOAK_PAGE_CACHE_MB = 16


class FaultyTavily(FakeTavily):
    """FakeTavily whose answers go wrong ``fault_rate`` of the time, in turns: a 500, a 429, broken
    JSON, JSON of the wrong shape, a body cut short, an answer after the server's timeout."""

    FAULTS = ("http_500", "http_429", "broken_json", "wrong_shape", "cut_body", "too_slow")

    def __init__(self, *, fault_rate=SOAK_FAULT_RATE, slow_s=1.5, **kwargs):
        super().__init__(**kwargs)
        self.fault_rate = fault_rate
        self.slow_fault_s = slow_s
        self._turn = 0
        self.faults = collections.Counter()

    def _search(self, request):
        with self._lock:
            self._turn += 1
            turn = self._turn
        # Deterministic and spread out: the same answers of every ten go wrong, so runs compare.
        if (turn * 7) % 10 >= self.fault_rate * 10:
            super()._search(request)
            return
        fault = self.FAULTS[(turn // 10) % len(self.FAULTS)]
        with self._lock:
            self.faults[fault] += 1
        if fault == "http_500":
            request.reply_json(500, {"detail": {"error": "Internal Server Error"}})
        elif fault == "http_429":
            request.reply_json(429, {"detail": {"error": "rate limited"}})
        elif fault == "broken_json":
            request.reply(200, "application/json", b'{"results": [{"url": ')
        elif fault == "wrong_shape":
            request.reply_json(200, {"results": {"url": "https://example.test/"}})
        elif fault == "cut_body":
            request.close_connection = True
            request.send_response(200)
            request.send_header("Content-Length", "5000")
            request.end_headers()
            request.wfile.write(b'{"results": [')
        else:
            self.pause(self.slow_fault_s)
            super()._search(request)


def _soak_call(client, rng, serial, pages):
    """One call of the soak's mix: new searches, repeated ones, searches with pages, page fetches."""
    pick = rng.random()
    if pick < 0.45:
        params = search_params("soak %d" % serial)
    elif pick < 0.65:
        params = search_params("soak repeated %d" % rng.randrange(20))
    elif pick < 0.85:
        params = search_params("soak pages %d" % serial, include_content=2)
    else:
        params = fetch_params(pages + "/article/soak-%d" % rng.randrange(200))
    client.call("tools/call", params, timeout_s=30.0)


def run_soak(server_path, seconds):
    """--soak SECONDS: calls with faults for that long; prints RSS over time and the growth after
    the first minute (target: under SOAK_GROWTH_MB)."""
    import random
    site = FakeSite()
    fake = FaultyTavily(pages_at=site.url)
    client = RpcClient([sys.executable, server_path], offline_env(
        fake.url, WEBSEARCH_TIMEOUT_MS=1000, WEBSEARCH_ALLOW_PRIVATE_URLS=1, WEBSEARCH_FETCH_PROVIDERS="direct",
        WEBSEARCH_COOLDOWN_MS=1000, WEBSEARCH_FETCH_CACHE_MB=SOAK_PAGE_CACHE_MB), lifetime_s=seconds + 120.0)
    end, calls, failures, samples = time.monotonic() + seconds, [0], [0], []
    lock = threading.Lock()

    def worker(n):
        rng = random.Random(n)
        while time.monotonic() < end:
            with lock:
                calls[0] += 1
                serial = calls[0]
            try:
                _soak_call(client, rng, serial, site.url)
            except Exception:       # a lost answer is counted; the soak goes on
                with lock:
                    failures[0] += 1
    try:
        client.handshake()
        started = time.monotonic()
        threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(SOAK_WORKERS)]
        for thread in threads:
            thread.start()
        while time.monotonic() < end:
            time.sleep(min(SOAK_SAMPLE_S, max(0.0, end - time.monotonic())))
            samples.append((time.monotonic() - started, rss_kb(client.pid)))
            print("soak: %5.0f s  RSS %s  %d calls" % (samples[-1][0], _mb(samples[-1][1]), calls[0]),
                  file=sys.stderr, flush=True)
        for thread in threads:
            thread.join(35.0)
    finally:
        client.close()
        fake.close()
        site.close()
    return _soak_report(samples, calls[0], failures[0], fake.faults)


def _soak_report(samples, calls, failures, faults):
    known = [(t, kb) for t, kb in samples if kb is not None]
    if not known:
        print("soak: RSS unknown on this platform (%d calls)" % calls)
        return 1
    after_warmup = [kb for t, kb in known if t >= SOAK_WARMUP_S] or [known[-1][1]]
    start_kb, end_kb = after_warmup[0], known[-1][1]
    growth = (end_kb - start_kb) / 1024.0
    print("soak: %d calls (%d without an answer), faults %s" % (calls, failures, dict(faults)))
    print("soak: RSS at %.0f s %s, at the end (%.0f s) %s, peak %s; growth after the warm-up %.1f MB (target < %.0f MB)"
          % (min(t for t, _ in known if t >= SOAK_WARMUP_S) if known[-1][0] >= SOAK_WARMUP_S else known[-1][0],
             _mb(start_kb), known[-1][0], _mb(end_kb), _mb(max(kb for _, kb in known)), growth, SOAK_GROWTH_MB))
    return 0 if growth < SOAK_GROWTH_MB and not failures else 1


# ----------------------------------------------------------------------------------------------
# One real query
# ----------------------------------------------------------------------------------------------

def run_query(server_path, query):
    """Run the server with the caller's own environment and print one web_search result."""
    client = start_server(dict(os.environ), server_path=server_path, lifetime_s=REAL_QUERY_TIMEOUT_S + 10)
    try:
        client.handshake()
        resp = client.call("tools/call", search_params(query), timeout_s=REAL_QUERY_TIMEOUT_S)
    except CheckError as exc:
        print("no answer from the server: %s" % exc)
        for line in list(client.stderr_tail)[-20:]:
            print("  stderr: " + line)
        return 1
    finally:
        client.close()
    if "error" in resp:
        print("JSON-RPC error: %s" % _short(resp["error"], 2000))
        return 1
    result = resp.get("result") or {}
    print(result_text(result))
    sc = result.get("structuredContent") or {}
    print("\n[status=%s vendor=%s cached=%s duration_ms=%s isError=%s]" % (
        sc.get("status"), sc.get("vendor"), sc.get("cached"), sc.get("duration_ms"), result.get("isError")))
    return 1 if result.get("isError") else 0


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------

def _tolerant_stdio():
    """Never fail on printing: a Windows console or pipe may use a code page without the
    characters of a FAIL detail or of a real result."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError, OSError):
            pass


def main(argv=None):
    _tolerant_stdio()
    parser = argparse.ArgumentParser(description="Smoke test and benchmarks for websearch_ring.py.")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--offline", action="store_true", help="protocol checks against a loopback fake")
    mode.add_argument("--bench", action="store_true", help="performance figures against a loopback fake")
    mode.add_argument("--soak", type=float, metavar="SECONDS",
                      help="calls with 30%% upstream faults for SECONDS; RSS growth after the first minute")
    parser.add_argument("--server", default=SERVER_PATH, help="path of websearch_ring.py (default: next to this file)")
    parser.add_argument("query", nargs="?", help="run one real web_search with the default configuration")
    args = parser.parse_args(argv)
    server_path = os.path.abspath(args.server)
    if args.offline:
        return run_offline(server_path)
    if args.bench:
        return run_bench(server_path)
    if args.soak:
        return run_soak(server_path, args.soak)
    if args.query:
        return run_query(server_path, args.query)
    parser.print_usage()
    return 2


if __name__ == "__main__":
    sys.exit(main())
