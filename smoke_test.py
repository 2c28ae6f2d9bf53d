#!/usr/bin/env python3
"""smoke_test: end-to-end checks and benchmarks for websearch_ring.py. Standard library only.

The server is run exactly as an MCP client runs it: ``[sys.executable, websearch_ring.py]`` as a
child process, newline-delimited JSON-RPC 2.0 over binary stdin/stdout pipes.

Usage:
  python smoke_test.py --offline   protocol checks against a loopback fake Tavily (no network)
  python smoke_test.py --bench     the performance figures of DESIGN section 10 (no network)
  python smoke_test.py "query"     one real web_search with the default configuration

Contents:
  constants and small helpers;  FakeTavily (loopback upstream);  RpcClient (JSON-RPC over pipes);
  process probes (RSS, CPU);  offline checks;  benchmarks;  real query;  main.

--offline prints one line per check (``ok  name`` / ``FAIL name: detail``), then ``N passed, M failed``,
and exits 1 on any failure. Every wait is bounded by a timeout, every loop by a count, and every
child process is killed in a ``finally`` (and by a watchdog if a phase overruns).
"""

import argparse
import collections
import hashlib
import json
import math
import os
import queue
import shutil
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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
        "NO_PROXY": "*",
        "no_proxy": "*",
    })
    env.update({k: str(v) for k, v in overrides.items()})
    return env


# ----------------------------------------------------------------------------------------------
# FakeTavily: a loopback upstream speaking Tavily's POST /search wire format
# ----------------------------------------------------------------------------------------------

class _QuietHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer that never prints tracebacks: clients hang up on purpose (cancellation)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256  # the benches open many connections at once

    def handle_error(self, request, client_address):
        pass


class _TavilyHandler(BaseHTTPRequestHandler):
    """POST /search with a JSON body -> 200 application/json, like api.tavily.com."""

    protocol_version = "HTTP/1.1"  # keep-alive when the client wants it
    server_version = "FakeTavily/1.0"
    # Headers and body go out in separate writes; without TCP_NODELAY, Nagle's
    # algorithm and the client's delayed ACK stall every kept-alive answer ~40 ms
    # (real API front ends disable Nagle too).
    disable_nagle_algorithm = True

    def log_message(self, format, *args):  # noqa: A002 (signature fixed by the base class)
        pass

    def do_POST(self):
        fake = self.server.fake
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = 0
        raw = self.rfile.read(length) if 0 < length <= (1 << 20) else b""
        if self.path.split("?", 1)[0].rstrip("/") != "/search":
            self._send(404, {"detail": {"error": "Not Found"}})
            return
        try:
            body = json.loads(raw.decode("utf-8"))
            query = body["query"]
            if not isinstance(query, str):
                raise TypeError("query is not a string")
        except (ValueError, KeyError, TypeError):
            self._send(400, {"detail": {"error": "400 Bad Request"}})
            return
        fake.enter(query, dict(self.headers.items()))
        try:
            delay_s = fake.slow_s if "slow" in query else fake.latency_s
            if delay_s > 0:
                fake.stopping.wait(delay_s)  # wakes early when the fake stops
            self._send(200, fake.build_response(query, body.get("max_results")))
        finally:
            fake.leave()

    def _send(self, status, obj):
        data = json.dumps(obj).encode("utf-8")
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the server aborted the request (cancellation): nothing to tell
            self.close_connection = True


