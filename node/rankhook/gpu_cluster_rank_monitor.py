"""Inside every rank of a `fab` launch: where its collectives stand, written where the launcher reads it.

Started by this folder's `sitecustomize.py` in each process torchrun starts for a `fab` launch, so
nothing in the user's script changes. A daemon thread waits until the script has formed its default
process group, then every `CLUSTER_PROGRESS_INTERVAL_S` (default 1 s) writes `rank-<RANK>.json` into
`$CLUSTER_PROGRESS_DIR`:

- per process group, the last collective the rank enqueued and the last it completed, from torch's
  flight recorder (enabled by `TORCH_FR_BUFFER_SIZE`, which the launch sets);
- the collective it is inside, per group: sequence number, op, sizes, dtypes, and since when;
- the main thread's Python stack, innermost frame last;
- the training step and its last steps' compute times (`compute`, for the straggler verdict:
  node/straggler.py): the harness's own where the script uses the harness, else the model's forward
  passes of any script (gpu_cluster_forward_steps.py, hooked once the group has formed).

Where the launch sets `$CLUSTER_STEP_TIMES_DIR` (a folder of the run's on the shared folder), the thread also
hands this rank's last step times to a writer thread of their own every `CLUSTER_STEP_TIMES_INTERVAL_S`
(default 0.5 s) while the rank steps, which writes them there, `rank-<RANK>.json`: the hang watches read them on
the head node, so the verdict on a slow node does not wait for that node to answer (node/straggler.py,
`SharedLooks`). A shared folder that stalls (a hard NFS mount) stalls only that thread: this one's node-local
record, which the hang rule reads, goes on.

When `dump.request` appears in that folder (`node/hang.py collect` writes it) the thread also
writes the recorder's whole buffer (`rank-<RANK>.fr.json`) and every thread's stack. Reading the
recorder needs no lock the training thread holds (the thread runs while the main thread waits in a
collective), so a rank blocked inside a collective still reports. Standard library only; torch is
used once the script has imported it.

The file names come from node/contract.py, loaded by its path beside this folder: on the rank's
PYTHONPATH the job's own folder comes before the synced code, and a project's own `node/` would hide ours.
"""

import atexit
import importlib.util
import json
import os
import sys
import threading
import time


