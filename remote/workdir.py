"""`fab run --workdir DIR`: which files of a project go to the nodes, and sending only what changed.

The files are DIR's, minus `.git/`, minus what DIR's `.gitignore` files exclude, with git's rules: a
file's patterns apply below its own folder, a deeper file overrides a shallower one, the last matching
pattern wins, and nothing inside an excluded folder comes back. A `.gpuclusterignore` file (same syntax)
is read after the `.gitignore` of its folder, so it can exclude more, or send what git ignores
(`!weights/small.pt`). Symbolic links are followed where they point inside DIR (the file is sent under
the link's name); links pointing outside DIR, nowhere, or into a loop of links are skipped and the
launch names them.

Each node keeps a cache of the project (`~/.gpu-cluster/workdirs/<key>`, node/sync.py) with the
digest of its manifest. The launch's first command reads that digest on every node; where it matches,
nothing is sent. Elsewhere the node's manifest is read, and one bundle (a tar file) carries the files
whose content differs, and which to remove. Hashes are cached here by (size, mtime) in
`.cluster/<stack>/workdirs/`, so an unchanged tree is not read again at every launch.
"""

import errno
import hashlib
import io
import json
import os
import re
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from infra import state
from infra.errors import OperationError, UsageError
from infra.inventory import ClusterInfo
from node import calls, contract
from node.sync import PLAN, file_sha256  # the node hashes its cache the same way
from remote import nodecall, protocol
from remote.connect import NodeSession, describe, on_all_nodes
from remote.stream import say

if TYPE_CHECKING:  # pathspec and tarfile load only where a --workdir is synced (issue 41: fab's start)
    from pathspec import GitIgnoreSpec

IGNORE_FILES = (".gitignore", ".gpuclusterignore")  # in this order: the second overrides the first
NEVER_SENT = (".git",)
RACY_S = 2.0  # a file changed this recently may change again within its mtime's granularity: not cached
DEFAULT_MAX_SYNC_MB = 200
BIGGEST_SHOWN = 5


@dataclass(frozen=True)
class ProjectFile:
    """One file that is sent."""

    path: str
    """Relative to the project folder, with '/' (a link's own name where it was followed)."""
    source: Path
    """What is read: the file itself, or what a link points to."""
    size_bytes: int
    """Its size."""
    mtime_ns: int
    """Its modification time, for the hash cache."""


@dataclass(frozen=True)
class LeftOut:
    """A file or folder of the project that the ignore files leave out."""

    path: str
    """Relative to the project folder, with '/'; a folder's ends in '/' (what is inside is not listed)."""
    size_bytes: int
    """A file's size; 0 for a folder (it is not walked)."""
    rule: str
    """The line that left it out: `data/.gitignore:3: *.bin`."""


@dataclass(frozen=True)
class Project:
    """A project folder as it would be sent."""

    root: Path
    """The folder, resolved."""
    files: tuple[ProjectFile, ...]
    """What is sent, by path."""
    skipped: tuple[tuple[str, str], ...]
    """(path, why) of the links and special files that are not sent."""
    left_out: tuple[LeftOut, ...] = ()
    """What the ignore files leave out (`.git/` and the state folder are not counted)."""

    @property
    def total_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    @property
    def key(self) -> str:
        """The name of this project's cache on the nodes: its folder's name and a digest of its path."""
        name = re.sub(r"[^A-Za-z0-9._-]", "_", self.root.name)[:40] or "root"
        return f"{name}-{hashlib.sha256(str(self.root).encode()).hexdigest()[:12]}"

    def includes(self, path: str) -> bool:
        return any(f.path == path for f in self.files)


@dataclass(frozen=True)
class Manifest:
    """The project's content: what the nodes' caches are compared with."""

    hashes: dict[str, str]
    """sha256 by path."""
    digest: str
    """One digest of all of it, which a node's cache records."""


