"""`fab run --workdir`'s pure parts: which files go, their hashes, the changes, the node's cache, the checks."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from infra.errors import UsageError
from remote import job_command, options, workdir
from tests.support import REPO
from tests.support.inventories import cluster as aws_cluster

sys.path.insert(0, str(REPO / "node"))
import job_env  # noqa: E402  (node/job_env.py, as the nodes run it)
import sync  # noqa: E402


def tree(root: Path, files: dict[str, str]) -> Path:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def sent(project: workdir.Project) -> set[str]:
    return {f.path for f in project.files}


IGNORE_CASES = {
    ".gitignore": "*.log\n!keep.log\n/build/\ndata\n*.tmp\n",
    "train.py": "",
    "keep.log": "",
    "debug.log": "",
    "notes.tmp": "",
    "build/out.bin": "",
    "src/build/gen.py": "",  # only the top-level build/ is excluded
    "data/big.bin": "",
    "src/data": "",  # `data` matches files and folders, anywhere
    "src/.gitignore": "*.py\n!main.py\n/local/\n",
    "src/main.py": "",
    "src/util.py": "",
    "src/local/x.txt": "",
    "src/deep/local/y.txt": "",
    "src/deep/.gitignore": "!util2.py\n",
    "src/deep/util2.py": "",
    "src/deep/other.py": "",
    "logs/.gitignore": "*\n!.gitignore\n",
    "logs/a.txt": "",
    "excluded/.gitignore": "",
    "excluded.log/x.txt": "",  # a folder excluded by a file pattern
    "lib/skip/keep.log": "",
}


def test_the_files_sent_are_the_ones_git_does_not_ignore(tmp_path):
    """The ignore rules against an independent account: what `git ls-files --others --exclude-standard`
    lists in a fresh repository holding the same tree (nested .gitignore files, negations, anchors)."""
    root = tree(tmp_path / "proj", IGNORE_CASES)
    (root / "lib" / ".gitignore").write_text("skip/\n!skip/keep.log\n")  # cannot re-include inside an excluded folder
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "XDG_CONFIG_HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1", "PATH": os.environ["PATH"]}
    try:
        subprocess.run(["git", "init", "-q", str(root)], check=True, env=env)
        listed = subprocess.run(
            ["git", "ls-files", "--others", "--exclude-standard"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"git is needed as the reference: {exc}")
    assert sent(workdir.collect(root)) == set(listed)
    assert "debug.log" not in listed and "keep.log" in listed and "src/deep/util2.py" in listed  # the cases bite


def test_gpuclusterignore_excludes_more_and_can_send_what_git_ignores(tmp_path):
    root = tree(
        tmp_path,
        {
            ".gitignore": "weights/\n*.pt\n",
            ".gpuclusterignore": "!small.pt\nscratch/\n",
            "small.pt": "",
            "big.pt": "",
            "weights/w.bin": "",
            "scratch/s.txt": "",
            "train.py": "",
        },
    )
    assert sent(workdir.collect(root)) == {".gitignore", ".gpuclusterignore", "small.pt", "train.py"}


def test_links_inside_are_followed_and_the_others_skipped_and_named(tmp_path):
    root = tree(tmp_path / "proj", {"train.py": "", "conf/base.yaml": "x", ".git/HEAD": "ref", ".gitignore": ".venv\n"})
    tree(tmp_path, {"outside/secret.txt": "no"})
    (root / ".venv").symlink_to(tmp_path / "outside")  # ignored: left out without a word
    (root / "current.yaml").symlink_to("conf/base.yaml")
    (root / "conf_link").symlink_to("conf")
    (root / "loop").symlink_to(".")
    (root / "secret.txt").symlink_to(tmp_path / "outside" / "secret.txt")
    (root / "dangling").symlink_to("nowhere")
    (root / "a").symlink_to("b")  # a loop of two links: following either never ends
    (root / "b").symlink_to("a")
    (root / "into_loop").symlink_to("a")
    state_dir = root / ".cluster"
    tree(state_dir, {"local/id_ed25519": "key"})
    project = workdir.collect(root, never=(state_dir,))
    assert sent(project) == {".gitignore", "train.py", "conf/base.yaml", "current.yaml", "conf_link/base.yaml"}
    assert {f.path: f.source for f in project.files}["current.yaml"] == root / "conf" / "base.yaml"
    why = dict(project.skipped)
    assert set(why) == {"loop", "secret.txt", "dangling", "a", "b", "into_loop"}
    assert "outside the workdir" in why["secret.txt"] and "does not exist" in why["dangling"]
    assert all("a loop of links" in why[name] for name in ("a", "b", "into_loop"))


def test_hashes_are_read_once_and_again_only_where_size_or_mtime_changed(tmp_path, monkeypatch):
    root = tree(tmp_path / "proj", {"a.py": "a", "b.py": "b"})
    old = 1_600_000_000_000_000_000  # long ago: entries changed just now are not cached (their mtime may repeat)
    for name in ("a.py", "b.py"):
        os.utime(root / name, ns=(old, old))
    cache = tmp_path / "state" / "hashes.json"
    first = workdir.manifest(workdir.collect(root), cache)
    reads = []
    monkeypatch.setattr(workdir, "file_sha256", lambda path: reads.append(Path(path).name) or "f" * 64)
    assert workdir.manifest(workdir.collect(root), cache) == first and reads == []
    (root / "b.py").write_text("bb")
    second = workdir.manifest(workdir.collect(root), cache)
    assert reads == ["b.py"] and second.digest != first.digest
    workdir.manifest(workdir.collect(root), cache)
    assert reads == ["b.py", "b.py"]  # changed this instant: hashed again until its mtime is safely past


def test_changes_send_what_differs_and_remove_what_is_gone(tmp_path):
    """Against a node cache that the real sync (node/sync.py) filled, not a hand-made manifest."""
    root = tree(tmp_path / "proj", {"a.py": "1", "b.py": "2", "gone.py": "4"})
    cache, scratch = tmp_path / "cache", tmp_path / "scratch"
    scratch.mkdir()
    apply(workdir.collect(root), cache, scratch)
    (root / "b.py").write_text("changed")
    (root / "gone.py").unlink()
    (root / "new.py").write_text("3")
    wanted = workdir.manifest(workdir.collect(root), scratch / "hashes.json")
    assert workdir.changes(wanted.hashes, sync.manifest(str(cache))) == (["b.py", "new.py"], ["gone.py"])
    apply(workdir.collect(root), cache, scratch)
    assert workdir.changes(wanted.hashes, sync.manifest(str(cache))) == ([], [])
    assert (cache / "files" / "b.py").read_text() == "changed" and not (cache / "files" / "gone.py").exists()


def test_an_oversized_project_names_its_biggest_files_and_how_to_leave_them_out(tmp_path):
    root = tree(tmp_path, {"train.py": "x"})
    (root / "data.bin").write_bytes(b"0" * 3_000_000)
    project = workdir.collect(root)
    problem = workdir.size_problem(project, 2_000_000)
    assert "3.0 MB" in problem and "--max-sync-mb 2" in problem and "data.bin (3.0 MB)" in problem
    assert ".gitignore" in problem and "$CLUSTER_SHARED_DIR" in problem
    assert workdir.size_problem(project, 4_000_000) is None


def apply(project: workdir.Project, cache: Path, scratch: Path) -> dict:
    """What the node does with the bundle a launch sends, against its current manifest."""
    wanted = workdir.manifest(project, scratch / "hashes.json")
    send, remove = workdir.changes(wanted.hashes, sync.manifest(str(cache)))
    bundle = scratch / "bundle.tar.gz"
    workdir.write_bundle(project, wanted, send, remove, bundle)
    return sync.apply(str(cache), str(bundle))


def test_a_node_cache_follows_the_project_through_changes(tmp_path):
    root = tree(tmp_path / "proj", {"train.py": "v1", "pkg/a.py": "a", "pkg/old/b.py": "b"})
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    cache, scratch = tmp_path / "cache", tmp_path / "scratch"
    scratch.mkdir()
    assert apply(workdir.collect(root), cache, scratch) == {"sent": 4, "removed": 0}
    shutil.rmtree(root / "pkg" / "old")
    (root / "pkg" / "old").write_text("a file where a folder was")
    (root / "train.py").write_text("v2")
    assert apply(workdir.collect(root), cache, scratch) == {"sent": 2, "removed": 1}
    files = cache / "files"
    assert sorted(sync.regular_files(str(files))) == ["pkg/a.py", "pkg/old", "run.sh", "train.py"]
    assert (files / "train.py").read_text() == "v2" and os.access(files / "run.sh", os.X_OK)
    recorded = sync.manifest(str(cache))
    assert recorded == workdir.manifest(workdir.collect(root), scratch / "hashes.json").hashes
    assert (cache / "digest").read_text().strip() == workdir.manifest_digest(recorded)
    assert apply(workdir.collect(root), cache, scratch) == {"sent": 0, "removed": 0}


def test_a_sync_cut_short_leaves_no_digest_and_the_files_are_hashed_again(tmp_path):
    root = tree(tmp_path / "proj", {"train.py": "v1"})
    cache, scratch = tmp_path / "cache", tmp_path / "scratch"
    scratch.mkdir()
    apply(workdir.collect(root), cache, scratch)
    (cache / "digest").unlink()  # as `apply` leaves it until every file is in place
    (cache / "files" / "train.py").write_text("half written")
    assert sync.manifest(str(cache)) == {"train.py": workdir.file_sha256(cache / "files" / "train.py")}


def test_a_bundle_cannot_write_outside_the_cache(tmp_path):
    bundle = tmp_path / "evil.tar"
    with tarfile.open(bundle, "w") as tar:
        plan = json.dumps({"remove": [], "manifest": {}, "digest": "d"}).encode()
        for name, data in (("plan.json", plan), ("files/../../escaped", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, __import__("io").BytesIO(data))
    with pytest.raises(ValueError, match="refusing"):
        sync.apply(str(tmp_path / "cache"), str(bundle))
    assert not (tmp_path / "escaped").exists()


def test_results_are_the_results_folder_metrics_and_gpu_samples_never_links_or_checkpoints(tmp_path):
    run_dir, results = tmp_path / "run", tmp_path / "results"
    tree(run_dir, {"metrics.jsonl": "{}", "gpu-node-1.jsonl": "{}", "checkpoints/model.pt": "w", "snapshot.pt": "w"})
    tree(results, {"loss.json": "{}", "plots/loss.png": "png"})
    (results / "model.pt").symlink_to(run_dir / "checkpoints" / "model.pt")
    names = sorted(entry["name"] for entry in sync.results(str(run_dir), str(results)))
    assert names == ["gpu-node-1.jsonl", "metrics.jsonl", "results/loss.json", "results/plots/loss.png"]


def test_clean_removes_the_copies_of_all_but_the_newest_runs_and_keeps_the_rest(tmp_path):
    for run in ("20260101-000000-run-a", "20260102-000000-run-b", "20260103-000000-run-c"):
        tree(tmp_path / run, {"workdir/train.py": "x" * 10, "results/r.json": "{}"})
    # the oldest is also the run folder of a cluster without shared storage: its checkpoints stay
    tree(tmp_path / "20260101-000000-run-a", {"checkpoints/c.pt": "kept"})
    assert sync.clean(str(tmp_path), keep=1) == {"runs": 3, "removed": 2, "freed_bytes": 24}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["20260101-000000-run-a", "20260103-000000-run-c"]
    assert (tmp_path / "20260101-000000-run-a" / "checkpoints" / "c.pt").exists()
    assert (tmp_path / "20260103-000000-run-c" / "workdir" / "train.py").exists()


def test_clean_removes_the_stages_of_old_runs_on_the_shared_folder_and_nothing_else(tmp_path):
    for run in ("20260101-000000-run-a", "20260102-000000-run-b"):
        tree(tmp_path / run, {"stage/files/train.py": "x" * 10, "output.log": "log", "checkpoints/c.pt": "kept"})
    outcome = sync.clean(str(tmp_path), keep=1, names=("stage",))
    assert outcome == {"runs": 2, "removed": 1, "freed_bytes": 10}
    assert sorted(p.name for p in (tmp_path / "20260101-000000-run-a").iterdir()) == ["checkpoints", "output.log"]
    assert (tmp_path / "20260102-000000-run-b" / "stage" / "files" / "train.py").exists()


def test_a_jobs_own_environment_step_is_quiet_where_ready_and_one_line_where_pip_failed(tmp_path, capsys, monkeypatch):
    dest = tmp_path / "envs" / "abc"
    dest.mkdir(parents=True)
    (dest / ".installed").write_text(sys.executable + "\n")
    arguments = ["--job", str(dest), str(tmp_path / "req.txt"), str(tmp_path / "abc.log")]
    assert job_env.main(arguments) == 0 and capsys.readouterr().out == ""  # every start of a job asks

    (dest / ".installed").unlink()
    monkeypatch.setattr(job_env, "install", lambda *a: {"ok": False, "error": "ERROR: No matching distribution"})
    assert job_env.main(arguments) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gpu-cluster: installing the run's requirements into ") and len(lines) == 2
    assert (
        lines[1] == f"error: the run's requirements could not be installed: ERROR: No matching distribution "
        f"(the installer's log: {tmp_path / 'abc.log'})"
    )


@pytest.mark.parametrize(
    "pair,words",
    [
        ("NOEQUALS", ["'NOEQUALS'", "KEY=VALUE"]),
        ("1X=y", ["'1X'", "variable name"]),
        ("A-B=y", ["'A-B'"]),
        ("X =y", ["'X '"]),
        ("RANK=3", ["RANK", "sets"]),
        ("MASTER_ADDR=1.2.3.4", ["MASTER_ADDR"]),
        ("CLUSTER_RESULTS_DIR=/tmp", ["CLUSTER_RESULTS_DIR"]),
        ("PYTHONPATH=/x", ["PYTHONPATH"]),
    ],
)
def test_bad_env_keys_are_refused_by_name(pair, words):
    with pytest.raises(UsageError) as refused:
        options.environment([pair])
    assert refused.value.exit_code == 2 and all(word in str(refused.value) for word in words)


def test_env_values_are_kept_whole_and_every_launch_variable_is_reserved():
    value = 'x=1; $HOME "q"'
    assert options.environment([f"GREETING={value}", "EMPTY="]) == {"GREETING": value, "EMPTY": ""}
    with pytest.raises(UsageError, match="twice"):
        options.environment(["A=1", "A=2"])
    c = aws_cluster()
    launch_set = {
        **job_command.node_environment(c, 0, "lo", "py"),
        **job_command.job_variables(c, c.nodes[0], "r", python="py"),
    }
    assert all(job_command.reserved_variable(key) for key in launch_set)


@pytest.mark.parametrize(
    "script,words",
    [
        ("missing.py", ["no such script: missing.py"]),
        ("pkg", ["pkg is a folder"]),
        ("../outside.py", ["outside --workdir"]),
        ("link.py", ["outside --workdir"]),
        ("broken.py", ["does not compile", "broken.py, line 2"]),
    ],
)
def test_the_script_must_be_a_compiling_file_inside_the_workdir(tmp_path, script, words):
    root = tree(tmp_path / "proj", {"pkg/__init__.py": "", "broken.py": "x = 1\ndef f(:\n"})
    tree(tmp_path, {"outside.py": "print(1)\n"})
    (root / "link.py").symlink_to(tmp_path / "outside.py")
    with pytest.raises(UsageError) as refused:
        options.compiled_script(script, root.resolve())
    assert refused.value.exit_code == 2 and all(word in str(refused.value) for word in words)


def test_a_script_the_ignore_files_leave_out_is_refused(tmp_path):
    root = tree(tmp_path, {".gitignore": "scratch_*.py\n", "scratch_try.py": "print(1)\n"}).resolve()
    with pytest.raises(UsageError, match=r"left out of the workdir \(by \.gitignore:1: scratch_\*\.py\)"):
        workdir.checked_project(root, options.compiled_script("scratch_try.py", root), 10**6)


def test_what_the_ignore_files_leave_out_is_named_with_its_size_and_rule(tmp_path):
    """nanoGPT's own .gitignore leaves out its prepared data (`*.bin`, `*.pkl`): the launch says so."""
    root = tree(
        tmp_path,
        {
            ".gitignore": "# data\n\n*.bin\n*.pkl\n__pycache__/\n",
            "train.py": "",
            "data/shakespeare_char/meta.pkl": "m" * 10,
            "data/.gpuclusterignore": "big.txt\n",
            "data/big.txt": "b" * 20,
            "__pycache__/train.cpython-311.pyc": "",
        },
    )
    (root / "data" / "shakespeare_char" / "train.bin").write_bytes(b"0" * 2_000_000)
    (root / ".git").mkdir()  # never sent, never named
    project = workdir.collect(root)
    assert {x.path: (x.size_bytes, x.rule) for x in project.left_out} == {
        "__pycache__/": (0, ".gitignore:5: __pycache__/"),
        "data/big.txt": (20, "data/.gpuclusterignore:1: big.txt"),
        "data/shakespeare_char/meta.pkl": (10, ".gitignore:4: *.pkl"),
        "data/shakespeare_char/train.bin": (2_000_000, ".gitignore:3: *.bin"),
    }
    line = workdir.left_out_line(project)
    assert line.startswith("not sent, left out by the ignore files: 3 files (2.0 MB) and 1 folder: ")
    assert "data/shakespeare_char/train.bin (2.0 MB, .gitignore:3: *.bin), data/big.txt (20 B, " in line
    assert "!PATTERN to .gpuclusterignore" in line
    (root / ".gpuclusterignore").write_text("!*.bin\n")
    assert "data/shakespeare_char/train.bin" in sent(workdir.collect(root))