def _load_contract():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "contract.py")
    spec = importlib.util.spec_from_file_location("gpu_cluster_node_contract", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the node contract from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


contract = _load_contract()
INTERVAL_S = float(os.environ.get("CLUSTER_PROGRESS_INTERVAL_S", "1") or 1)
STEP_TIMES_INTERVAL_S = float(os.environ.get("CLUSTER_STEP_TIMES_INTERVAL_S", "0.5") or 0.5)
STEP_TIMES_KEPT = 64
"""Steps in each write of the shared step times: more than pass between two of the watch's looks (every 0.2 to
1 s) at steps of 20 ms, and a third of the progress record's (about 1.2 kB a write: with 8 ranks a node, about
70 MB an hour on EFS)."""
STACK_DEPTH = 12
_STDLIB = os.path.dirname(os.__file__) + os.sep


def start() -> threading.Thread | None:
    """Start the monitor thread in a torchrun worker of a fab launch; None elsewhere."""
    folder, rank = os.environ.get(contract.PROGRESS_VARIABLE), os.environ.get("RANK")
    if not folder or rank is None:
        return None
    monitor = RankMonitor(folder, int(rank), threading.main_thread())
    thread = threading.Thread(target=monitor.run, name="gpu-cluster-rank-monitor", daemon=True)
    thread.start()
    atexit.register(monitor.finish)
    return thread


class RankMonitor:
    """Writes this rank's progress every interval, and the full recorder dump when asked.

    Each report asks the recorder only for its per-group counters (about 10 us). The whole buffer
    (about 0.5 ms per 1000 entries to dump, as much again to parse) is read only when a group
    appears that has not been named yet, or when a report finds the rank inside a collective it has
    not read yet, to learn which collective that is: at most once an interval, so a record never
    names a collective without its op and sizes."""

    def __init__(self, folder: str, rank: int, main_thread: threading.Thread, interval_s: float = INTERVAL_S):
        self.folder, self.rank, self.main_thread, self.interval_s = folder, rank, main_thread, interval_s
        self.answered_request = 0.0
        self.names = {"0": "0"}
        """Recorder group id -> the group's name (ids are per process, names agree across ranks)."""
        self.inside: dict[str, tuple] = {}
        """Group id -> (last completed collective, when this rank was first seen past it)."""
        self.details: dict[tuple, dict] = {}
        """(group id, sequence number) -> that collective as the recorder's buffer showed it."""
        self.retired: dict[str, int] = {}
        """Group id -> the last collective the recorder's buffer showed retired. gloo can retire a
        collective (and the rank go on to the next) before the group's `last_completed` counter says so;
        under load that counter was seen 34 s behind, which made the rank look stuck in a finished one."""
        self.failure = ""
        """Why the last report failed, said in the next one."""
        self.group_at: float | None = None
        """When this rank was first seen in a formed process group (the rendezvous done)."""
        self.first_step_at: float | None = None
        """When its first collective was seen completed, or the harness's first step (the launch's timeline)."""
        shared = os.environ.get(contract.STEP_TIMES_VARIABLE)
        self.step_times = StepTimesWriter(os.path.join(shared, contract.rank_progress(rank))) if shared else None
        """Writes this rank's step times on the shared folder (None: the launch asked for none)."""
        self.shared_step = None
        """The last step whose times were handed to it."""
        self.forward_steps = None
        """A script not on the harness: its model's forward passes as steps (installed once a group formed)."""

    def run(self) -> None:
        reported = 0.0
        while self.main_thread.is_alive():
            dist = _initialized_dist()
            if dist is not None:
                self.group_at = self.group_at or time.time()
                if self.forward_steps is None and "harness.metrics" not in sys.modules:
                    self.forward_steps = _forward_steps()
                stepped = self.first_step_at is None and self.watch_first_step()
                if stepped or time.monotonic() - reported >= self.interval_s:  # the first step said at once
                    reported = time.monotonic()
                    try:
                        self.report(dist)
                    except Exception as exc:  # one failed report (a full disk, a group torn down) must not end
                        self.failure = f"{type(exc).__name__}: {exc}"  # the monitor: its last record would freeze
                self.share_step_times()
            time.sleep(self.pause_s())

    def pause_s(self) -> float:
        """Until the group forms and its first step is done, look often (the counters cost about 10 us): a
        rank can finish its first collectives quickly, and the timeline's first step wants the moment. Then
        the record's interval, or the step times' where they are shared."""
        if self.first_step_at is None:
            return min(self.interval_s, 0.05)
        return min(self.interval_s, STEP_TIMES_INTERVAL_S) if self.step_times else self.interval_s

    def share_step_times(self) -> None:
        """This rank's last step times to its writer (`contract.STEP_TIMES` on the shared folder), where it
        stepped since the last ones."""
        step = self.step()
        if self.step_times is None or step is None or step == self.shared_step:
            return
        compute = self.compute()[-STEP_TIMES_KEPT:]
        if compute:
            node = os.environ.get(contract.NODE_VARIABLE, "")
            self.step_times.put({"rank": self.rank, "node": node, "compute": compute})
            self.shared_step = step

    def watch_first_step(self) -> bool:
        """A script on the harness: its first step. Any other: its first collective done (a proxy: DDP's
        start broadcasts, so that one is the end of the model's setup rather than of a step)."""
        if "harness.metrics" in sys.modules:
            done = _harness_step() is not None
        else:
            try:
                done = any(completed > 0 for _, completed in _recorder().counters().values())
            except Exception:
                done = False
        if done:
            self.first_step_at = time.time()
        return done

    def times(self) -> dict:
        return {"group_at": self.group_at, "first_step_at": self.first_step_at}

    def step(self):
        """The harness's last step, else the model's forward passes so far (None: no step yet, or unknown)."""
        step = _harness_step()
        if step is None and self.forward_steps:
            step = self.forward_steps.step
        return step

    def compute(self) -> list:
        """[[step, seconds]] of the rank's own compute in its last steps (node/straggler.py reads them)."""
        compute = _harness_compute()
        if not compute and self.forward_steps:
            compute = self.forward_steps.entries()
        return compute

    def finish(self) -> None:
        """At a normal exit (atexit, in the main thread): a last record saying the script finished, inside
        no collective. Without it the last record, up to an interval old, could still show the rank
        inside its final collective while the process lingers in shutdown."""
        path = os.path.join(self.folder, contract.rank_progress(self.rank))
        dist = _initialized_dist()
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):  # no look of this thread found a group: was there one in between?
            if dist is not None:
                record = self.snapshot(dist, {}, "")
            elif _formed_a_group():
                record = {"rank": self.rank, "node": os.environ.get(contract.NODE_VARIABLE, ""), "groups": {}}
                record.update(pid=os.getpid(), step=_harness_step(), error="")
            else:
                return  # it never formed a process group: nothing to say (fab says so beside "ok")
        if dist is not None:
            try:  # the counters as the script left them, where the group still exists
                groups, ranks = record.setdefault("groups", {}), group_ranks(dist)
                for pg_id, (enqueued, completed) in _recorder().counters().items():
                    name = self.names.get(pg_id)
                    if name is not None:
                        groups.setdefault(name, {"ranks": ranks.get(name, [])}).update(
                            enqueued=enqueued, completed=completed
                        )
            except Exception:
                pass
        if self.first_step_at is None and dist is not None:
            self.watch_first_step()
        record.update(time=time.time(), active=[], stack=[], finished=True, **self.times())
        _write_json(path, record)

    def report(self, dist) -> None:
        recorder = _recorder()
        try:
            read, now = recorder.counters(), time.time()
            counters = self.observe(read, now)
            if counters.pop("__full__", False):
                self.learn(recorder.full())
                counters = self.observe(read, now)  # again, with what the buffer said was retired
                counters.pop("__full__")
            error, self.failure = self.failure, ""
        except Exception as exc:  # a recorder that cannot dump must never break the job
            counters, error = {}, f"{type(exc).__name__}: {exc}"
        _write_json(os.path.join(self.folder, contract.rank_progress(self.rank)), self.snapshot(dist, counters, error))
        self.answer_dump_request(recorder)

    def observe(self, counters: dict, now: float) -> dict:
        """Note which collectives the rank is inside; mark `__full__` when the buffer must be read."""
        full, seen = False, {}
        for pg_id, (enqueued, completed) in counters.items():
            completed = max(completed, min(enqueued, self.retired.get(pg_id, -1)))
            seen[pg_id] = (enqueued, completed)
            if pg_id not in self.names and enqueued > 0:
                full = True
            if enqueued <= completed:
                self.inside.pop(pg_id, None)
                continue
            previous = self.inside.get(pg_id)
            if previous is None or previous[0] != completed:
                self.inside[pg_id] = (completed, now)
            if (pg_id, completed + 1) not in self.details:
                full = True
        return {**seen, "__full__": full}

    def learn(self, trace: dict) -> None:
        for entry in trace.get("entries", []):
            self.names[str(entry.get("pg_id"))] = str((entry.get("process_group") or [""])[0])
        self.details = {(e["pg"], e["seq"]): e for e in active_entries(trace)}
        for entry in trace.get("entries", []):
            if entry.get("retired") and not entry.get("is_p2p"):
                pg_id, seq = str(entry.get("pg_id")), int(entry.get("collective_seq_id", -1))
                self.retired[pg_id] = max(self.retired.get(pg_id, -1), seq)

    def snapshot(self, dist, counters: dict, error: str) -> dict:
        ranks = group_ranks(dist)
        groups, active = {}, []
        for pg_id, (enqueued, completed) in counters.items():
            name = self.names.get(pg_id)
            if name is None:
                continue
            groups[name] = {"ranks": ranks.get(name, []), "enqueued": enqueued, "completed": completed}
            if pg_id in self.inside:
                seen_at = self.inside[pg_id][1]
                known = self.details.get((pg_id, completed + 1))
                detail = {k: v for k, v in (known or {}).items() if k != "pg"}
                active.append(
                    {
                        "op": "",
                        "sizes": [],
                        "dtypes": [],
                        "since": seen_at,
                        **detail,
                        "group": name,
                        "seq": completed + 1,
                    }
                )
        return {
            "rank": self.rank,
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "node": os.environ.get(contract.NODE_VARIABLE, ""),
            "pid": os.getpid(),
            "time": time.time(),
            "groups": groups,
            "active": active,
            "stack": thread_stack(self.main_thread.ident),
            "step": self.step(),
            "compute": self.compute(),
            "error": error,
            **self.times(),
        }

    def answer_dump_request(self, recorder) -> None:
        request = os.path.join(self.folder, contract.DUMP_REQUEST)
        try:
            requested_at = os.stat(request).st_mtime
        except OSError:
            return
        if requested_at <= self.answered_request:
            return
        self.answered_request = requested_at
        try:
            trace = recorder.full()
        except Exception as exc:
            trace = {"error": f"{type(exc).__name__}: {exc}"}
        _write_json(
            os.path.join(self.folder, contract.rank_dump(self.rank)),
            {
                "rank": self.rank,
                "pid": os.getpid(),
                "time": time.time(),
                "trace": trace,
                "threads": all_thread_stacks(),
            },
        )