class IgnoreRules:
    """The ignore files in force in one folder: (folder, spec, each pattern's file and line) from the root down."""

    def __init__(self, layers: tuple[tuple[str, "GitIgnoreSpec", tuple[str, ...]], ...] = ()):
        self.layers = layers

    def entering(self, folder: Path, relative: str) -> "IgnoreRules":
        """The rules inside `folder` (`relative` to the root, '' or ending in '/')."""
        lines: list[str] = []
        origins: list[str] = []
        for name in IGNORE_FILES:
            try:
                text = (folder / name).read_text(encoding="utf-8", errors="replace").splitlines()
            except OSError:
                continue
            lines += text
            origins += [f"{relative}{name}:{number}" for number in range(1, len(text) + 1)]
        if not lines:
            return self
        from pathspec import GitIgnoreSpec

        spec = GitIgnoreSpec.from_lines([line or "#" for line in lines])  # '#' keeps one pattern per line
        return IgnoreRules(self.layers + ((relative, spec, tuple(origins)),))

    def excludes(self, path: str, is_dir: bool) -> bool:
        """Whether `path` (relative to the root) is excluded: the deepest ignore file that has a say decides."""
        return self.excluding_rule(path, is_dir) is not None

    def excluding_rule(self, path: str, is_dir: bool) -> str | None:
        """The line that excludes `path` (`.gitignore:3: *.bin`), or None where it is sent."""
        for base, spec, origins in reversed(self.layers):
            result = spec.check_file(path[len(base) :] + ("/" if is_dir else ""))
            if result.include is not None:
                if not result.include or result.index is None:
                    return None
                pattern = spec.patterns[result.index]
                return f"{origins[result.index]}: {getattr(pattern, 'pattern', '?')}"
        return None


def collect(root: Path, never: tuple[Path, ...] = ()) -> Project:
    """The files of `root` that are sent; folders in `never` (this project's state folder) are skipped."""
    root = root.resolve()
    files: list[ProjectFile] = []
    skipped: list[tuple[str, str]] = []
    left_out: list[LeftOut] = []
    found = (files, skipped, left_out)
    _walk(root, root, "", IgnoreRules().entering(root, ""), {root}, {p.resolve() for p in never}, found)
    return Project(root, tuple(sorted(files, key=lambda f: f.path)), tuple(skipped), tuple(left_out))


def _walk(root: Path, folder: Path, relative: str, rules: IgnoreRules, visited: set, never: set, found) -> None:
    files, skipped, left_out = found
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as exc:
        skipped.append((relative or ".", exc.strerror or str(exc)))
        return
    for entry in entries:
        path = relative + entry.name
        if entry.name in NEVER_SENT:
            continue
        is_dir = _is_dir(entry)
        rule = rules.excluding_rule(path, is_dir)
        if rule is not None:
            if Path(entry.path).resolve() not in never:
                left_out.append(LeftOut(path + "/" if is_dir else path, 0 if is_dir else _size(entry), rule))
            continue
        target = _target(root, entry, path, skipped)
        if target is None or target[0] in never:
            continue
        real, info = target
        if stat.S_ISDIR(info.st_mode):
            if real in visited:  # a link to a folder that contains it
                skipped.append((path, "a link that loops back to a folder above it"))
                continue
            _walk(root, real, path + "/", rules.entering(real, path + "/"), visited | {real}, never, found)
        elif stat.S_ISREG(info.st_mode):
            files.append(ProjectFile(path, real, info.st_size, info.st_mtime_ns))
        else:
            skipped.append((path, "not a regular file"))


def _size(entry: os.DirEntry) -> int:
    try:
        return entry.stat().st_size
    except OSError:  # a link that leads nowhere
        return 0


def _is_dir(entry: os.DirEntry) -> bool:
    """Whether `entry` is a folder or a link to one; a link that cannot be followed (a loop) is not."""
    try:
        return entry.is_dir()  # follows links
    except OSError:
        return False


def _target(root: Path, entry: os.DirEntry, path: str, skipped: list) -> tuple[Path, os.stat_result] | None:
    """(what `entry` is, its stat), following a link only where it stays inside `root`."""
    if not entry.is_symlink():
        return Path(entry.path), entry.stat(follow_symlinks=False)
    real = Path(os.path.realpath(entry.path))
    if real != root and root not in real.parents:
        skipped.append((path, f"a link to {os.readlink(entry.path)}, outside the workdir"))
        return None
    try:
        return real, real.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            skipped.append((path, f"a link to {os.readlink(entry.path)}, which leads back to itself (a loop of links)"))
        else:
            skipped.append((path, f"a link to {os.readlink(entry.path)}, which does not exist"))
        return None


def size_problem(project: Project, max_bytes: int) -> str | None:
    """Why `project` is too big to send (its biggest files and how to leave them out), or None."""
    if project.total_bytes <= max_bytes:
        return None
    biggest = sorted(project.files, key=lambda f: -f.size_bytes)[:BIGGEST_SHOWN]
    listed = ", ".join(f"{f.path} ({human_bytes(f.size_bytes)})" for f in biggest)
    return (
        f"the workdir {project.root} is {human_bytes(project.total_bytes)} in {count_files(len(project.files))}, "
        f"over --max-sync-mb {max_bytes // 1_000_000}; the biggest: {listed}. Leave files out with .gitignore or "
        ".gpuclusterignore (data belongs on $CLUSTER_SHARED_DIR), or raise --max-sync-mb"
    )


