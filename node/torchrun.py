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
NCCL bind the interface of GLOO/NCCL_SOCKET_IFNAME themselves.

The job's output is prefixed here, on the node (`node/output.py`): each rank writes into a pipe of its
own (`[node-1]`, or `[node-1 rank 3]` where the node runs several ranks), torchrun's own output into
another (`[node-1]`). When torchrun is done, one bare line (`contract.RANKS_MARKER` and JSON) says how
each rank that failed exited, by torchrun's failure record (a script's `sys.exit(3)` is 3 there, while
torchrun itself exits 1) and when it exited by this node's clock (`exited_at`: a thread per rank waits for
its process without reaping it, so the time is the rank's own, not when the agent noticed), and whether any
rank of this node formed a process group, as the rank monitors' progress records show (`null` where the
launch started no monitor). The operator names the node that failed first from those times
(`node/outcome.py`). Nothing here runs on the operator side.

In a fault-tolerant run (`--replicas`), the head node's torchrun also serves torchft's Lighthouse, bound
to the address `contract.LIGHTHOUSE_BIND_VARIABLE` names (torchft's own default is every interface), for
as long as its torchrun runs.
"""

import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

if not __package__:  # run as a file (`python node/torchrun.py`): import its siblings from the code folder,
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ahead of any other `node`

from node import contract, job_lock, nvml  # noqa: E402
from node.hang import progress_records  # noqa: E402
from node.output import Mux, OwnOutput, node_prefix, rank_pipe  # noqa: E402
from node.warm_ask import RankStarter  # noqa: E402
from node.warm_ask import wanted as warm_wanted  # noqa: E402

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
"""Those torchrun's agent turns into SignalException (fab stop, fail-fast and Ctrl-C send SIGTERM)."""
AGENTS_ENDED_KEY = "gpu_cluster/agents_ended"
"""In the rendezvous store: how many agents other than the head's have ended (`wait_for_the_other_agents`)."""
ENDED_WAIT = timedelta(seconds=15)
FALLBACK = (
    "gpu-cluster: this torch cannot bind the {what} to one address; it listens on every interface "
    "for this job (see the README, 'What a job exposes')"
)


LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS = 1000
"""A replica group silent this long is dropped at the next quorum: the survivors' stall when one dies
(torchft's default, 5 s, would stall them five times longer)."""
LIGHTHOUSE_JOIN_TIMEOUT_MS = 1000
"""How long a quorum waits for a group that heartbeats but has not asked to join (one restarting)."""


def serve_lighthouse():
    """torchft's Lighthouse on this node's private address, where the launch asks for one; else None."""
    bind = os.environ.get(contract.LIGHTHOUSE_BIND_VARIABLE)
    if not bind:
        return None
    from torchft._torchft import LighthouseServer

    return LighthouseServer(
        bind=bind,
        min_replicas=1,  # the last group standing goes on alone
        join_timeout_ms=LIGHTHOUSE_JOIN_TIMEOUT_MS,
        heartbeat_timeout_ms=LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS,
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


EXITED_AT: dict[str, float] = {}
"""{global rank: when its process exited, epoch seconds by this node's clock} (`note_exit`)."""
WARM_RANKS: dict[str, object] = {}
"""{global rank: the forked rank torchrun's agent holds (node/warm_ask.WarmRank)}: it knows its exit time."""


def note_exit(proc, rank: str) -> None:
    """Record when the rank's process exits: a child of this agent from a thread that waits for it without
    reaping it (WNOWAIT: torchrun's agent still reaps it and reads its code), into `EXITED_AT`; a rank the
    warm launcher forked says its own (`exit_times`)."""
    import subprocess

    if not isinstance(proc, subprocess.Popen):
        WARM_RANKS[rank] = proc
        return
    if not hasattr(os, "waitid"):  # macOS: no exit times; the nodes' own then decide (node/outcome.py)
        return

    def wait() -> None:
        try:
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # the agent reaped it first: it ended a moment ago
            pass
        EXITED_AT[rank] = time.time()

    threading.Thread(target=wait, name=f"exit-of-rank-{rank}", daemon=True).start()


def exit_times() -> dict[str, float]:
    """{global rank: when it exited} of every rank this agent started, forked warm or not."""
    warm = {rank: getattr(proc, "exited_at", None) for rank, proc in WARM_RANKS.items()}
    return {**EXITED_AT, **{rank: at for rank, at in warm.items() if isinstance(at, float)}}


def prefix_rank_output(mux: Mux, node: str) -> None:
    """Start every worker whose output torchrun does not redirect (no --redirects or --tee) with a pipe
    of its own, copied with its prefix by `mux`."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as module

    handler = module.SubprocessHandler
    popen = handler._popen
    ranks = RankStarter(warm_wanted(os.environ))

    def piped(self, args, env):
        if self._stdout is not None or self._stderr is not None:
            proc = popen(self, args, env)
            note_exit(proc, env["RANK"])
            return proc
        several = int(env.get("LOCAL_WORLD_SIZE", "1")) > 1
        read_fd, write_fd = rank_pipe()
        try:
            proc = ranks.start(args, env, write_fd)  # forked warm, or a fresh interpreter as torchrun's
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        mux.follow(read_fd, node_prefix(node, int(env["RANK"]) if several else None), name=f"rank-{env['RANK']}")
        note_exit(proc, env["RANK"])
        return proc

    handler._popen = piped  # type: ignore[method-assign]


def rank_exit_codes(failure: BaseException) -> dict[str, int]:
    """{global rank: its exit code} from torchrun's failure record (a signal is its negative number)."""
    failures = getattr(failure, "failures", None) or {}
    return {str(rank): int(f.exitcode) for rank, f in sorted(failures.items())}


def formed_process_group(node: str) -> bool | None:
    """Whether any rank of this node formed a process group, by its monitor's progress record; None
    where no monitor ran (the launch's hang watch off)."""
    folder = os.environ.get(contract.PROGRESS_VARIABLE)
    if not folder or not os.path.isdir(folder):
        return None
    return any(record.get("node", node) in ("", node) for record in progress_records(folder))


def rank_times(node: str, started: float) -> dict:
    """For the launch's timeline: when this node's torchrun started, and the earliest of its ranks'
    rendezvous and first step, by their monitors' records (absent where no monitor ran)."""
    times: dict = {"started": started}
    folder = os.environ.get(contract.PROGRESS_VARIABLE)
    if folder and os.path.isdir(folder):
        records = [r for r in progress_records(folder) if r.get("node", node) in ("", node)]
        for key, name in (("group_at", "group"), ("first_step_at", "first_step")):
            known = [r[key] for r in records if isinstance(r.get(key), (int, float))]
            if known:
                times[name] = min(known)
    return times


def ranks_line(
    exit_codes: dict[str, int], process_group: bool | None, times: dict | None = None, exited_at: dict | None = None
) -> str:
    """The bare line the launch reads after torchrun returns; `exited_at` is kept for the failed ranks."""
    ended = {rank: at for rank, at in (exited_at or {}).items() if rank in exit_codes}
    said = {"exit_codes": exit_codes, "exited_at": ended, "process_group": process_group, "times": times or {}}
    return f"{contract.RANKS_MARKER} " + json.dumps(said)


def main(argv: list[str]) -> None:
    started = time.time()
    node = os.environ.get(contract.NODE_VARIABLE) or f"node-{os.environ.get('NODE_RANK', '0')}"
    run_id = os.environ.get(contract.RUN_ID_VARIABLE)
    refuse_without_the_lock(node, run_id)
    own = OwnOutput.start(node, os.path.expanduser(f"~/{contract.node_run(run_id)}") if run_id else None)
    prefix_rank_output(own.mux, node)
    code, exit_codes = 0, {}
    sampler = nvml.run_sampler(node).__enter__()  # every GPU of the node, read while the run goes
    try:
        code = serve(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except Exception as exc:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        if isinstance(exc, SignalException):  # stopped (fab stop, fail-fast, Ctrl-C): the agent said so
            code = 128 + int(exc.sigval)  # as a shell reports a process a signal ended; no traceback
        elif isinstance(exc, ChildFailedError):
            print(exc, file=sys.stderr, flush=True)  # torchrun's failure record, without a Python traceback
            code, exit_codes = 1, rank_exit_codes(exc)
        else:
            raise
    finally:
        for stop in STOP_SIGNALS:  # torch's handlers raise wherever a later stop lands: end at once instead
            signal.signal(stop, signal.SIG_DFL)
        own.restore()  # sends what the spool still holds
        sampler.__exit__(None, None, None)
    group = formed_process_group(node) if code == 0 else None
    times = {**rank_times(node, started), "ended": time.time()}  # the run's end by this node's clock
    print(ranks_line(exit_codes, group, times, exit_times()), flush=True)
    sys.exit(code)


def refuse_without_the_lock(node: str, run_id: str | None) -> None:
    """A fab-held run's head node starts no rank where its launch holds the job lock no more: `fab stop` ends
    the holder before it looks for jobs, so a run it found no job of yet (its launch was preparing) never
    starts, and one that passed this check is in the recorded job that stop then finds. Exits as stopped."""
    lock = os.environ.get(contract.JOB_LOCK_VARIABLE)
    if lock and run_id and not job_lock.held_by(os.path.expanduser(lock), run_id):
        print(
            f"[{node}] run {run_id} was stopped before it started (its launch's job lock was ended: fab stop)",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(128 + signal.SIGTERM)


def serve(argv: list[str]) -> int:
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

    try:
        lighthouse = serve_lighthouse()
    except Exception as exc:  # a port taken, torchft missing: one line, not a Rust or import traceback
        sys.exit(
            f"gpu-cluster: cannot serve torchft's Lighthouse on {os.environ[contract.LIGHTHOUSE_BIND_VARIABLE]}: {exc}"
        )
    try:
        torchrun(argv)
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
    if rendezvous_store is not None:
        wait_for_the_other_agents(rendezvous_store, node_count(argv) - 1)
    elif os.environ.get("NODE_RANK") != "0":
        tell_the_head_node()
    del rendezvous_store  # held until torchrun is done: its rendezvous backend serves from this server
    return 0


def node_count(argv: list[str]) -> int:
    """--nnodes (a number, as fab gives it), else NNODES."""
    for i, arg in enumerate(argv):
        if arg.startswith("--nnodes="):
            return int(arg.split("=", 1)[1].split(":")[-1])
        if arg == "--nnodes" and i + 1 < len(argv):
            return int(argv[i + 1].split(":")[-1])
    return int(os.environ.get("NNODES", "1"))


def tell_the_head_node() -> None:
    """Count this agent's end in the rendezvous store, once its torchrun has shut the rendezvous down."""
    from torch.distributed import TCPStore

    try:
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=ENDED_WAIT)
        store.add(AGENTS_ENDED_KEY, 1)
    except Exception:  # the head's agent is gone already (it waits only so long): nothing waits for this
        pass


def wait_for_the_other_agents(store, others: int) -> None:
    """Keep the rendezvous store up until every other node's agent has ended (`tell_the_head_node`).

    torchrun's agents leave their exit barrier together, then each closes the rendezvous and stops its
    heartbeats, reading and writing this store. The head's agent hosts it: were it to exit first, an
    agent still closing would fail and print a `recvValueWithTimeout` trace and a "failed to shutdown
    the rendezvous" warning after a healthy run. Bounded: a node that never says so costs `ENDED_WAIT`.
    """
    deadline = time.monotonic() + ENDED_WAIT.total_seconds()
    while others > 0 and time.monotonic() < deadline:
        try:
            if store.add(AGENTS_ENDED_KEY, 0) >= others:
                return
        except Exception:
            return
        time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1:])