class StepTimesWriter:
    """A rank's step times onto the shared folder, on a daemon thread of its own: it writes the latest record it
    was handed (one waits at most; a newer one replaces it), so a write that stalls holds up nothing else. A
    write that fails is made again with the next record (the progress record has the times too)."""

    def __init__(self, path: str):
        self.path = path
        self.pending: dict | None = None
        self.ready = threading.Condition()
        self.made_folder = False
        self.thread: threading.Thread | None = None

    def put(self, record: dict) -> None:
        with self.ready:
            self.pending = record
            self.ready.notify()
        if self.thread is None:
            self.thread = threading.Thread(target=self.run, name="gpu-cluster-step-times", daemon=True)
            self.thread.start()

    def take(self) -> dict:
        with self.ready:
            while self.pending is None:
                self.ready.wait()
            record, self.pending = self.pending, None
            return record

    def run(self) -> None:
        while True:
            record = self.take()
            try:
                if not self.made_folder:
                    os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
                    self.made_folder = True
                _write_json(self.path, record)
            except Exception:  # a shared folder that is full or gone must not end the job: the next record
                self.made_folder = False


class _Recorder:
    """torch's flight recorder, as JSON."""

    def __init__(self, c10d):
        self.c10d = c10d

    def counters(self) -> dict:
        """{group id: (last enqueued, last completed)}: the cheap part of a dump."""
        status = json.loads(self.c10d._dump_fr_trace_json(includeCollectives=False)).get("pg_status", {})
        return {
            str(pg_id): (int(s.get("last_enqueued_collective", -1)), int(s.get("last_completed_collective", -1)))
            for pg_id, s in status.items()
        }

    def configs(self) -> dict:
        """Every process group this process made, by the recorder's group id."""
        return json.loads(self.c10d._dump_fr_trace_json(includeCollectives=False)).get("pg_config", {})

    def full(self) -> dict:
        return json.loads(self.c10d._dump_fr_trace_json(includeCollectives=True))


