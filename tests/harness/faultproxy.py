"""A fault-injecting HTTP proxy in front of an S3 store, for sluice's fault tests.

    faultproxy.py --port 3911 --upstream 127.0.0.1:3900 --control /run/sluice-test/faultproxy.ctl
                  [--stats FILE] [--max-lifetime SECONDS]

Requests are forwarded byte for byte: request line, headers (SigV4 signs the Host header the client
used, and the store checks it against what it receives) and body go upstream unchanged, and the
store's response comes back unchanged. Only whole requests are answered by the proxy itself, so a
client always sees a well-formed HTTP reply or a refused/reset connection, never a torn one.

The control file holds one mode (re-read whenever it changes; a missing file means `pass`):

    pass            forward everything
    503             answer every request 503 SlowDown (S3's throttling reply) without forwarding it
    429             answer every request 429 TooManyRequests
    refuse          stop listening (new connections are refused) and reset open connections
    slow=SECONDS    forward, but hold each response back SECONDS before passing it on
    fail-after=N    forward N requests (counted from when this mode was set), then answer 503
    exit            shut down

The stats file (JSON, rewritten after every request) counts what happened, so a test can prove the
client really met the faults: {"mode", "requests", "forwarded", "injected": {"503": n, "429": n},
"reset": n (connections reset by `refuse`), "mode_changes": [[unix time, mode], ...]}.

Bounded: binds loopback only, forwards to loopback only, and exits by itself after --max-lifetime
seconds (default 1800) or on SIGTERM/SIGINT. Python standard library only.
"""

import argparse
import json
import os
import signal
import socket
import struct
import sys
import threading
import time

IO_TICK = 0.2  # how often blocked reads look at the mode (to reset connections promptly)
IDLE_TIMEOUT = 300.0  # a client connection idle this long is closed
UPSTREAM_CONNECT_TIMEOUT = 5.0
MAX_HEAD = 64 * 1024
CHUNK = 256 * 1024


class Aborted(Exception):
    """The connection must go now (refuse mode, shutdown, or the peer went away)."""


def log(msg):
    print(f"{time.strftime('%H:%M:%S')} faultproxy: {msg}", file=sys.stderr, flush=True)


class Control:
    """The current mode, from the control file, plus the counters."""

    def __init__(self, path, stats_path):
        self.path = path
        self.stats_path = stats_path
        self.lock = threading.Lock()
        self.sig = None
        self.mode = "pass"
        self.arg = None
        self.since_mode = 0  # requests seen since the mode was set (for fail-after)
        self.stats = {
            "mode": "pass",
            "requests": 0,
            "forwarded": 0,
            "injected": {"503": 0, "429": 0},
            "reset": 0,
            "mode_changes": [],
        }

    def refresh(self):
        """Re-reads the control file if it changed. Returns the mode."""
        try:
            st = os.stat(self.path)
            sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            sig = None
        with self.lock:
            if sig == self.sig:
                return self.mode
            self.sig = sig
            text = "pass"
            if sig is not None:
                try:
                    with open(self.path, encoding="utf-8") as f:
                        text = f.read().strip() or "pass"
                except OSError:
                    return self.mode
            mode, arg = parse_mode(text)
            if mode is None:
                log(f"ignoring unknown mode {text!r} in {self.path}")
                return self.mode
            if (mode, arg) != (self.mode, self.arg):
                self.mode, self.arg, self.since_mode = mode, arg, 0
                self.stats["mode"] = text
                self.stats["mode_changes"].append([round(time.time(), 3), text])
                log(f"mode {text}")
                self._write_stats()
            return self.mode

    def decide(self):
        """The fault for the next request: None (forward), '503' or '429'; counts it."""
        self.refresh()
        with self.lock:
            self.stats["requests"] += 1
            self.since_mode += 1
            fault = None
            if self.mode in ("503", "429"):
                fault = self.mode
            elif self.mode == "fail-after" and self.since_mode > self.arg:
                fault = "503"
            if fault:
                self.stats["injected"][fault] += 1
            else:
                self.stats["forwarded"] += 1
            self._write_stats()
            return fault

    def delay(self):
        with self.lock:
            return self.arg if self.mode == "slow" else 0.0

    def count_reset(self):
        with self.lock:
            self.stats["reset"] += 1
            self._write_stats()

    def _write_stats(self):
        if not self.stats_path:
            return
        tmp = f"{self.stats_path}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.stats, f)
            os.replace(tmp, self.stats_path)
        except OSError as e:
            log(f"cannot write {self.stats_path}: {e}")


