"""A TCP proxy on 127.0.0.1 for network faults between two processes:
`forward` (pass bytes through), `delay` (every chunk held `delay_s` in each
direction, as a slow link), `blackhole` (nothing moves on any open or new
connection while the sockets stay open: no FIN, no RST, as a cut cable or
a dropped route looks to both ends). In `blackhole` the proxy stops reading
and accepting, so senders' windows fill as with unacknowledged segments and
a new connection completes its handshake in the listen backlog but is
answered nothing; back to `forward`, what was held flows on, as TCP
retransmits after a link comes back (if neither end gave up meanwhile)."""

from __future__ import annotations

import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

FORWARD, DELAY, BLACKHOLE = "forward", "delay", "blackhole"


@dataclass
class _Pair:
    a: socket.socket
    b: socket.socket
    # Chunks waiting for their release time: (due, destination, bytes).
    queue: list[tuple[float, socket.socket, bytes]] = field(default_factory=list)


class TcpProxy:
    """Listens on a free 127.0.0.1 port and connects each accepted client to
    `target_port`. One thread runs every connection (a selector loop), so
    the proxy adds no thread per connection; `stop()` closes everything."""

    def __init__(self, target_port: int, name: str = "proxy"):
        self.name = name
        self.target_port = target_port
        self.mode = FORWARD
        self.delay_s = 0.0
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(256)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._pairs: dict[socket.socket, _Pair] = {}
        self._stop = threading.Event()
        self.accepted = 0
        self._thread = threading.Thread(target=self._run, name=f"tcpproxy-{name}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, mode: str, delay_s: float = 0.0) -> None:
        assert mode in (FORWARD, DELAY, BLACKHOLE), mode
        with self._lock:
            self.mode, self.delay_s = mode, delay_s

    def connections(self) -> int:
        with self._lock:
            return len({id(p) for p in self._pairs.values()})

    def _accept(self) -> None:
        try:
            c, _ = self._listener.accept()
        except OSError:
            return
        try:
            u = socket.create_connection(("127.0.0.1", self.target_port), timeout=1.0)
        except OSError:
            c.close()
            return
        for s in (c, u):
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        p = _Pair(c, u)
        with self._lock:
            self._pairs[c] = p
            self._pairs[u] = p
            self.accepted += 1
        self._sel.register(c, selectors.EVENT_READ, p)
        self._sel.register(u, selectors.EVENT_READ, p)

    def _close(self, p: _Pair) -> None:
        with self._lock:
            self._pairs.pop(p.a, None)
            self._pairs.pop(p.b, None)
        for s in (p.a, p.b):
            try:
                self._sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()

    def _send(self, dst: socket.socket, data: bytes) -> bool:
        try:
            dst.setblocking(True)
            dst.settimeout(2.0)
            dst.sendall(data)
            dst.setblocking(False)
            return True
        except OSError:
            return False

    def _apply_mode(self, mode: str) -> None:
        """Stops (blackhole) or resumes reading every socket, the listener
        included; runs on the loop thread."""
        with self._lock:
            socks = [self._listener, *self._pairs.keys()]
        for s in socks:
            data = None if s is self._listener else self._pairs.get(s)
            try:
                if mode == BLACKHOLE:
                    self._sel.unregister(s)
                else:
                    self._sel.register(s, selectors.EVENT_READ, data)
            except (KeyError, ValueError, OSError):
                pass

    def _run(self) -> None:
        applied = FORWARD
        while not self._stop.is_set():
            with self._lock:
                mode = self.mode
            if (mode == BLACKHOLE) != (applied == BLACKHOLE):
                self._apply_mode(mode)
            applied = mode
            if mode == BLACKHOLE:
                time.sleep(0.01)
                continue
            now = time.monotonic()
            # Release delayed chunks that are due.
            with self._lock:
                pairs = list({id(p): p for p in self._pairs.values()}.values())
                mode = self.mode
            for p in pairs:
                while p.queue and p.queue[0][0] <= now:
                    _, dst, data = p.queue.pop(0)
                    if not self._send(dst, data):
                        self._close(p)
                        break
            for key, _ in self._sel.select(timeout=0.005):
                if key.data is None:
                    self._accept()
                    continue
                p: _Pair = key.data
                src = key.fileobj
                try:
                    data = src.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._close(p)
                    continue
                dst = p.b if src is p.a else p.a
                with self._lock:
                    mode, delay = self.mode, self.delay_s
                if mode == DELAY and delay > 0:
                    p.queue.append((time.monotonic() + delay, dst, data))
                elif p.queue:
                    p.queue.append((0.0, dst, data))  # keep the order behind delayed bytes
                elif not self._send(dst, data):
                    self._close(p)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            pairs = list({id(p): p for p in self._pairs.values()}.values())
        for p in pairs:
            self._close(p)
        self._listener.close()
        self._sel.close()