def _formed_a_group() -> bool:
    """Whether this process ever made a process group, destroyed since or not: the flight recorder keeps
    every group's configuration (`pg_config`) past `destroy_process_group`."""
    if "torch.distributed" not in sys.modules:
        return False
    try:
        return bool(_recorder().configs())
    except Exception:
        return False


def _recorder() -> _Recorder:
    from torch._C import _distributed_c10d

    return _Recorder(_distributed_c10d)


def _initialized_dist():
    """torch.distributed once the script has imported it and formed its default group, else None."""
    dist = sys.modules.get("torch.distributed")
    try:
        return dist if dist is not None and dist.is_available() and dist.is_initialized() else None
    except Exception:
        return None


def group_ranks(dist) -> dict[str, list[int]]:
    """Global ranks of every process group, by the group's name (the same on every rank)."""
    found = {}
    for group, name in list(dist.distributed_c10d._world.pg_names.items()):
        try:
            found[str(name)] = list(dist.get_process_group_ranks(group))
        except Exception:  # a group being torn down
            continue
    return found


def active_entries(trace: dict) -> list[dict]:
    """The recorder's collectives this rank has entered and not finished (gloo records no send/recv)."""
    active = []
    for entry in trace.get("entries", []):
        if entry.get("retired") or entry.get("is_p2p"):
            continue
        active.append(
            {
                "pg": str(entry.get("pg_id")),
                "group": str((entry.get("process_group") or [""])[0]),
                "seq": int(entry.get("collective_seq_id", -1)),
                "op": str(entry.get("profiling_name", "")).split(":")[-1],
                "sizes": entry.get("input_sizes", []),
                "dtypes": entry.get("input_dtypes", []),
                "since": int(entry.get("time_created_ns", 0)) / 1e9,
            }
        )
    return active


