"""Loopback endpoints that are free right now, and a TCP proxy whose connections a test can cut."""

import random
import socket
import threading


def free_endpoint(nodes: int) -> tuple[str, int]:
    """A loopback /24 and a port where every node's (address, port) is free right now."""
    for _ in range(200):
        base = f"127.0.{random.randint(1, 250)}.10"
        port = random.randint(20000, 60000)
        prefix = base.rsplit(".", 1)[0]
        if all(_bindable(f"{prefix}.{10 + i}", port) for i in range(nodes)):
            return base, port
    raise RuntimeError("no free loopback endpoint")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _bindable(address: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((address, port))
            return True
        except OSError:
            return False


class CuttingProxy:
    """A TCP proxy on `address` to `target` whose connections can be cut: all open ones at once (`cut()`),
    or the first one `cut_first_after_s` after it opened. New connections still pass; `connections`
    counts those accepted."""

    def __init__(self, address: str, target: tuple[str, int], cut_first_after_s: float | None = None):
        self.listener = socket.create_server((address, 0))
        self.port, self.target, self.cut_first_after_s = self.listener.getsockname()[1], target, cut_first_after_s
        self.open: list[socket.socket] = []
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            pair = [client, socket.create_connection(self.target)]
            self.open += pair
            for source, sink in (pair, pair[::-1]):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()
            if self.connections == 1 and self.cut_first_after_s is not None:
                threading.Timer(self.cut_first_after_s, self._cut, args=pair).start()

    @classmethod
    def _pump(cls, source, sink):
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:  # one side closing closes the other, as a real connection would
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self):
        cut, self.open = self.open, []
        self._cut(*cut)

    @staticmethod
    def _cut(*sockets):
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            except OSError:
                pass

    def close(self):
        self.listener.close()
        self.cut()