@pytest.mark.parametrize(
    "text,line,words",
    [
        ("numpy\n-r /etc/shadow\n", 2, ["'-r'"]),
        ("-r/etc/shadow\n", 1, ["'-r/etc/shadow'"]),
        ("# base\n--requirement=/etc/shadow\n", 2, ["--requirement=/etc/shadow"]),
        ("--requ /etc/shadow\n", 1, ["'--requ'"]),  # pip takes any unique prefix of a long option
        ("numpy\n-c constraints.txt\n", 2, ["'-c'"]),
        ("--constraint /etc/passwd\n", 1, ["'--constraint'"]),
        ("numpy \\\n-r /etc/shadow\n", 1, ["'-r'"]),  # one logical line, joined by pip
    ],
)
def test_requirements_that_include_another_file_are_refused_naming_the_line(tmp_path, text, line, words):
    path = tmp_path / "requirements.txt"
    path.write_text(text)
    with pytest.raises(UsageError) as refused:
        options.requirements_file(str(path))
    assert f"line {line}:" in str(refused.value) and "list those packages in this file" in str(refused.value)
    assert all(word in str(refused.value) for word in words)


def test_requirements_without_includes_are_read_as_they_are(tmp_path):
    text = (
        "numpy==2.0  # -r in a comment is fine\n-e .\n--config-settings=x=1 pkg\ncffi\n--index-url https://x/simple\n"
    )
    path = tmp_path / "requirements.txt"
    path.write_text(text)
    assert options.requirements_file(str(path)).text == text.encode()


