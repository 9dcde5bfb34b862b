"""`fab run --workdir`: a whole project, launched from its own folder, on a real 2-node local cluster."""

import hashlib
import json
import resource
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import REPO
from tests.support.cli import assert_one_line_error, child_env
from tests.support.clusters import CMDLINE_LEAKS, Cluster, bootstrapped_cluster, files_holding, run_id_in
from tests.support.packages import tiny_wheel

# A two-file project as pytorch/examples' ddp-tutorial-series/multinode.py is one (that code itself is
# not copied here): the script imports its sibling datautils.py, and local rank 0 of every node saves
# snapshot.pt in the working directory, which the issue saw the nodes overwrite in a shared folder.
TRAIN = """\
import hashlib, json, os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from datautils import MyTrainDataset
from helpers.report import describe

dist.init_process_group("gloo")
rank, node = dist.get_rank(), os.environ["CLUSTER_NODE"]
config = json.load(open("config.json"))            # from the working directory
words = open("data/words.txt").read().split()      # a data file of the project
torch.manual_seed(0)
model = DDP(torch.nn.Linear(20, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = MyTrainDataset(config["samples"])
loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data))
for epoch in range(int(sys.argv[1])):
    loader.sampler.set_epoch(epoch)
    for source, target in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(source), target)
        loss.backward()
        optimizer.step()
if int(os.environ["LOCAL_RANK"]) == 0:
    torch.save({"node": node, "model": model.module.state_dict()}, "snapshot.pt")
if rank == 0:
    torch.save(model.module.state_dict(), os.path.join(os.environ["CLUSTER_RUN_DIR"], "checkpoint.pt"))
    results = os.environ["CLUSTER_RESULTS_DIR"]
    json.dump({"loss": loss.item(), "words": words}, open(os.path.join(results, "loss.json"), "w"))
    open(os.path.join(results, "big.bin"), "wb").write(b"0" * 1_500_000)
print(describe(rank, node, config["name"]), "GREETING=" + repr(os.environ.get("GREETING")), flush=True)
big = os.environ["BIG"].encode()
print("BIG", len(big), hashlib.sha256(big).hexdigest(), flush=True)
print("FROM_FILE=" + repr(os.environ.get("FROM_FILE")), flush=True)
token = os.environ["TOKEN"]
print("TOKEN", hashlib.sha256(token.encode()).hexdigest(), "in arguments of", cmdline_leaks(token), flush=True)
dist.destroy_process_group()
"""
DATAUTILS = """\
import torch
from torch.utils.data import Dataset


class MyTrainDataset(Dataset):
    def __init__(self, size):
        generator = torch.Generator().manual_seed(1)
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]
"""
QUICK = "import gc_tinypkg, sys\nprint('imported:', gc_tinypkg.MESSAGE, 'by', sys.executable, flush=True)\n"
GREETING = "hello world; $HOME \"double\" 'single' $(touch /tmp/gpu-cluster-never)"
FROM_FILE = "two\nlines, 'quoted' $HOME"  # from an --env-file's double-quoted value, its \\n an escape
# Near the limit on --env and --args (65,536 bytes as quoted): a value this long reaches every rank whole.
BIG = ("x" * 999 + "$ '\"\n") * 12 + "y" * 48_000
TOKEN = "tok-9d2f7c-never-printed"  # an --env-file value: in no process's arguments, in no file left behind
TRAIN = f"{CMDLINE_LEAKS}\n{TRAIN}"


def make_project(root: Path) -> Path:
    files = {
        "train.py": TRAIN,
        "datautils.py": DATAUTILS,
        "helpers/__init__.py": "",
        "helpers/report.py": "def describe(rank, node, name):\n    return f'rank {rank} on {node} trained {name}'\n",
        "helpers/unused.py": "",
        "config.json": json.dumps({"name": "tiny-linear", "samples": 64}),
        "data/words.txt": "alpha beta gamma\n",
        ".gitignore": "*.ckpt\n__pycache__/\n",
    }
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    (root / "weights.ckpt").write_bytes(b"1" * 3_000_000)  # ignored: never sent, and not counted against the limit
    return root