def thread_stack(ident: int | None) -> list[dict]:
    """A thread's Python frames, innermost last: function, file name, line, and whether the file
    belongs to a library (the standard library or an installed package) rather than the user.
    Read from the frame objects alone: no source file is opened."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    frames: list[dict] = []
    while frame is not None and len(frames) < STACK_DEPTH:
        code = frame.f_code
        frames.append(
            {
                "function": code.co_name,
                "file": os.path.basename(code.co_filename),
                "line": frame.f_lineno,
                "library": _is_library(code.co_filename),
            }
        )
        frame = frame.f_back
    return frames[::-1]


def _is_library(path: str) -> bool:
    return (
        any(part in ("site-packages", "dist-packages") for part in path.split(os.sep))
        or path.startswith(_STDLIB)
        or path.startswith("<")
    )


def all_thread_stacks() -> dict:
    names = {t.ident: t.name for t in threading.enumerate()}
    return {names.get(ident, str(ident)): thread_stack(ident) for ident in sys._current_frames()}


def _harness_step():
    metrics = sys.modules.get("harness.metrics")
    return getattr(metrics, "last_step", None)


def _forward_steps():
    """The forward-pass step counter, hooked into torch's modules; False where it cannot be (said once)."""
    try:
        from gpu_cluster_forward_steps import ForwardSteps  # type: ignore[import-not-found]  # beside it

        return ForwardSteps().install()
    except Exception as exc:
        print(f"gpu-cluster: step times of this script are not kept ({type(exc).__name__}: {exc})", file=sys.stderr)
        return False


def _harness_compute() -> list:
    """[[step, seconds]] of the rank's own compute in its last steps (node/straggler.py reads them)."""
    metrics = sys.modules.get("harness.metrics")
    try:
        return [list(entry) for entry in list(getattr(metrics, "step_compute", ()))]
    except Exception:  # the training thread appended while this one copied: the next report has them
        return []


def _write_json(path: str, data: dict) -> None:
    """One line of JSON, whole or not at all (renamed into place): the watches `cat` several at once."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(data) + "\n")
    os.replace(tmp, path)
