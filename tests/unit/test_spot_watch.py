"""The local metadata service (IMDSv2 tokens, the spot notice) and node/spot_watch.py against it, in-process."""

import json
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from infra.providers.local import metadata
from node import contract, spot_watch

ADDRESS = "127.0.91.1"


@pytest.fixture
def service(tmp_path):
    server = metadata.MetadataServer(ADDRESS, 0, tmp_path / "notice.json").start()
    yield server
    server.stop()


def request(server, path: str, method: str = "GET", headers: dict | None = None) -> tuple[int, str]:
    req = urllib.request.Request(server.endpoint + path, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def token(server, ttl_s: int = 60) -> str:
    status, body = request(server, contract.IMDS_TOKEN_PATH, "PUT", {contract.IMDS_TTL_HEADER: str(ttl_s)})
    assert status == 200
    return body


def test_every_get_needs_a_live_token(service):
    assert request(service, contract.SPOT_ACTION_PATH)[0] == 401
    assert request(service, contract.SPOT_ACTION_PATH, headers={contract.IMDS_TOKEN_HEADER: "made-up"})[0] == 401
    live = token(service)
    assert request(service, contract.SPOT_ACTION_PATH, headers={contract.IMDS_TOKEN_HEADER: live})[0] == 404
    service.tokens[live] = 0.0  # its lifetime is over
    assert request(service, contract.SPOT_ACTION_PATH, headers={contract.IMDS_TOKEN_HEADER: live})[0] == 401


@pytest.mark.parametrize("ttl", [None, "0", "21601", "soon"])
def test_a_token_needs_a_lifetime_in_range(service, ttl):
    headers = {} if ttl is None else {contract.IMDS_TTL_HEADER: ttl}
    assert request(service, contract.IMDS_TOKEN_PATH, "PUT", headers)[0] == 400


def test_proxied_token_requests_are_refused(service):
    headers = {contract.IMDS_TTL_HEADER: "60", "X-Forwarded-For": "10.0.0.1"}
    assert request(service, contract.IMDS_TOKEN_PATH, "PUT", headers)[0] == 403


def test_notice_is_404_until_posted_then_as_ec2_spells_it(service):
    headers = {contract.IMDS_TOKEN_HEADER: token(service)}
    assert request(service, contract.REBALANCE_PATH, headers=headers)[0] == 404
    metadata.post_notice(service.notice_file, 120, now_s=1_800_000_000)
    status, body = request(service, contract.SPOT_ACTION_PATH, headers=headers)
    assert status == 200
    assert json.loads(body) == {"action": "terminate", "time": "2027-01-15T08:02:00Z"}
    status, body = request(service, contract.REBALANCE_PATH, headers=headers)
    assert (status, json.loads(body)) == (200, {"noticeTime": "2027-01-15T08:00:00Z"})


def test_reclaim_is_due_at_the_notice_time(tmp_path):
    notice = tmp_path / "notice.json"
    assert not metadata.reclaim_due(notice)
    metadata.post_notice(notice, 3, now_s=1000.0)
    assert not metadata.reclaim_due(notice, now_s=1002.9)
    assert metadata.reclaim_due(notice, now_s=1003.0)


def watch_on(server, hook: str = "") -> tuple[spot_watch.SpotWatch, list[str]]:
    lines: list[str] = []
    client = spot_watch.MetadataClient(server.endpoint, token_ttl_s=60)
    return spot_watch.SpotWatch(client, hook, node="node-1", out=lines.append), lines


def test_watch_reports_each_notice_once_and_runs_the_hook(service, tmp_path):
    seen = tmp_path / "hook.out"
    watch, lines = watch_on(service, hook=f'echo "$SPOT_EVENT $SPOT_ACTION $SPOT_TIME" >> {seen}')
    assert watch.check() == [] and lines == []
    metadata.post_notice(service.notice_file, 120, now_s=1_800_000_000)
    assert [n.event for n in watch.check()] == ["interruption", "rebalance"]
    assert lines == [
        "spot-watch node-1: spot interruption notice: terminate at 2027-01-15T08:02:00Z",
        "spot-watch node-1: rebalance recommendation at 2027-01-15T08:00:00Z",
    ]
    assert watch.check() == []
    assert seen.read_text().splitlines() == [
        "interruption terminate 2027-01-15T08:02:00Z",
        "rebalance  2027-01-15T08:00:00Z",
    ]


def test_watch_renews_its_token_before_its_lifetime_and_when_refused(service):
    watch, _ = watch_on(service)
    watch.check()
    watch.check()
    assert watch.client.tokens_asked == 1
    watch.client.renew_at = 0.0  # half its lifetime has passed
    watch.check()
    assert watch.client.tokens_asked == 2
    service.tokens.clear()  # the service forgot it (restarted): 401, a new token, the answer
    metadata.post_notice(service.notice_file, 120)
    assert len(watch.check()) == 2
    assert watch.client.tokens_asked == 3


def test_watch_without_a_service_says_so_once_and_keeps_looking(tmp_path):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind((ADDRESS, 0))
        port = sock.getsockname()[1]
    lines: list[str] = []
    watch = spot_watch.SpotWatch(spot_watch.MetadataClient(f"http://{ADDRESS}:{port}"), node="n", out=lines.append)
    assert watch.check() == [] and watch.check() == []
    assert len(lines) == 1 and "no metadata service at" in lines[0]
    server = metadata.MetadataServer(ADDRESS, port, tmp_path / "notice.json").start()
    try:
        metadata.post_notice(server.notice_file, 5)
        assert len(watch.check()) == 2
        assert lines[1] == f"spot-watch n: the metadata service at http://{ADDRESS}:{port} answers"
    finally:
        server.stop()


def test_the_polling_loop_sees_a_notice(service):
    got = threading.Event()

    def out(line: str) -> None:
        if "spot interruption notice: terminate" in line:
            got.set()

    watch = spot_watch.SpotWatch(spot_watch.MetadataClient(service.endpoint), node="node-1", out=out)
    stop = threading.Event()
    loop = threading.Thread(target=watch.run, kwargs={"interval_s": 0.05, "stop": stop})
    loop.start()
    try:
        metadata.post_notice(service.notice_file, 120)
        assert got.wait(10), "no notice seen"
    finally:
        stop.set()
        loop.join()


def test_endpoint_from_botocores_variable_else_ec2s():
    assert spot_watch.endpoint_from({}) == "http://169.254.169.254"
    assert spot_watch.endpoint_from({"AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.91.2:80"}) == (
        "http://127.0.91.2:80"
    )


def test_once_from_the_environment(service, monkeypatch, capsys):
    monkeypatch.setenv(contract.METADATA_ENDPOINT_VARIABLE, service.endpoint)
    monkeypatch.setenv(contract.NODE_VARIABLE, "node-3")
    metadata.post_notice(Path(service.notice_file), 120, now_s=1_800_000_000)
    assert spot_watch.main(["--once"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "spot-watch node-3: spot interruption notice: terminate at 2027-01-15T08:02:00Z"
    )


WAITS_FOR_SIGUSR1 = """
import signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
print("ready", flush=True)
deadline = time.monotonic() + 30
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
print("SIGUSR1" if got else "nothing", flush=True)
"""


def started(node: str, **variables: str) -> subprocess.Popen:
    env = {**os.environ, contract.NODE_VARIABLE: node, **variables}
    proc = subprocess.Popen([sys.executable, "-c", WAITS_FOR_SIGUSR1], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_an_interruption_notice_sends_sigusr1_to_this_nodes_ranks_only(service, monkeypatch, tmp_path):
    node = f"node-spot-{os.getpid()}"  # unique: other tests' processes on this machine are not ours
    monkeypatch.setenv(contract.NODE_VARIABLE, node)
    monkeypatch.setenv("HOME", str(tmp_path))  # this node's home
    rank = started(node, CLUSTER_RUN_ID="run-a", RANK="1")
    others = [
        started(node, CLUSTER_RUN_ID="run-a"),  # torchrun itself: not a rank
        started(f"{node}-other", CLUSTER_RUN_ID="run-a", RANK="0"),  # a rank of another node
        started(node, RANK="0"),  # not a run's
        # the same node name in another local cluster on this machine: another home
        started(node, CLUSTER_RUN_ID="run-b", RANK="1", HOME=str(tmp_path / "elsewhere")),
    ]
    lines: list[str] = []
    watch = spot_watch.SpotWatch(spot_watch.MetadataClient(service.endpoint), out=lines.append, signal_ranks=True)
    try:
        assert spot_watch.ranks_on_this_node(node) == {rank.pid: "run-a"}
        metadata.post_notice(service.notice_file, 120)
        watch.check()
        assert rank.communicate(timeout=30)[0].strip() == "SIGUSR1"
        assert f"spot-watch {node}: SIGUSR1 to 1 rank(s) (run-a)" in lines
    finally:
        for proc in [rank, *others]:
            proc.kill()
    assert [proc.communicate()[0] for proc in others] == ["", "", "", ""]