def fab_in(cluster: Cluster, folder: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`fab -r REPO ARGS` from `folder`, as a user standing in their own project runs it."""
    fab = Path(sys.executable).with_name("fab")
    return subprocess.run(
        [str(fab), "-r", str(REPO), *args],
        cwd=folder,
        env=child_env(**cluster.env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def node_home(cluster: Cluster, node: str) -> Path:
    return cluster.state_dir / cluster.stack / "nodes" / node / ".gpu-cluster"


def every_node_file(cluster: Cluster) -> list[Path]:
    return [p for node in ("node-0", "node-1") for p in node_home(cluster, node).rglob("*") if p.is_file()]


def exec_count(cluster: Cluster) -> dict[str, int]:
    """Commands each node's SSH server has run so far (its log has one `exec:` line per command)."""
    return {
        node: (cluster.state_dir / cluster.stack / "nodes" / node / "sshd.log").read_text().count(" exec: ")
        for node in ("node-0", "node-1")
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One bootstrapped 2-node cluster for this module."""
    with bootstrapped_cluster(tmp_path_factory, "workdir") as handle:
        yield handle


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The user's project, in a folder outside this repository."""
    return make_project(tmp_path_factory.mktemp("my-project"))


def test_a_project_launched_from_its_own_folder_runs_in_a_copy_of_its_own_on_each_node(cluster, project, tmp_path):
    env_file = tmp_path / "job.env"
    env_file.write_text(
        f"# for the job\nexport FROM_FILE=\"two\\nlines, 'quoted' $HOME\"  # a comment\nTOKEN={TOKEN}\n"
    )
    result = fab_in(
        cluster,
        project,
        "run",
        "--workdir",
        ".",
        "--script",
        "train.py",
        "--args",
        "2",
        "--env",
        f"GREETING={GREETING}",
        "--env",
        f"BIG={BIG}",
        "--env-file",
        str(env_file),
        "--max-result-mb",
        "1",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    for rank, node in ((0, "node-0"), (1, "node-1")):  # sibling module, package, config and data all found
        assert f"[{node}] rank {rank} on {node} trained tiny-linear GREETING={GREETING!r}" in result.stdout
        assert f"[{node}] BIG {len(BIG)} {hashlib.sha256(BIG.encode()).hexdigest()}" in result.stdout
        assert f"[{node}] FROM_FILE={FROM_FILE!r}" in result.stdout
        assert f"[{node}] TOKEN {hashlib.sha256(TOKEN.encode()).hexdigest()} in arguments of 0" in result.stdout
    assert not files_holding(
        TOKEN, node_home(cluster, "node-0"), node_home(cluster, "node-1"), Path(cluster.info["shared_dir"])
    )
    run_id = run_id_in(result.stdout)
    for node in ("node-0", "node-1"):  # the same file name written on both nodes, each in its own folder
        job_dir = node_home(cluster, node) / "runs" / run_id / "workdir"
        assert (job_dir / "datautils.py").exists()
        snapshot = torch.load(job_dir / "snapshot.pt")
        assert snapshot["node"] == node
    assert not [p for p in every_node_file(cluster) if p.name == "weights.ckpt"]  # ignored: never sent
    assert (
        "workdir: not sent, left out by the ignore files: 1 file (3.0 MB): weights.ckpt (3.0 MB, .gitignore:1: *.ckpt)"
        in (result.stdout)
    )
    local = cluster.state_dir / cluster.stack / "runs" / run_id
    fetched = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    assert fetched == [  # no checkpoints; beside each node's log, when its lines came (`fab logs` orders by it)
        "node-0.log",
        "node-0.times",
        "node-1.log",
        "node-1.times",
        "results/loss.json",
        "run.json",
        "summary.json",
    ]
    assert json.loads((local / "results" / "loss.json").read_text())["words"] == ["alpha", "beta", "gamma"]
    assert "fab: fetched 1 file (" in result.stdout
    assert "not fetched: results/big.bin (1.5 MB, over --max-result-mb 1)" in result.stdout
    assert (Path(cluster.info["shared_dir"]) / "runs" / run_id / "checkpoint.pt").exists()  # kept where it was saved
    assert sorted(p.name for p in project.iterdir()) == sorted(  # nothing of fab's in the user's folder
        [".gitignore", "config.json", "data", "datautils.py", "helpers", "train.py", "weights.ckpt"]
    )
    summary = json.loads((local / "summary.json").read_text())
    assert summary["workdir"] == str(project.resolve()) and summary["env"] == ["BIG", "FROM_FILE", "GREETING", "TOKEN"]


def test_an_unchanged_project_sends_nothing_and_costs_no_ssh_command_more_than_one_script(cluster, project, tmp_path):
    project_quick = project / "quick.py"
    project_quick.write_text("print('quick', flush=True)\n")
    fab_in(cluster, project, "run", "--workdir", ".", "--script", "quick.py").check_returncode()
    cache = node_home(cluster, "node-1") / "workdirs"
    cached = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}

    # The hang watch polls the nodes over connections of its own while a job runs, as often as the job
    # lasts: off for the two launches whose SSH commands are counted.
    before = exec_count(cluster)
    again = fab_in(cluster, project, "run", "--workdir", ".", "--script", "quick.py", "--hang-timeout", "0")
    after = exec_count(cluster)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "fab: workdir: 0 files sent (unchanged)" in again.stdout and "[node-1] quick" in again.stdout
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()} == cached

    one_file = tmp_path / "quick.py"
    one_file.write_text(project_quick.read_text())
    plain = fab_in(cluster, tmp_path, "run", "--script", "quick.py", "--hang-timeout", "0")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    for node in after:  # the workdir's digest comes back with the launch's first command: no round trip more
        assert after[node] - before[node] <= exec_count(cluster)[node] - after[node], (node, before, after)

    (project / "config.json").write_text(json.dumps({"name": "changed", "samples": 64}))
    (project / "helpers" / "unused.py").unlink()
    changed = fab_in(cluster, project, "run", "--workdir", ".", "--script", "quick.py")
    assert changed.returncode == 0, changed.stdout + changed.stderr
    assert "fab: workdir: 1 file sent (" in changed.stdout and "1 removed, to node-0, node-1" in changed.stdout
    [node_cache] = [p for p in cache.iterdir() if p.is_dir()]
    assert json.loads((node_cache / "files" / "config.json").read_text())["name"] == "changed"
    assert not (node_cache / "files" / "helpers" / "unused.py").exists()


def test_an_oversized_project_is_refused_before_anything_is_sent(cluster, tmp_path):
    make_project(tmp_path)
    (tmp_path / "dataset.bin").write_bytes(b"2" * 1_200_000)
    runs, files = cluster.runs(), every_node_file(cluster)
    refused = fab_in(cluster, tmp_path, "run", "--workdir", ".", "--script", "train.py", "--max-sync-mb", "1")
    assert_one_line_error(refused, "over --max-sync-mb 1", "dataset.bin (1.2 MB)", ".gitignore")
    assert "weights.ckpt" not in refused.stderr  # what is ignored does not count
    assert cluster.runs() == runs and every_node_file(cluster) == files


def test_requirements_are_installed_once_and_a_failed_install_starts_nothing(cluster, project):
    tiny_wheel(project / "wheels")
    (project / "requirements.txt").write_text("--no-index\n--find-links wheels\ngc-tinypkg==0.1\n")
    (project / "needs_tiny.py").write_text(QUICK)
    first = fab_in(
        cluster, project, "run", "--workdir", ".", "--script", "needs_tiny.py", "--requirements", "requirements.txt"
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr
    assert "fab: requirements: installing requirements.txt on node-0, node-1" in first.stdout
    for node in ("node-0", "node-1"):  # in the job's own environment, torch still there from the node venv
        assert f"[{node}] imported: tiny package 0.1 by {node_home(cluster, node)}/envs/" in first.stdout
    markers = {p: p.stat().st_mtime_ns for p in node_home(cluster, "node-1").glob("envs/*/.installed")}
    assert len(markers) == 1

    second = fab_in(
        cluster, project, "run", "--workdir", ".", "--script", "needs_tiny.py", "--requirements", "requirements.txt"
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr
    assert "already installed on 2 nodes, nothing to install" in second.stdout and "installing" not in second.stdout
    assert {p: p.stat().st_mtime_ns for p in node_home(cluster, "node-1").glob("envs/*/.installed")} == markers

    (project / "impossible.txt").write_text("--no-index\n--find-links wheels\ngc-tinypkg==9.9\n")
    runs = cluster.runs()
    failed = fab_in(
        cluster, project, "run", "--workdir", ".", "--script", "needs_tiny.py", "--requirements", "impossible.txt"
    )
    assert_one_line_error(
        failed,
        "could not be installed on node-0, node-1",
        "there is no version of gc-tinypkg==9.9",  # uv's words (the nodes install with uv)
        "the installer's log",
        "no rank was started",
    )
    assert cluster.runs() == runs and "imported" not in failed.stdout


def test_clean_runs_frees_the_old_copies_on_every_node(cluster):
    runs = sorted(p.name for p in (node_home(cluster, "node-1") / "runs").iterdir())
    assert len(runs) >= 2
    result = cluster.fab("clean-runs", "--keep", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"node-1: removed the copies of {len(runs) - 1} of {len(runs)} runs" in result.stdout
    for node in ("node-0", "node-1"):
        assert [p.name for p in (node_home(cluster, node) / "runs").iterdir()] == [runs[-1]]


def test_a_full_disk_while_fetching_leaves_no_partial_result_and_the_run_still_succeeds(cluster, tmp_path):
    """fab may write at most 4 MB per file (RLIMIT_FSIZE, as a nearly full disk would): a 5 MB result
    fails midway, a small one before it arrives whole, the summary is written, and the run is ok."""
    script = tmp_path / "results.py"
    script.write_text(
        "import os\n"
        "out = os.environ['CLUSTER_RESULTS_DIR']\n"
        "open(os.path.join(out, 'a-small.txt'), 'w').write('small')\n"
        "open(os.path.join(out, 'b-big.bin'), 'wb').write(os.urandom(5_000_000))\n"
    )
    limit = 4_000_000

    def run_limited(script: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(Path(sys.executable).with_name("fab")), "run", "--script", str(script), "--max-result-mb", "10"],
            cwd=REPO,
            env=child_env(**cluster.env),
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
        )

    result = run_limited(script)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "could not fetch results/b-big.bin from node-0: File too large" in result.stdout
    local = cluster.state_dir / cluster.stack / "runs" / run_id_in(result.stdout)
    assert (local / "results" / "a-small.txt").read_text() == "small"
    assert not (local / "results" / "b-big.bin").exists()
    assert [p.name for p in local.rglob(".*")] == []  # no partial copy, no temporary summary
    assert json.loads((local / "summary.json").read_text())["exit_codes"] == {"node-0": 0, "node-1": 0}
    assert stat.S_IMODE((local / "results" / "a-small.txt").stat().st_mode) == 0o600
    # The first result cut short: said so, and never first "nothing to fetch"
    only_big = tmp_path / "only_big.py"
    only_big.write_text(
        "import os\n"
        "open(os.path.join(os.environ['CLUSTER_RESULTS_DIR'], 'big.bin'), 'wb').write(os.urandom(5_000_000))\n"
    )
    result = run_limited(only_big)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    assert "could not fetch results/big.bin from node-0: File too large" in result.stdout
    assert "nothing to fetch" not in result.stdout
