"""Peer holders: node-side memory that keeps other nodes' checkpoint copies, over authenticated TCP.

A :class:`Holder` is a small TCP server, a thread of the node's supervisor (so it outlives worker
restarts), that listens only on the address the job uses for its collectives, on an ephemeral
port. It keeps the files other nodes' ranks replicate to it, in memory, keyed by
``(epoch, step, source rank, world size, file name)``, and answers five operations:

* ``PUT``: a piece of one file (at ``offset``: 0 starts the file, else it continues it) with the
  piece's XXH3, checked on receipt (a mismatch is refused, never kept);
* ``SEAL``: the source rank's manifest and its list of ``(name, size, xxh3)``; the copy becomes
  visible only when every listed file is present with that size and whole-file checksum;
* ``INVENTORY``: the sealed copies (epoch, step, source rank, world size, manifest);
* ``GET``: a piece of one file of a sealed copy;
* ``DROP``: forget a copy (a reader found a bad byte in it).

A holder may also serve copies it does not keep in memory (its node's own local-tier copies on
disk) through ``served``, an object with ``inventory()``, ``read(epoch, step, src, world, name)``
and ``drop(epoch, step, src, world)``.

**Authentication.** Every request carries a header ``{op, job, nonce, ts, args, body}`` (``body``:
the SHA-256 of the request's payload) and an HMAC-SHA256 of that header under the job's
checkpoint key (``ELASTIC_TRAINER_CHECKPOINT_KEY``). A bad MAC, a timestamp more than
:data:`MAX_SKEW_SECONDS` away, a nonce seen before, or a ``job`` other than the holder's: nothing is
answered and the connection is closed. The MAC is checked before a payload is read, so an
unauthenticated caller cannot make a holder allocate anything. Without a key there is no holder
(peer transfer is off). Replies are not signed: every byte a reader takes is checked against
the source rank's signed manifest.

**Memory bound.** Per source rank, the :data:`KEEP` newest sealed steps; a step's unsealed files
are dropped once a newer step of that source is sealed or started; a world size's copies once a
source of another world size has :data:`KEEP` newer steps sealed (after a reshard), and everything
of another launch epoch whenever a copy is sealed (a holder serves one launch). A holder
therefore keeps at most ``KEEP`` steps (plus the one being received, and for a few saves after a
reshard the old world size's) of the ranks that replicate to it: about ``KEEP`` x the state bytes
of the nodes it holds for.

Frames: ``>IQ`` (header length, payload length), the JSON header, the payload. Every socket has a
timeout.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
import os
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import xxhash

logger = logging.getLogger(__name__)

KEEP = 2  # sealed steps per source rank
MAX_SKEW_SECONDS = 60.0  # a request's timestamp may be this far from the holder's clock
MAX_HEADER = 1 << 20
MAX_BODY = 1 << 30  # a frame's payload: a sanity bound (pieces are CHUNK; an inventory is manifests)
SOCKET_TIMEOUT_SECONDS = 30.0
CHUNK = 64 << 20  # bytes per PUT/GET: a file of any size travels with this much memory per side
_FRAME = struct.Struct(">IQ")
OPS = ("PUT", "SEAL", "INVENTORY", "GET", "DROP")

CopyKey = tuple[str, int, int, int]  # (epoch, step, source rank, world size)


class PeerError(OSError):
    """A holder refused a request, or could not be reached."""


class Served(Protocol):
    """Copies a holder serves without keeping them in memory (its node's own, on disk)."""

    def inventory(self) -> list[dict[str, Any]]: ...

    def read(self, epoch: str, step: int, src: int, world: int, name: str, offset: int, length: int):
        """``(the bytes at offset, at most length of them; the file's size)``, or None."""

    def drop(self, epoch: str, step: int, src: int, world: int) -> None: ...


def xxh3(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def _mac(key: bytes, header: dict[str, Any]) -> str:
    body = json.dumps({k: v for k, v in header.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return bytes(buf)


def _send(sock: socket.socket, header: dict[str, Any], body: bytes = b"") -> None:
    h = json.dumps(header, separators=(",", ":")).encode()
    head = _FRAME.pack(len(h), len(body)) + h
    if len(body) <= 1 << 20:
        sock.sendall(head + body)
    else:  # no copy of a large file
        sock.sendall(head)
        sock.sendall(body)


def _recv_header(sock: socket.socket) -> tuple[dict[str, Any], int]:
    hlen, blen = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if hlen > MAX_HEADER or blen > MAX_BODY:
        raise ConnectionError(f"a frame of {hlen} + {blen} bytes")
    header = json.loads(_recv_exact(sock, hlen))
    if not isinstance(header, dict):
        raise ConnectionError("header is not an object")
    return header, blen


# ------------------------------------------------------------------------------------ holder
@dataclass
class _File:
    data: bytearray = field(default_factory=bytearray)
    hasher: Any = field(default_factory=xxhash.xxh3_64)  # of the whole file, as received


@dataclass
class _Copy:
    files: dict[str, _File] = field(default_factory=dict)
    manifest: bytes | None = None  # set when sealed

    @property
    def sealed(self) -> bool:
        return self.manifest is not None

    @property
    def nbytes(self) -> int:
        return sum(len(f.data) for f in self.files.values())


class Holder:
    """The node's holder: ``start()`` it, pass :attr:`address` to the workers, ``close()`` it.

    ``job``: the job's name (a request for another job gets nothing); ``key``: the checkpoint key
    (required); ``host``: the address the job uses for its collectives (never 0.0.0.0)."""

    def __init__(self, job: str, key: bytes, host: str, *, served: Served | None = None, clock=time.time):
        if not key:
            raise ValueError("a peer holder needs the checkpoint key")
        if host in ("", "0.0.0.0", "::"):
            raise ValueError("a peer holder listens on the address the job uses, never on every interface")
        self.job = job
        self.key = key
        self.host = host
        self.served = served
        self.clock = clock
        self._lock = threading.Lock()
        self._copies: dict[CopyKey, _Copy] = {}
        self._nonces: dict[str, float] = {}
        self.refused = 0  # requests refused (authentication or job): a test and a log line see them
        self.answered: collections.Counter = collections.Counter()  # (op, file, offset) -> requests answered
        self._logged_at: float | None = None
        self._server: socketserver.ThreadingTCPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        assert self._server is not None, "the holder is not started"
        host, port = self._server.server_address[:2]  # getsockname(): a str host
        return f"{host!s}:{port}"

    def start(self) -> Holder:
        holder = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                holder._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((self.host, 0), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.1,), name="et-peer-holder", daemon=True
        )
        self._thread.start()
        logger.info("peer holder listening on %s", self.address)
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # -------------------------------------------------------------------- serving
    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(SOCKET_TIMEOUT_SECONDS)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                try:
                    header, blen = _recv_header(sock)
                except (ConnectionError, OSError, ValueError):
                    return
                why = self._refusal(header)
                body = _recv_exact(sock, blen) if blen and why is None else b""
                if why is None and not hmac.compare_digest(hashlib.sha256(body).hexdigest(), str(header.get("body"))):
                    why = "payload does not match its header"
                if why is not None:
                    self._refused(why)
                    return
                try:
                    reply, out = self._handle(header["op"], header.get("args") or {}, body)
                except (KeyError, TypeError, ValueError) as e:
                    reply, out = {"ok": False, "error": f"bad request: {type(e).__name__}: {e}"}, b""
                _send(sock, reply, out)
        except (ConnectionError, OSError) as e:
            logger.debug("peer holder: connection ended: %s", e)
        finally:
            sock.close()

    def _refused(self, why: str) -> None:
        """Count a refusal; log it (at most one line per :data:`MAX_SKEW_SECONDS`: a caller
        hammering the port does not flood the log)."""
        now = self.clock()
        with self._lock:
            self.refused += 1
            count = self.refused
            quiet = self._logged_at is not None and now - self._logged_at < MAX_SKEW_SECONDS
            if not quiet:
                self._logged_at = now
        if not quiet:
            logger.warning("peer holder: refused a request (%s; %d refused so far); connection closed", why, count)

    def _refusal(self, header: dict[str, Any]) -> str | None:
        mac = header.get("mac")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(self.key, header)):
            return "bad MAC"
        if header.get("op") not in OPS:
            return "unknown operation"
        now = self.clock()
        ts = header.get("ts")
        if not isinstance(ts, int | float) or abs(now - ts) > MAX_SKEW_SECONDS:
            return "stale timestamp"
        nonce = str(header.get("nonce", ""))
        with self._lock:
            for n in [n for n, t in self._nonces.items() if now - t > 2 * MAX_SKEW_SECONDS]:
                del self._nonces[n]
            if not nonce or nonce in self._nonces:
                return "replayed nonce"
            self._nonces[nonce] = now
        if header.get("job") != self.job:
            return "another job's request"
        return None

    def _handle(self, op: str, a: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        with self._lock:
            self.answered[op, str(a.get("name", "")), int(a.get("offset", 0))] += 1
        if op == "INVENTORY":
            return {"ok": True}, json.dumps(self.inventory()).encode()
        key: CopyKey = (str(a["epoch"]), int(a["step"]), int(a["src"]), int(a["world"]))
        if op == "PUT":
            return self._put(key, str(a["name"]), int(a.get("offset", 0)), int(a["xxh3"]), body), b""
        if op == "SEAL":
            return self._seal(key, [(str(n), int(s), int(h)) for n, s, h in a["files"]], body), b""
        if op == "GET":
            got = self.read(*key, str(a["name"]), int(a.get("offset", 0)), min(int(a.get("length", CHUNK)), CHUNK))
            if got is None:
                return {"ok": False, "error": "no such file"}, b""
            return {"ok": True, "size": got[1]}, got[0]
        self.drop(*key)  # DROP
        return {"ok": True}, b""

    def _put(self, key: CopyKey, name: str, offset: int, want: int, data: bytes) -> dict[str, Any]:
        if xxh3(data) != want:
            return {"ok": False, "error": f"{name}: checksum mismatch on receipt"}
        epoch, step, src, world = key
        with self._lock:
            for k in [k for k, c in self._copies.items() if k[0] == epoch and k[2:] == key[2:] and k[1] < step]:
                if not self._copies[k].sealed:
                    del self._copies[k]  # superseded by a newer step of the same source
            c = self._copies.get(key)
            if c is None or (c.sealed and offset == 0):  # a new save of a step held (after a rollback) replaces it
                c = self._copies[key] = _Copy()
            if offset == 0:
                c.files[name] = _File()
            f = c.files.get(name)
            if c.sealed or f is None or len(f.data) != offset:
                return {"ok": False, "error": f"{name}: a piece at {offset} continues nothing"}
            f.data += data
            f.hasher.update(data)
        return {"ok": True}

    def _seal(self, key: CopyKey, listed: list[tuple[str, int, int]], manifest: bytes) -> dict[str, Any]:
        with self._lock:
            c = self._copies.get(key)
            if c is None:
                return {"ok": False, "error": "no files received for this copy"}
            for name, size, h in listed:
                got = c.files.get(name)
                if got is None or len(got.data) != size or got.hasher.intdigest() != h:
                    return {"ok": False, "error": f"{name}: missing or not as listed"}
            c.files = {n: c.files[n] for n, _, _ in listed}
            c.manifest = manifest
            self._retain(key)
        return {"ok": True}

    def _retain(self, sealed: CopyKey) -> None:
        """Under the lock, after ``sealed`` was sealed: see the module docstring's memory bound."""
        epoch, step, src, world = sealed
        mine = sorted((k[1] for k, c in self._copies.items() if k[0] == epoch and k[2:] == (src, world) and c.sealed))
        keep_from, full = (mine[-KEEP], True) if len(mine) >= KEEP else (mine[0], False)
        for k in list(self._copies):
            # another launch's copies; this source's older steps; once it has KEEP at this world
            # size, another world size's older steps (until then, they may be the newest complete step)
            if k[0] != epoch or (k[1] < keep_from and (k[2:] == (src, world) or (full and k[3] != world))):
                del self._copies[k]

    def inventory(self) -> list[dict[str, Any]]:
        with self._lock:
            out = [
                {"epoch": k[0], "step": k[1], "src": k[2], "world": k[3], "manifest": c.manifest.decode()}
                for k, c in sorted(self._copies.items())
                if c.manifest is not None  # sealed
            ]
        if self.served is not None:
            out += self.served.inventory()
        return out

    def read(
        self, epoch: str, step: int, src: int, world: int, name: str, offset: int = 0, length: int = CHUNK
    ) -> tuple[bytes, int] | None:
        """``(the bytes at offset, at most length of them; the file's size)`` of a sealed copy, or None."""
        with self._lock:
            c = self._copies.get((epoch, step, src, world))
            if c is not None and c.sealed and name in c.files:
                data = c.files[name].data
                return bytes(data[offset : offset + length]), len(data)
        return self.served.read(epoch, step, src, world, name, offset, length) if self.served is not None else None

    def drop(self, epoch: str, step: int, src: int, world: int) -> None:
        with self._lock:
            self._copies.pop((epoch, step, src, world), None)
        if self.served is not None:
            self.served.drop(epoch, step, src, world)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(c.nbytes for c in self._copies.values())


# ------------------------------------------------------------------------------------ client
class Client:
    """One connection to a holder (reopened when it breaks). Not thread-safe: one per thread."""

    def __init__(self, address: str, job: str, key: bytes, *, timeout: float = SOCKET_TIMEOUT_SECONDS):
        host, _, port = address.rpartition(":")
        self.address = address
        self._addr = (host, int(port))
        self.job = job
        self.key = key
        self.timeout = timeout
        self._sock: socket.socket | None = None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def request(self, op: str, args: dict[str, Any] | None = None, body: bytes = b"") -> tuple[dict[str, Any], bytes]:
        """Send one request; the reply's header and payload. Raises PeerError."""
        header = {
            "op": op,
            "job": self.job,
            "nonce": os.urandom(16).hex(),
            "ts": time.time(),
            "args": args or {},
            "body": hashlib.sha256(body).hexdigest(),
        }
        header["mac"] = _mac(self.key, header)
        try:
            if self._sock is None:
                self._sock = socket.create_connection(self._addr, timeout=self.timeout)
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _send(self._sock, header, body)
            reply, blen = _recv_header(self._sock)
            data = _recv_exact(self._sock, blen) if blen else b""
        except (OSError, ValueError) as e:
            self.close()
            raise PeerError(f"peer holder {self.address}: {type(e).__name__}: {e}") from e
        if not reply.get("ok"):
            raise PeerError(f"peer holder {self.address}: {reply.get('error', 'refused')}")
        return reply, data

    def put(self, epoch: str, step: int, src: int, world: int, name: str, data: bytes, offset: int = 0) -> None:
        """One piece of a file (offset 0 starts it); see :meth:`put_file` for a whole file."""
        args = {"epoch": epoch, "step": step, "src": src, "world": world, "name": name, "offset": offset}
        self.request("PUT", {**args, "xxh3": xxh3(data)}, data)

    def put_file(self, epoch: str, step: int, src: int, world: int, name: str, path: str, stop=None) -> int:
        """Send the file at ``path`` in pieces of :data:`CHUNK`; the bytes sent. ``stop()`` true
        between pieces abandons it (returns -1)."""
        offset = 0
        with open(path, "rb") as f:
            while True:
                piece = f.read(CHUNK)
                if offset and not piece:
                    return offset
                if stop is not None and stop():
                    return -1
                self.put(epoch, step, src, world, name, piece, offset)
                offset += len(piece)
                if len(piece) < CHUNK:
                    return offset

    def seal(self, epoch: str, step: int, src: int, world: int, files: list, manifest: bytes) -> None:
        self.request("SEAL", {"epoch": epoch, "step": step, "src": src, "world": world, "files": files}, manifest)

    def inventory(self) -> list[dict[str, Any]]:
        return json.loads(self.request("INVENTORY")[1])

    def get(self, epoch: str, step: int, src: int, world: int, name: str, out=None) -> bytes | int:
        """A sealed copy's file: its bytes, or, given a binary file ``out``, written there in
        pieces of :data:`CHUNK` (returns the bytes written)."""
        args = {"epoch": epoch, "step": step, "src": src, "world": world, "name": name}
        parts, offset = [], 0
        while True:
            reply, piece = self.request("GET", {**args, "offset": offset, "length": CHUNK})
            if out is not None:
                out.write(piece)
            else:
                parts.append(piece)
            offset += len(piece)
            if offset >= int(reply.get("size", 0)) or not piece:
                return offset if out is not None else b"".join(parts)

    def drop(self, epoch: str, step: int, src: int, world: int) -> None:
        self.request("DROP", {"epoch": epoch, "step": step, "src": src, "world": world})