class FakeTavily:
    """Loopback stand-in for api.tavily.com.

    Results depend on the query, so distinct queries give distinct results. ``hits`` counts
    requests per query; ``latency_s`` delays every answer; a query containing "slow" sleeps
    ``slow_s`` instead (bounded, and cut short by ``stop()``) so cancellation can be tested.
    """

    def __init__(self, *, latency_s=0.0, slow_s=SLOW_QUERY_S):
        self.latency_s = latency_s
        self.slow_s = slow_s
        self.stopping = threading.Event()
        self._lock = threading.Lock()  # guards hits, last_headers, active, max_active
        self.hits = collections.Counter()
        self.last_headers = {}
        self.active = 0
        self.max_active = 0
        self._httpd = _QuietHTTPServer(("127.0.0.1", 0), _TavilyHandler)
        self._httpd.fake = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-tavily", daemon=True)

    @property
    def url(self):
        host, port = self._httpd.server_address[:2]
        return "http://%s:%d" % (host, port)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self.stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def enter(self, query, headers):
        with self._lock:
            self.hits[query] += 1
            self.last_headers = headers
            self.active += 1
            self.max_active = max(self.max_active, self.active)

    def leave(self):
        with self._lock:
            self.active -= 1

    def hits_for(self, query):
        with self._lock:
            return self.hits[query]

    def total_hits(self):
        with self._lock:
            return sum(self.hits.values())

    def reset_peak(self):
        with self._lock:
            self.max_active = self.active

    def wait_for_hit(self, query, timeout_s):
        """True once the upstream has seen `query` (bounded poll)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.hits_for(query):
                return True
            time.sleep(0.01)
        return False

    @staticmethod
    def result_url(query, rank):
        tag = hashlib.sha1(query.encode("utf-8")).hexdigest()[:10]
        return "https://example-%s.test/page/%d" % (tag, rank)

    def build_response(self, query, max_results):
        if isinstance(max_results, bool) or not isinstance(max_results, int):
            max_results = 5  # Tavily's default
        count = max(0, min(20, max_results))
        results = [{
            "title": "%s - result %d" % (query, rank),
            "url": self.result_url(query, rank),
            "content": "Snippet %d about %s, served by the loopback fake." % (rank, query),
            "score": round(0.95 - 0.04 * rank, 4),
            "raw_content": None,
        } for rank in range(1, count + 1)]
        return {"query": query, "follow_up_questions": None, "answer": None, "images": [],
                "results": results, "response_time": 0.1}


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
        for _ in range(100000):  # notifications may come first; bounded all the same
            line = self.proc.stdout.readline()
            if not line:
                raise CheckError("server closed stdout before answering %s%s" % (method, self.exit_note()))
            msg = self._parse_line(line)
            if isinstance(msg, dict) and "method" not in msg and msg.get("id") == rpc_id:
                return msg
            if msg is not None:
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


# ----------------------------------------------------------------------------------------------
# Process probes: RSS and CPU of a running child
# ----------------------------------------------------------------------------------------------

def rss_kb(pid):
    """Resident set size in KiB: /proc on Linux, `ps -o rss=` elsewhere, None if unknown."""
    try:
        with open("/proc/%d/status" % pid, "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    if shutil.which("ps"):
        try:
            out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True,
                                 text=True, timeout=5)
            return int(out.stdout.strip())
        except (OSError, ValueError, subprocess.SubprocessError):
            pass
    return None


def cpu_seconds(pid):
    """User + system CPU seconds of a running process from /proc/<pid>/stat; None off Linux."""
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
            ('numResults "8" -> /numResults issue', self.check_numresults_string),
            ("unknown tool -> -32602", self.check_unknown_tool),
            ("unknown method -> -32601", self.check_unknown_method),
            ("non-JSON line -> -32700", self.check_parse_error),
            ("cancelled call gets no response", self.check_cancellation),
            ("cancelled call not cached", self.check_cancel_not_cached),
            ("EOF answers in-flight call, exit 0", self.check_eof),
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
        expect(self.fake.hits_for(query) == 1, "upstream hits = %d, expected 1" % self.fake.hits_for(query))

    def check_keyless_headers(self):
        headers = {k.lower(): v for k, v in self.fake.last_headers.items()}
        expect(headers.get("x-tavily-access-mode") == "keyless",
               "X-Tavily-Access-Mode = %r, expected keyless" % headers.get("x-tavily-access-mode"))
        expect("authorization" not in headers, "an Authorization header was sent without a key")

    def check_cached(self):
        query = "smoke alpha"
        resp = self.client.call("tools/call", search_params(query))
        sc = expect_success(resp)
        expect(sc.get("cached") is True, "cached = %r, expected true" % sc.get("cached"))
        expect(self.fake.hits_for(query) == 1,
               "upstream hits = %d after the repeat, expected 1" % self.fake.hits_for(query))
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
        hits = self.fake.hits_for(query)
        expect(hits == 1, "upstream hits = %d for 10 identical concurrent calls, expected 1" % hits)
        coalesced = sum(1 for sc in scs if sc.get("coalesced") is True)
        expect(coalesced >= 1, "no result has coalesced true (cached: %d)"
               % sum(1 for sc in scs if sc.get("cached") is True))
        urls = {tuple(r.get("url") for r in sc["results"]) for sc in scs}
        expect(len(urls) == 1, "the 10 calls returned %d different result lists" % len(urls))

    def check_empty_query(self):
        expect_validation_issue(self.client.call("tools/call", search_params("")), "/query")

    def check_numresults_string(self):
        resp = self.client.call("tools/call", search_params("smoke numresults", numResults="8"))
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
        expect(self.fake.wait_for_hit(query, 5.0), "the slow query never reached the upstream")
        cancelled_at = time.monotonic()
        self.client.notify("notifications/cancelled", {"requestId": rpc_id, "reason": "smoke test cancel"})
        ping = self.client.call("ping", timeout_s=CANCEL_SILENCE_S)
        expect(ping.get("result") == {}, "ping after cancel: %s" % _short(ping))
        late = self.client.wait(rpc_id, max(0.0, cancelled_at + CANCEL_SILENCE_S - time.monotonic()))
        expect(late is None, "cancelled request %s was answered: %s" % (rpc_id, _short(late)))

    def check_cancel_not_cached(self):
        # If the cancelled call were still running, this identical call would join it (coalesced,
        # slow); if it had been cached, this would be cached. Either way the hit count shows it.
        query = self.CANCEL_QUERY
        before = self.fake.hits_for(query)
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
        expect(self.fake.hits_for(query) == before + 1,
               "upstream hits %d -> %d, expected one new request" % (before, self.fake.hits_for(query)))

    def check_eof(self):
        query = "smoke eof"
        self.fake.latency_s = 0.5
        try:
            rpc_id = self.client.request("tools/call", search_params(query))
            self.client.close_stdin()
            resp = self.client.wait(rpc_id, RPC_TIMEOUT_S)
        finally:
            self.fake.latency_s = 0.0
        expect(resp is not None, "the in-flight call was not answered after EOF%s" % self.client.exit_note())
        expect_success(resp)
        code = self.client.wait_exit(10.0)
        expect(code is not None, "server still running 10 s after stdin EOF")
        expect(code == 0, "exit code %s after EOF, expected 0" % code)

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
    fake = FakeTavily().start()
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
        fake.stop()
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

    def fresh_query(self, prefix):
        self._serial += 1
        return "%s %d" % (prefix, self._serial)

    def server(self, threaded, **env):
        self.fake.latency_s = 0.0
        return start_server(offline_env(self.fake.url, **env), server_path=self.server_path,
                            threaded=threaded, lifetime_s=BENCH_PHASE_LIFETIME_S)

    # -- start-up, idle RSS ------------------------------------------------------------------

    def startup(self):
        with open(self.server_path, "rb") as f:
            source = f.read()
        compile_ms = []
        for _ in range(STARTUP_RUNS):
            t0 = time.perf_counter()
            compile(source, self.server_path, "exec", dont_inherit=True)
            compile_ms.append((time.perf_counter() - t0) * 1000)

        baseline_ms, spawn_ms, module_ms = [], [], []
        env = offline_env(self.fake.url)
        script_argv = [sys.executable, self.server_path]
        baseline_argv = [sys.executable, "-c", "import json, threading"]
        # `python -m` with cached bytecode, from a private copy so no .pyc lands in the repo.
        # (PYTHONPYCACHEPREFIX would do that too, but it also moves the stdlib's cache.)
        module_dir = _TempDir("smoke-module-")
        try:
            module_argv, module_env = _module_launch(self.server_path, module_dir.path, env)
            for _ in range(STARTUP_RUNS):  # interleaved, so drift hits all three alike
                baseline_ms.append(_time_run(baseline_argv, env))
                spawn_ms.append(_time_init(script_argv, env))
                module_ms.append(_time_init(module_argv, module_env, module_dir.path))
            idle = _idle_rss_kb(script_argv, env)
            module_idle = _idle_rss_kb(module_argv, module_env, module_dir.path)
        finally:
            module_dir.remove()
        spawn, base, comp = _median(spawn_ms), _median(baseline_ms), _median(compile_ms)
        budget = base + comp + 10.0
        self.row("python -c 'import json, threading'", "%.1f ms" % base)
        self.row("compile(websearch_ring.py)", "%.1f ms" % comp)
        self.row("spawn -> initialize answered", "%.1f ms" % spawn, "<= %.1f ms (base+compile+10)" % budget,
                 _verdict(spawn <= budget))
        # No target: DESIGN sets none, and runpy alone costs ~18 ms on Python 3.9.
        self.row("  same via python -m (cached .pyc, no compile)", "%.1f ms" % _median(module_ms))
        self.row("idle RSS", _mb(idle), "< 20 MB", "" if idle is None else _verdict(idle < 20 * 1024))
        self.row("  same via python -m (cached .pyc, no compile)", _mb(module_idle))
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
                resps = _fan_out(client, queries, timeout_s=60.0)
                elapsed = time.perf_counter() - t0
                ratios.append(elapsed / ideal_s)
                peaks.append(self.fake.max_active)
                problems.append(sum(1 for r in resps if r is None or _is_tool_error(r)))
            self.fake.latency_s = 0.2  # the leader stays in flight while 49 followers arrive
            for _ in range(COALESCE_ROUNDS):
                query = self.fresh_query("bench coalesce")
                resps = _fan_out(client, [query] * COALESCE_CALLS, timeout_s=30.0)
                hits_per_round.append(self.fake.hits_for(query))
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
                failures += sum(1 for r in _fan_out(client, batch, timeout_s=30.0) if r is None or _is_tool_error(r))
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


def _module_launch(server_path, directory, env):
    """Copy the server into directory, byte-compile it there; return (argv, env) for `-m`."""
    import py_compile
    name = os.path.splitext(os.path.basename(server_path))[0]
    copy = os.path.join(directory, name + ".py")
    shutil.copyfile(server_path, copy)
    py_compile.compile(copy, doraise=True)
    return [sys.executable, "-m", name], dict(env, PYTHONPATH=directory)


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


def _fan_out(client, queries, timeout_s):
    """Send one web_search per query at once; return the responses in order (None if missing)."""
    ids = [client.request("tools/call", search_params(q)) for q in queries]
    deadline = time.monotonic() + timeout_s
    return [client.wait(i, max(0.0, deadline - time.monotonic())) for i in ids]


def _is_tool_error(resp):
    return "result" not in resp or bool(resp["result"].get("isError"))


def _verdict(ok):
    return "ok" if ok else "MISS"


def print_table(rows):
    headers = ("metric", "value", "target", "")
    widths = [max(len(str(r[i])) for r in list(rows) + [headers]) for i in range(4)]
    line = "  ".join("%-*s" % (w, h) for w, h in zip(widths, headers)).rstrip()
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join("%-*s" % (w, c) for w, c in zip(widths, r)).rstrip())


def run_bench(server_path):
    """--bench: measure every figure, print a table; exit 1 only if a measurement broke."""
    if not os.path.isfile(server_path):
        print("FAIL server present: %s not found" % server_path)
        return 1
    fake = FakeTavily().start()
    bench = Bench(server_path, fake)
    broken = []
    try:
        for name, phase in (("start-up", bench.startup), ("latency", bench.latency),
                            ("concurrency", bench.concurrency), ("memory growth", bench.growth)):
            print("bench: %s ..." % name, file=sys.stderr, flush=True)
            try:
                phase()
            except Exception as exc:  # report and go on: the other figures are still worth having
                broken.append(name)
                bench.row("%s phase" % name, "ERROR %s: %s" % (type(exc).__name__, _short(str(exc), 120)))
    finally:
        fake.stop()
    print("python %s on %s; medians of several runs" % (sys.version.split()[0], sys.platform))
    print_table(bench.rows)
    return 1 if broken else 0


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

def main(argv=None):
    parser = argparse.ArgumentParser(description="Smoke test and benchmarks for websearch_ring.py.")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--offline", action="store_true", help="protocol checks against a loopback fake")
    mode.add_argument("--bench", action="store_true", help="performance figures against a loopback fake")
    parser.add_argument("--server", default=SERVER_PATH, help="path of websearch_ring.py (default: next to this file)")
    parser.add_argument("query", nargs="?", help="run one real web_search with the default configuration")
    args = parser.parse_args(argv)
    server_path = os.path.abspath(args.server)
    if args.offline:
        return run_offline(server_path)
    if args.bench:
        return run_bench(server_path)
    if args.query:
        return run_query(server_path, args.query)
    parser.print_usage()
    return 2


if __name__ == "__main__":
    sys.exit(main())
