"""The node's side of `fab run --workdir`: its cache of a project folder, the run's results, old run copies.

Called through node/calls.py: WorkdirManifest ({path: sha256} of a cache's files), ApplyBundle (apply a
bundle that `fab` sent), ListResults (what a launch fetches back: [{"remote", "name", "size"}]) and
CleanRuns (remove the node-local copies of all but the newest KEEP runs; with names, those folders of
each run: the stages in the shared runs).

A cache (`~/.gpu-cluster/workdirs/<key>`, see contract.py) holds `files/` (the project as last synced),
`manifest.json` and `digest`. `apply` removes the manifest and the digest before it changes any file
and writes them back only once every file is in place, so a sync that was cut short leaves no digest
that a launch could trust: the next `manifest` hashes the files themselves. A bundle is a tar file that
`fab` built (remote/workdir.py): `plan.json` ({"remove": [...], "manifest": {...}, "digest": "..."}),
then the changed files under `files/`. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tarfile

from node import contract

FILES, MANIFEST, DIGEST = contract.WORKDIR_FILES, contract.WORKDIR_MANIFEST, contract.WORKDIR_DIGEST
PLAN = "plan.json"
RESULT_FILES = (contract.METRICS_FILE,)  # besides the results folder and the nodes' GPU samples (bounded), what a
# launch fetches from the run folder


def file_sha256(path: str) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            hasher.update(block)
    return hasher.hexdigest()


def regular_files(root: str) -> list:
    """Paths (relative, with '/') of the regular files under `root`; symbolic links are not followed."""
    found = []
    for folder, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                found.append(os.path.relpath(path, root).replace(os.sep, "/"))
    return sorted(found)


def manifest(cache: str) -> dict:
    """The recorded manifest where the last sync completed, else the files' own hashes."""
    try:
        with open(os.path.join(cache, MANIFEST)) as f:
            recorded = json.load(f)
        if os.path.exists(os.path.join(cache, DIGEST)) and isinstance(recorded, dict):
            return recorded
    except (OSError, ValueError):
        pass
    files = os.path.join(cache, FILES)
    return {path: file_sha256(os.path.join(files, path)) for path in regular_files(files)}


def safe_relative(name: str) -> str:
    """`name` if it is a plain relative path that stays inside its folder; else ValueError."""
    parts = name.split("/")
    if not name or name.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"refusing the path {name!r} in a bundle")
    return name


def remove(files: str, relative: str) -> None:
    """Remove a file of the cache and the folders it leaves empty."""
    path = os.path.join(files, safe_relative(relative))
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    folder = os.path.dirname(path)
    while folder != files and not os.listdir(folder):
        os.rmdir(folder)
        folder = os.path.dirname(folder)


def write_member(bundle: tarfile.TarFile, member: tarfile.TarInfo, files: str, umask: int) -> None:
    if not member.isreg() or not member.name.startswith(f"{FILES}/"):
        raise ValueError(f"refusing the member {member.name!r} in a bundle")
    path = os.path.join(files, safe_relative(member.name[len(FILES) + 1 :]))
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)  # a folder of the last sync is a file now
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.gpu-cluster-partial"
    source = bundle.extractfile(member)
    if source is None:  # not a regular file: _check_member lets only files through
        raise ValueError(f"refusing the member {member.name!r} in a bundle")
    with source, open(partial, "wb") as target:
        shutil.copyfileobj(source, target, 1 << 20)
    os.chmod(partial, (0o777 if member.mode & 0o111 else 0o666) & ~umask)
    os.replace(partial, path)


def write_atomic(path: str, text: str) -> None:
    with open(f"{path}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{path}.tmp", path)


def apply(cache: str, bundle_path: str) -> dict:
    files = os.path.join(cache, FILES)
    os.makedirs(files, exist_ok=True)
    for name in (DIGEST, MANIFEST):  # from here until the end the cache is "being changed"
        try:
            os.unlink(os.path.join(cache, name))
        except FileNotFoundError:
            pass
    umask = os.umask(0)
    os.umask(umask)
    sent = 0
    with tarfile.open(bundle_path) as bundle:
        plan_file = bundle.extractfile(PLAN)
        if plan_file is None:
            raise ValueError(f"the bundle's {PLAN} is not a file")
        plan = json.load(plan_file)
        for relative in plan["remove"]:
            remove(files, relative)
        for member in bundle:
            if member.name != PLAN:
                write_member(bundle, member, files, umask)
                sent += 1
    write_atomic(os.path.join(cache, MANIFEST), json.dumps(plan["manifest"]))
    write_atomic(os.path.join(cache, DIGEST), plan["digest"] + "\n")
    os.unlink(bundle_path)
    return {"sent": sent, "removed": len(plan["remove"])}


def results(run_dir: str, results_dir: str) -> list:
    """The files a launch fetches: the results folder, whole, the run folder's metrics file and each node's
    GPU samples file (each at most `contract.GPU_SAMPLES_MAX_BYTES`)."""
    found = [
        {
            "remote": os.path.join(results_dir, path),
            "name": f"results/{path}",
            "size": os.path.getsize(os.path.join(results_dir, path)),
        }
        for path in regular_files(results_dir)
    ]
    try:
        samples = sorted(name for name in os.listdir(run_dir) if contract.is_gpu_samples(name))
    except OSError:
        samples = []
    for name in (*RESULT_FILES, *samples):
        path = os.path.join(run_dir, name)
        if os.path.isfile(path) and not os.path.islink(path):
            found.append({"remote": path, "name": name, "size": os.path.getsize(path)})
    return found


def folder_bytes(root: str) -> int:
    return sum(os.lstat(os.path.join(root, path)).st_size for path in regular_files(root))


def clean(runs: str, keep: int, names: tuple = contract.RUN_COPIES) -> dict:
    """Remove `workdir/` and `results/` (or the folders `names`) of every run but the newest `keep` (run ids
    sort by time); anything else in a run's folder (its checkpoints, on the shared folder or not) stays."""
    run_ids = (
        sorted(name for name in os.listdir(runs) if os.path.isdir(os.path.join(runs, name)))
        if os.path.isdir(runs)
        else []
    )
    removed, freed = 0, 0
    for run_id in run_ids[: max(0, len(run_ids) - keep)]:
        copies = [os.path.join(runs, run_id, name) for name in names]
        copies = [path for path in copies if os.path.isdir(path) and not os.path.islink(path)]
        for path in copies:
            freed += folder_bytes(path)
            shutil.rmtree(path)
        removed += bool(copies)
        if not os.listdir(os.path.join(runs, run_id)):
            os.rmdir(os.path.join(runs, run_id))
    return {"runs": len(run_ids), "removed": removed, "freed_bytes": freed}


def manifest_reply(cache: str) -> dict:
    """node/calls.py's WorkdirManifest (the cache's folder made, for the bundle that follows)."""
    os.makedirs(os.path.expanduser(cache), mode=0o700, exist_ok=True)
    return {"files": manifest(os.path.expanduser(cache))}


def clean_reply(runs: str, keep: int, names: list) -> dict:
    """node/calls.py's CleanRuns: `names` of each old run's folders (none given: its node-local copies)."""
    return clean(os.path.expanduser(runs), keep, tuple(names) or contract.RUN_COPIES)


def results_reply(run_dir: str, results_dir: str) -> dict:
    """node/calls.py's ListResults."""
    return {"files": results(os.path.expanduser(run_dir), os.path.expanduser(results_dir))}
