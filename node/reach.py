"""Can every node reach MASTER_ADDR:MASTER_PORT? Bootstrap's health stage, before any all-reduce.

    python reach.py listen ADDRESS PORT EXPECTED   # on the head node: count connections for 20 s
    python reach.py connect ADDRESS PORT           # on every node: connect within 15 s

`listen` prints how many connections it accepted; `connect` prints `ok`, or why not and exits 1.
Standard library only.
"""

import socket
import sys
import time

LISTEN_S = 20
CONNECT_S = 15


def listen(address: str, port: int, expected: int) -> int:
    deadline = time.time() + LISTEN_S
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((address, port))
        server.listen(64)
        server.settimeout(1)
        seen = 0
        while seen < expected and time.time() < deadline:
            try:
                server.accept()[0].close()
                seen += 1
            except TimeoutError:
                pass
    print(seen)
    return 0


def connect(address: str, port: int) -> int:
    deadline, error = time.time() + CONNECT_S, ""
    while time.time() < deadline:
        try:
            socket.create_connection((address, port), timeout=2).close()
            print("ok")
            return 0
        except OSError as exc:
            error = exc.strerror or str(exc)
            time.sleep(0.2)
    print(error)
    return 1


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "listen":
        return listen(argv[1], int(argv[2]), int(argv[3]))
    if len(argv) == 3 and argv[0] == "connect":
        return connect(argv[1], int(argv[2]))
    sys.exit("usage: reach.py listen ADDRESS PORT EXPECTED | reach.py connect ADDRESS PORT")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
