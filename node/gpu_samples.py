"""A run's GPU samples on disk: each node's own file in the run folder (`contract.gpu_samples`), written by
its sampler (node/nvml.py `run_sampler`) and read by the dashboard (`/metrics`) and `fab results`' copy.

Kept out of the run's metrics.jsonl: 8 GPUs every 5 s are about 40 MB a day per node, which would push the
metrics file past a launch's 50 MB fetch limit on a long run. Standard library only.
"""

import json
import os
import threading


class SampleFile:
    """A node's GPU samples file, never over `max_bytes`: when a record would take it past, the file is
    thinned (rewritten, atomically, with every second reading of each GPU; `xid` and `gpu_error` records are
    all kept) and from then on only every `stride`-th reading of a GPU is written, the stride doubling at
    each thinning. So the file covers the whole run, its readings evenly spaced, ever coarser as it runs
    long, rather than its newest stretch only (as a rotated file would)."""

    def __init__(self, path: str, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self.stride = 1
        self.seen: dict = {}
        """Readings per GPU so far (whether a reading is written: its count modulo the stride)."""
        self.lock = threading.Lock()
        try:
            self.size = os.path.getsize(path)
        except OSError:
            self.size = 0

    def __call__(self, record: dict) -> None:
        with self.lock:
            if record.get("kind") == "gpu":
                index = record.get("index")
                count = self.seen[index] = self.seen.get(index, -1) + 1
                if count % self.stride:
                    return
            line = json.dumps(record) + "\n"
            if self.size + len(line) > self.max_bytes:
                self._thin()
                if record.get("kind") == "gpu" and self.seen[record.get("index")] % self.stride:
                    return
            with open(self.path, "a") as out:
                out.write(line)
            self.size += len(line)

    def _thin(self) -> None:
        kept: list[str] = []
        counts: dict = {}
        try:
            with open(self.path) as f:
                lines = f.readlines()
        except OSError:
            lines = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("kind") == "gpu":
                count = counts[record.get("index")] = counts.get(record.get("index"), -1) + 1
                if count % 2:
                    continue
            kept.append(line)
        self.stride *= 2
        temporary = f"{self.path}.thinning"
        with open(temporary, "w") as out:
            out.writelines(kept)
        os.replace(temporary, self.path)
        self.size = sum(len(line) for line in kept)


def newest(lines) -> dict:
    """{(node, GPU index): the newest `gpu` record} of samples files' lines (a line cut short is skipped)."""
    found: dict = {}
    for line in lines:
        if '"gpu"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind") == "gpu" and "index" in record:
            found[(str(record.get("node", "")), str(record["index"]))] = record
    return found


def newest_in(path: str, tail_bytes: int = 1 << 14) -> dict:
    """`newest` of the end of one samples file ({} where it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - tail_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return {}
    return newest(text.splitlines())