def parse_mode(text):
    if text in ("pass", "503", "429", "refuse", "exit"):
        return text, None
    key, _, value = text.partition("=")
    try:
        if key == "slow":
            v = float(value)
            if 0 <= v <= 3600:
                return "slow", v
        if key == "fail-after":
            v = int(value)
            if v >= 0:
                return "fail-after", v
    except ValueError:
        pass
    return None, None


class Reader:
    """Buffered reads from a socket that give up when `abort()` says so or after IDLE_TIMEOUT."""

    def __init__(self, sock, abort):
        self.sock = sock
        self.abort = abort
        self.buf = b""
        sock.settimeout(IO_TICK)

    def _fill(self):
        idle_since = time.monotonic()
        while True:
            if self.abort():
                raise Aborted()
            try:
                data = self.sock.recv(CHUNK)
            except socket.timeout:
                if time.monotonic() - idle_since > IDLE_TIMEOUT:
                    raise Aborted()
                continue
            except OSError as e:
                raise Aborted() from e
            if not data:
                raise EOFError()
            self.buf += data
            return

    def until(self, sep):
        """Bytes up to and including `sep`; aborts past MAX_HEAD bytes without it."""
        while sep not in self.buf:
            if len(self.buf) > MAX_HEAD:
                raise Aborted()
            self._fill()
        end = self.buf.index(sep) + len(sep)
        out, self.buf = self.buf[:end], self.buf[end:]
        return out

    def head(self):
        """Bytes up to and including the blank line ending a message head."""
        return self.until(b"\r\n\r\n")

    def line(self):
        return self.until(b"\r\n")

    def some(self, limit):
        if not self.buf:
            self._fill()
        out, self.buf = self.buf[:limit], self.buf[limit:]
        return out

    def body(self, headers, sink, until_close=False):
        """Passes a message body to `sink` (bytes -> None) exactly as it was framed."""
        te = headers.get("transfer-encoding", "").lower()
        if "chunked" in te:
            while True:
                size_line = self.line()
                sink(size_line)
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    while True:  # trailers, then the blank line
                        t = self.line()
                        sink(t)
                        if t == b"\r\n":
                            return
                left = size + 2  # data and its CRLF
                while left:
                    d = self.some(min(left, CHUNK))
                    sink(d)
                    left -= len(d)
        elif "content-length" in headers:
            left = int(headers["content-length"])
            while left:
                d = self.some(min(left, CHUNK))
                sink(d)
                left -= len(d)
        elif until_close:
            while True:
                try:
                    d = self.some(CHUNK)
                except EOFError:
                    return
                sink(d)


def parse_head(raw):
    lines = raw.decode("latin-1").split("\r\n")
    first = lines[0]
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return first, headers


def s3_error(status, code, message):
    reason = {503: "Service Unavailable", 429: "Too Many Requests"}[status]
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<RequestId>faultproxy-{time.time_ns()}</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Retry-After: 1\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    return head + body


FAULT_REPLIES = {
    "503": lambda: s3_error(503, "SlowDown", "Please reduce your request rate."),
    "429": lambda: s3_error(429, "TooManyRequests", "Too many requests, slow down."),
}


