"""Whether this node could listen on ADDRESS:PORT right now; prints `free` or `in use: REASON`.

`fab bootstrap` sends this file to the head node before it writes anything (`python -c <file> ADDR
PORT`), so a MASTER_PORT that is taken is refused up front. Standard library only.
"""

import socket
import sys


def check(address: str, port: int) -> str:
    family, kind, proto, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as sock:
        # As the rendezvous store does: a port left in TIME_WAIT by the last job is free for the next.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(where)
            sock.listen(1)
        except OSError as exc:
            return f"in use: {exc.strerror or exc}"
    return "free"


def main() -> None:
    print(check(sys.argv[1], int(sys.argv[2])))


if __name__ == "__main__":
    main()