def left_out_line(project: Project) -> str:
    """What the ignore files leave out, in one line: counts, size, the biggest first, and the rule of each."""
    files = sorted((x for x in project.left_out if not x.path.endswith("/")), key=lambda x: (-x.size_bytes, x.path))
    folders = [x for x in project.left_out if x.path.endswith("/")]
    counted = [f"{count_files(len(files))} ({human_bytes(sum(x.size_bytes for x in files))})"] if files else []
    counted += [f"{len(folders)} folder{'s' if len(folders) != 1 else ''}"] if folders else []
    shown = [*files, *folders][:BIGGEST_SHOWN]
    listed = ", ".join(
        f"{x.path} ({'' if x.path.endswith('/') else human_bytes(x.size_bytes) + ', '}{x.rule})" for x in shown
    )
    more = f", {len(project.left_out) - len(shown)} more" if len(project.left_out) > len(shown) else ""
    return (
        f"not sent, left out by the ignore files: {' and '.join(counted)}: {listed}{more}; to send one, add "
        "!PATTERN to .gpuclusterignore (e.g. !*.bin)"
    )


def count_files(count: int) -> str:
    return f"{count} file" if count == 1 else f"{count} files"


def human_bytes(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def manifest(project: Project, cache_path: Path) -> Manifest:
    """sha256 of every file, reading only those whose (size, mtime) the cache does not know."""
    cached = _read_cache(cache_path)
    now_ns, hashes, kept = time.time_ns(), {}, {}
    for f in project.files:
        entry = cached.get(f.path)
        if entry and entry[:2] == [f.size_bytes, f.mtime_ns]:
            hashes[f.path] = entry[2]
        else:
            hashes[f.path] = file_sha256(str(f.source))
        if now_ns - f.mtime_ns > RACY_S * 1e9:
            kept[f.path] = [f.size_bytes, f.mtime_ns, hashes[f.path]]
    if kept != cached:
        state.write_atomic(cache_path, json.dumps({"root": str(project.root), "files": kept}))
    return Manifest(hashes, manifest_digest(hashes))


def _read_cache(path: Path) -> dict:
    try:
        files = json.loads(path.read_text())["files"]
        return files if isinstance(files, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # a missing or damaged cache costs one full read


def manifest_digest(hashes: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()[:32]


def changes(local: dict[str, str], remote: dict[str, str]) -> tuple[list[str], list[str]]:
    """(paths to send, paths to remove) to turn a cache holding `remote` into `local`."""
    send = sorted(path for path, sha in local.items() if remote.get(path) != sha)
    remove = sorted(path for path in remote if path not in local)
    return send, remove


def write_bundle(project: Project, wanted: Manifest, send: list[str], remove: list[str], target: Path) -> None:
    """The tar file node/sync.py applies: the plan first, then the files to send."""
    plan = json.dumps({"remove": remove, "manifest": wanted.hashes, "digest": wanted.digest}).encode()
    by_path = {f.path: f for f in project.files}
    import tarfile

    with tarfile.open(target, "w:gz", compresslevel=1) as bundle:
        info = tarfile.TarInfo(PLAN)
        info.size, info.mtime = len(plan), int(time.time())
        bundle.addfile(info, io.BytesIO(plan))
        for path in send:
            info = bundle.gettarinfo(str(by_path[path].source), arcname=f"files/{path}")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(by_path[path].source, "rb") as source:
                bundle.addfile(info, source)


def _rule_leaving_out(project: Project, path: str) -> str | None:
    """The ignore line that leaves out `path`, itself or a folder above it."""
    return next(
        (x.rule for x in project.left_out if path == x.path or (x.path.endswith("/") and path.startswith(x.path))), None
    )


def hash_cache_path(cluster: ClusterInfo, project: Project) -> Path:
    return state.stack_file(cluster.stack, state.WORKDIRS) / f"{project.key}.json"


def sync(
    cluster: ClusterInfo,
    sessions: list[NodeSession],
    python: dict[str, str],
    project: Project,
    wanted: Manifest,
    node_digests: dict[str, str | None],
) -> None:
    """Bring every node's cache of `project` to `wanted`; the nodes whose digest matches get nothing."""
    cache = contract.workdir_cache(project.key)
    behind = [s for s in sessions if node_digests.get(s.node.name) != wanted.digest]
    for path, why in project.skipped[:BIGGEST_SHOWN]:
        say(f"fab: workdir: skipped {path}: {why}")
    if len(project.skipped) > BIGGEST_SHOWN:
        say(f"fab: workdir: skipped {len(project.skipped) - BIGGEST_SHOWN} more links or special files")
    if project.left_out:
        say(f"fab: workdir: {left_out_line(project)}")
    if not behind:
        say("fab: workdir: 0 files sent (unchanged)")
        return

    def read_manifest(session: NodeSession) -> dict:
        return nodecall.call(session, python[session.node.name], calls.WorkdirManifest(cache)).files

    remote = _node_results(behind, read_manifest, "read the workdir cache")
    plans = {name: changes(wanted.hashes, hashes) for name, hashes in remote.items()}
    with tempfile.TemporaryDirectory(prefix="gpu-cluster-workdir-") as scratch:
        bundles: dict[tuple, Path] = {}
        for send, remove in plans.values():
            key = (tuple(send), tuple(remove))
            if key not in bundles:
                bundles[key] = Path(scratch) / f"bundle-{len(bundles)}.tar.gz"
                write_bundle(project, wanted, send, remove, bundles[key])

        def send_bundle(session: NodeSession) -> dict:
            send, remove = plans[session.node.name]
            remote_bundle = f"{contract.WORKDIRS}/.bundle-{wanted.digest[:12]}.tar.gz"
            session.conn.put(str(bundles[(tuple(send), tuple(remove))]), remote=remote_bundle)
            return nodecall.call(session, python[session.node.name], calls.ApplyBundle(cache, remote_bundle))

        _node_results(behind, send_bundle, "update the workdir cache")
    say("fab: workdir: " + _sent_line(project, plans, [s.node.name for s in sessions]))


def _node_results(sessions: list[NodeSession], step, doing: str) -> dict:
    """`step` on every node at once; a node where it fails stops the launch (exit 1), naming it."""
    outcomes = on_all_nodes(sessions, step)
    for result in outcomes.failed:
        raise OperationError(f"could not {doing} on {result.name}: {_failure(result.error)}")
    return {r.name: r.value for r in outcomes}


def _failure(exc: BaseException | None) -> str:
    result = getattr(exc, "result", None)
    if result is None:
        return describe(exc)
    text = (result.stderr.strip() or result.stdout.strip()).splitlines()
    last = text[-1] if text else f"exit {result.exited}"
    return protocol.with_stale_code_hint(last)


def _sent_line(project: Project, plans: dict[str, tuple[list, list]], names: list[str]) -> str:
    """`3 files sent (1.2 kB), 1 removed, to node-0, node-1`, a part per different plan."""
    sizes = {f.path: f.size_bytes for f in project.files}
    groups: dict[tuple, list[str]] = {}
    for name in names:
        send, remove = plans.get(name, ([], []))
        groups.setdefault((tuple(send), tuple(remove)), []).append(name)
    parts = []
    for (send, remove), nodes in groups.items():
        if not send and not remove:
            parts.append(f"{', '.join(nodes)} unchanged")
            continue
        removed = f", {len(remove)} removed" if remove else ""
        size = human_bytes(sum(sizes[p] for p in send))
        parts.append(f"{count_files(len(send))} sent ({size}){removed}, to {', '.join(nodes)}")
    return "; ".join(parts) + f" (the workdir: {count_files(len(project.files))}, {human_bytes(project.total_bytes)})"


def checked_project(root: Path, script: Path, max_bytes: int) -> tuple[Project, str]:
    """The project in `root` and the script's path in it; exit 2 where the ignore files leave the script
    out or the project is over `max_bytes` (checked before anything is sent or created)."""
    project = collect(root, never=(state.state_root(),))
    relative = script.relative_to(root).as_posix()
    if not project.includes(relative):
        rule = _rule_leaving_out(project, relative)
        raise UsageError(
            f"--script {relative} is left out of the workdir ("
            + (f"by {rule}" if rule else "by .gitignore or .gpuclusterignore, or a link that leads outside it")
            + "), so it would not reach the nodes"
        )
    problem = size_problem(project, max_bytes)
    if problem:
        raise UsageError(f"{problem}")
    return project, relative
