"""How the peer tier's copies travel between a rank and the nodes' holders: :class:`PeerTransport`.

Four operations, each addressed to one holder (``at``: its address), and :meth:`~PeerTransport.close`:

* :meth:`~PeerTransport.send`: a committed copy's files, then its manifest (the copy becomes
  visible only then);
* :meth:`~PeerTransport.inventory`: the sealed copies a holder offers;
* :meth:`~PeerTransport.fetch`: one file of a sealed copy, written to a binary file;
* :meth:`~PeerTransport.drop`: forget a copy (a reader found a bad byte in it).

Every failure is a :class:`~..storage.peer.PeerError` (an ``OSError``): a request that failed,
which says nothing about the copy's bytes. A transport is not thread-safe: one per thread
(:data:`TransportFactory` makes them). :class:`TcpTransport` is the holders' authenticated TCP
(:mod:`..storage.peer`); another transport implements the same four operations.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..storage.peer import SOCKET_TIMEOUT_SECONDS, Client


@dataclass(frozen=True)
class CopyId:
    """One source rank's copy of one step: ``(epoch, step, source rank, world size)``."""

    epoch: str
    step: int
    src: int
    world: int


@dataclass(frozen=True)
class Outgoing:
    """A file of a copy to send: ``size`` and ``xxh3`` as the holder will check them; its bytes
    are ``data`` when given, else the file at ``path`` (read in pieces)."""

    name: str
    size: int
    xxh3: int
    path: str = ""
    data: bytes | None = None


class Sink(Protocol):
    """Where :meth:`PeerTransport.fetch` writes: a binary file (or one that hashes as it writes)."""

    def write(self, data: bytes) -> Any: ...


class PeerTransport(ABC):
    """The peer tier's transport (see the module docstring). Not thread-safe: one per thread."""

    @abstractmethod
    def send(
        self,
        at: str,
        copy: CopyId,
        files: Sequence[Outgoing],
        manifest: bytes,
        *,
        stop: Callable[[], bool],
        sent: Callable[[int], None],
    ) -> bool:
        """Send ``files`` in order, then seal the copy with ``manifest`` (its raw bytes). ``stop()``
        true between pieces abandons it (returns False, nothing sealed); ``sent(n)`` is told each
        file's bytes once they went. True: the copy is sealed at ``at``. Raises PeerError."""

    @abstractmethod
    def inventory(self, at: str) -> list[dict[str, Any]]:
        """The sealed copies ``at`` offers: ``{epoch, step, src, world, manifest}`` each (the
        manifest as text, unchecked). Raises PeerError (or ValueError: an unreadable answer)."""

    @abstractmethod
    def fetch(self, at: str, copy: CopyId, name: str, out: Sink) -> int:
        """``copy``'s file ``name``, written to ``out``; the bytes written. Raises PeerError."""

    @abstractmethod
    def drop(self, at: str, copy: CopyId) -> None:
        """``at`` forgets ``copy``. Raises PeerError."""

    def close(self) -> None:  # noqa: B027 - a transport without connections has nothing to close
        """Release its connections; a later call opens them again."""


TransportFactory = Callable[[float], PeerTransport]
"""A new transport whose every request times out after the given seconds."""


class TcpTransport(PeerTransport):
    """The holders' authenticated TCP (:class:`..storage.peer.Client`), one connection per holder."""

    def __init__(self, job: str, key: bytes, *, timeout: float = SOCKET_TIMEOUT_SECONDS):
        self.job, self.key, self.timeout = job, key, timeout
        self._clients: dict[str, Client] = {}

    @classmethod
    def factory(cls, job: str, key: bytes) -> TransportFactory:
        return lambda timeout: cls(job, key, timeout=timeout)

    def _client(self, at: str) -> Client:
        client = self._clients.get(at)
        if client is None:
            client = self._clients[at] = Client(at, self.job, self.key, timeout=self.timeout)
        return client

    def send(self, at, copy, files, manifest, *, stop, sent) -> bool:
        client = self._client(at)
        where = (copy.epoch, copy.step, copy.src, copy.world)
        for f in files:
            if stop():
                return False
            if f.data is not None:
                client.put(*where, f.name, f.data)
                n = len(f.data)
            else:
                n = client.put_file(*where, f.name, f.path, stop)
            if n < 0:
                return False
            sent(n)
        client.seal(*where, [[f.name, f.size, f.xxh3] for f in files], manifest)
        return True

    def inventory(self, at: str) -> list[dict[str, Any]]:
        return self._client(at).inventory()

    def fetch(self, at: str, copy: CopyId, name: str, out: Sink) -> int:
        n = self._client(at).get(copy.epoch, copy.step, copy.src, copy.world, name, out=out)
        assert isinstance(n, int)  # given ``out``, the bytes written
        return n

    def drop(self, at: str, copy: CopyId) -> None:
        self._client(at).drop(copy.epoch, copy.step, copy.src, copy.world)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