DOTENV = """\
# a comment, then a blank line

export TOKEN='s3cr3t $HOME "x" \\n'
PLAIN = hello world   # a comment after a space
HASH=a#b
DQ="line1\\nline2 \\"q\\" \\\\"
MULTI="first
second"
EMPTY=
"""


def test_an_env_file_reads_dotenv_syntax_and_takes_values_literally(tmp_path):
    path = tmp_path / "job.env"
    path.write_text(DOTENV)
    assert options.environment(["EXTRA=1"], str(path)) == {
        "TOKEN": 's3cr3t $HOME "x" \\n',
        "PLAIN": "hello world",
        "HASH": "a#b",
        "DQ": 'line1\nline2 "q" \\',
        "MULTI": "first\nsecond",
        "EMPTY": "",
        "EXTRA": "1",
    }


@pytest.mark.parametrize(
    "text,words",
    [
        ("A=1\nthe-secret-itself\n", ["line 2 is not KEY=VALUE"]),
        ("A=1\nB='never closed secret\n", ["line 2 is not KEY=VALUE", "never closed"]),
        ('A="secret" tail\n', ["line 1 is not KEY=VALUE", "after the closing"]),
        ("A=1\n\n\nSECRET_ALONE\n", ["line 4 is not KEY=VALUE", "without '='"]),
        ("A=1\n\n# c\n\nB=a\0secret\n", ["line 5:", "B", "NUL byte"]),
        ("export RANK=3\n", ["line 1:", "RANK", "pick another name"]),
        ("1X=secret\n", ["line 1:", "'1X'"]),
        ("A=1\nA=secret\n", ["line 2:", "A is given twice"]),
    ],
)
def test_a_bad_env_file_names_the_line_and_never_a_value(tmp_path, text, words):
    path = tmp_path / "job.env"
    path.write_text(text)
    with pytest.raises(UsageError) as refused:
        options.environment([], str(path))
    message = str(refused.value)
    assert refused.value.exit_code == 2 and all(word in message for word in words), message
    assert "secret" not in message


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "big"])
def test_an_env_file_must_be_a_regular_file_of_bounded_size(tmp_path, kind):
    """A FIFO or /dev/zero would hang the launch forever before a word is said; a huge file is a wrong path."""
    path = tmp_path / "job.env"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "big":
        path.write_text("A=" + "x" * options.MAX_ENV_FILE_BYTES + "\n")
    else:
        path = Path(kind)
    words = ["over 1,048,576 bytes"] if kind == "big" else ["is not a regular file"]
    with pytest.raises(UsageError) as refused:
        options.environment([], str(path))
    assert refused.value.exit_code == 2 and all(w in str(refused.value) for w in words), refused.value


def test_a_name_in_the_env_file_and_in_env_is_given_twice(tmp_path):
    path = tmp_path / "job.env"
    path.write_text("TOKEN=from-file\n")
    with pytest.raises(UsageError, match="--env TOKEN is given twice"):
        options.environment(["TOKEN=from-flag"], str(path))
