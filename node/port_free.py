"""Whether this node could listen on ADDRESS:PORT right now; prints `free` or `in use: REASON`.

`fab bootstrap` sends this file to the nodes before it writes anything (`python -c <file> ADDR PORT...`),
so a MASTER_PORT, or a port Slurm's daemons will listen on, that is taken is refused up front. ADDR
`@host` is the address of this host's name: where Slurm's daemons bind (CommunicationParameters=
NoInAddrAny); with `@host`, a node without Slurm's daemons installed answers `free` (nothing of Slurm will
listen there). Several ports: the first taken is named (`in use: PORT: REASON`). Standard library only.
"""

import shutil
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
    address, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
    if address == "@host":
        if not shutil.which("slurmd"):
            print("free")
            return
        try:
            address = str(socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
        except (OSError, IndexError):
            print("free")  # the scheduler stage names a host name that resolves to nothing
            return
    if len(ports) == 1:
        print(check(address, ports[0]))
        return
    for port in ports:
        verdict = check(address, port)
        if verdict != "free":
            print(f"in use: {address}:{port}: {verdict.removeprefix('in use: ')}")
            return
    print("free")


if __name__ == "__main__":
    main()
