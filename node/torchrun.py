"""torchrun, with the job's TCP stores listening on this node's own address instead of every interface.

    python node/torchrun.py [torchrun options] SCRIPT [ARGS]     (what `fab` starts on every node)

torch's TCPStore server listens on all interfaces whatever host name it is given (torch 2.13's libuv
and classic backends both bind the wildcard address); only a listening socket the caller made, passed
as `master_listen_fd`, binds it to one address, and torchrun passes none. A job has two stores:

- the c10d rendezvous store on node-0's MASTER_ADDR:MASTER_PORT, hosted by node-0's torchrun agent.
  It is made here first, on a socket bound to MASTER_ADDR; the rendezvous backend then asks for a
  multi-tenant store on that port in the same process, and TCPStore hands it this one.
- the store the workers meet in (their own MASTER_PORT). torch 2.13 either shares one agent store with
  the workers for the whole job, where a restarted rank can read a dead rank's stale address, or has
  rank 0's worker host a store of its own, on every interface. Here rank 0's agent hosts it, bound to
  its address, and a fresh one for every rendezvous round, so each restart starts from empty keys.

Where torch lacks these hooks (another version on the node), this is plain torchrun with the workers'
store unshared, and the stores it cannot bind listen on every interface: it says so on stderr. gloo and
NCCL bind the interface of GLOO/NCCL_SOCKET_IFNAME themselves. Nothing here runs on the operator side.
"""

import os
import socket
import sys

FALLBACK = (
    "gpu-cluster: this torch cannot bind the {what} to one address; it listens on every interface "
    "for this job (see the README, 'What a job exposes')"
)


def listening_socket(address: str, port: int) -> socket.socket:
    family, kind, proto, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does for its own sockets
    sock.bind(where)
    sock.listen(socket.SOMAXCONN)
    return sock


def bound_store(address: str, port: int):
    """A multi-tenant TCPStore server listening on `address` only (port 0: any free port)."""
    from torch.distributed import TCPStore

    sock = listening_socket(address, port)
    bound_port = sock.getsockname()[1]
    return TCPStore(
        address, bound_port, is_master=True, multi_tenant=True, wait_for_workers=False, master_listen_fd=sock.detach()
    )


def stores_can_be_bound() -> bool:
    """Whether this torch's TCPStore takes a listening socket of the caller's."""
    from torch.distributed import TCPStore

    return "master_listen_fd" in (TCPStore.__init__.__doc__ or "")  # pybind puts the signature there


def serve_worker_stores_from_the_agent() -> bool:
    """Have rank 0's agent host a fresh, bound store for the workers every rendezvous round.

    Relies on members of torch 2.13's DynamicRendezvousHandler: the hook that makes the shared store and
    the two fields that keep it between rounds. False, and nothing changed, where the hook is missing.
    """
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler as handler
    except ImportError:
        return False
    if not all(hasattr(handler, name) for name in ("_create_tcp_store_server", "use_agent_store", "next_rendezvous")):
        return False
    joined = handler.next_rendezvous

    def next_rendezvous(self):
        self._shared_tcp_store_server = None  # the last round's store closes with its last reference
        self._bootstrap_store_info = None
        return joined(self)

    # Patching torch's handler class is the point: its store binds to every address otherwise.
    handler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]
    handler._create_tcp_store_server = lambda self, address, port: bound_store(address, port)  # type: ignore[method-assign, assignment]
    return True


def main(argv: list[str]) -> None:
    bindable = stores_can_be_bound()
    if not (bindable and serve_worker_stores_from_the_agent()):
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # never share one store across restarts
        print(FALLBACK.format(what="workers' store" if bindable else "job's stores"), file=sys.stderr, flush=True)
    rendezvous_store = None
    if bindable and os.environ.get("NODE_RANK") == "0":  # node-0 hosts the rendezvous (--rdzv-conf is_host=1)
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        try:
            rendezvous_store = bound_store(address, port)
        except OSError as exc:
            sys.exit(f"gpu-cluster: cannot listen on MASTER_ADDR {address}:{port}: {exc.strerror or exc}")
    from torch.distributed.run import main as torchrun

    torchrun(argv)
    del rendezvous_store  # held until torchrun is done: its rendezvous backend serves from this server


if __name__ == "__main__":
    main(sys.argv[1:])