class Proxy:
    def __init__(self, port, upstream, control, deadline):
        self.port = port
        self.upstream = upstream
        self.control = control
        self.deadline = deadline
        self.stopping = threading.Event()
        self.listener = None
        self.conns = set()
        self.conns_lock = threading.Lock()

    def must_abort(self):
        return self.stopping.is_set() or self.control.mode == "refuse"

    def listen(self):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(128)
        s.settimeout(IO_TICK)
        self.listener = s
        log(f"listening on 127.0.0.1:{self.port}, forwarding to {self.upstream[0]}:{self.upstream[1]}")

    def run(self):
        self.listen()
        while not self.stopping.is_set():
            mode = self.control.refresh()
            if mode == "exit" or time.monotonic() > self.deadline:
                log("exiting" if mode == "exit" else "max lifetime reached; exiting")
                break
            if mode == "refuse":
                if self.listener is not None:
                    self.listener.close()
                    self.listener = None
                    log("listening socket closed (refuse)")
                time.sleep(IO_TICK)
                continue
            if self.listener is None:
                try:
                    self.listen()
                except OSError as e:
                    log(f"cannot listen again yet: {e}")
                    time.sleep(IO_TICK)
                    continue
            try:
                client, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                continue
            t = threading.Thread(target=self.serve, args=(client,), daemon=True)
            t.start()
        self.stopping.set()
        if self.listener is not None:
            self.listener.close()

    def reset(self, sock):
        """Closes with RST, as a crashed or firewalled server would look."""
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        sock.close()

    def serve(self, client):
        upstream = None
        try:
            reader = Reader(client, self.must_abort)
            while True:
                try:
                    raw = reader.head()
                except EOFError:
                    return
                first, headers = parse_head(raw)
                method = first.split(" ", 1)[0]
                fault = self.control.decide()
                if fault:
                    # Take the whole request first, so the client reads our reply, not a reset.
                    if headers.get("expect", "").lower() != "100-continue":
                        reader.body(headers, lambda _d: None)
                    client.sendall(FAULT_REPLIES[fault]())
                    log(f"{first.rsplit(' ', 1)[0]} -> injected {fault}")
                    return
                # A fresh upstream connection per request: a kept-alive one the store closed while
                # idle would turn into a torn reply here.
                upstream = socket.create_connection(self.upstream, timeout=UPSTREAM_CONNECT_TIMEOUT)
                up_reader = Reader(upstream, self.must_abort)
                upstream.sendall(raw)
                if headers.get("expect", "").lower() == "100-continue":
                    resp = up_reader.head()
                    status = int(resp.split(b" ", 2)[1])
                    client.sendall(resp)
                    if status != 100:
                        _, rh = parse_head(resp)
                        up_reader.body(rh, client.sendall, until_close="content-length" not in rh)
                        return
                reader.body(headers, upstream.sendall)
                while True:
                    resp = up_reader.head()
                    status = int(resp.split(b" ", 2)[1])
                    if status >= 200 or status == 101:
                        break
                    client.sendall(resp)  # 1xx interim reply
                delay = self.control.delay()
                if delay:
                    end = time.monotonic() + delay
                    while time.monotonic() < end:
                        if self.must_abort():
                            raise Aborted()
                        time.sleep(min(IO_TICK, end - time.monotonic()))
                client.sendall(resp)
                _, rh = parse_head(resp)
                no_body = method == "HEAD" or status in (204, 304)
                close = "close" in rh.get("connection", "").lower()
                if not no_body:
                    framed = "content-length" in rh or "chunked" in rh.get("transfer-encoding", "").lower()
                    up_reader.body(rh, client.sendall, until_close=not framed)
                    close = close or not framed
                upstream.close()
                upstream = None
                if close:
                    return
        except Aborted:
            if self.control.mode == "refuse":
                self.control.count_reset()
                self.reset(client)
                client = None
        except (EOFError, OSError, ValueError, IndexError) as e:
            log(f"connection ended: {e!r}")
        finally:
            if upstream is not None:
                upstream.close()
            if client is not None:
                client.close()


def loopback(host):
    try:
        return socket.inet_aton(socket.gethostbyname(host))[0] == 127
    except OSError:
        return False


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    p.add_argument("--control", required=True)
    p.add_argument("--stats")
    p.add_argument("--max-lifetime", type=float, default=1800.0)
    a = p.parse_args()
    host, _, port = a.upstream.rpartition(":")
    if not loopback(host):
        p.error(f"--upstream {a.upstream}: only loopback upstreams are allowed")
    control = Control(a.control, a.stats)
    control.refresh()
    control._write_stats()
    proxy = Proxy(a.port, (host, int(port)), control, time.monotonic() + a.max_lifetime)

    def stop(_sig, _frame):
        proxy.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    proxy.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
