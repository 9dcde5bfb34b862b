"""`python deploy.py dashboard`'s server without a cluster: requests it cannot answer are one line with 400,
and Ctrl-C with a log stream open ends the stream and exits 130 without a traceback."""

import json
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

from tests.support import REPO
from tests.support.cli import child_env

# deploy.py dashboard as users start it, but every run's log follow stands in for a long run's: it never ends.
SERVE = """
import sys
from dashboard import shape, sources
tail = shape.LogTail()
tail.add("node-0", "[node-0] step 1\\n", 0.0)
sources.Live.tail = lambda self, stack, run_id: tail
import deploy
sys.exit(deploy.main(["dashboard", "--port", "0"]))
"""


def answer(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read(200).decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_bad_requests_are_400_in_one_line_and_ctrl_c_ends_an_open_stream_cleanly(state_dir):
    (state_dir / "local" / "runs").mkdir(parents=True)
    server = subprocess.Popen(
        [sys.executable, "-c", SERVE], cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        base, token = server.stdout.readline().split()[1].split("/?token=")
        api = f"{base}/api/runs"
        for path, said in [
            (f"local/r1/log?since=abc&token={token}", "since must be a whole number >= 0, not 'abc'"),
            (f"local/r1/log?since=-1&token={token}", "since must be a whole number >= 0, not -1"),
            (f"{'a' * 300}/r1?token={token}", "bad stack name 'aaaa"),
            (f"{'a' * 300}/r1/log?token={token}", "bad stack name 'aaaa"),
            (f"local/..?token={token}", "--run '..' is not a run id"),
            (f"local/r%0A1/log?token={token}", "--run 'r\\n1' is not a run id"),
        ]:
            status, body = answer(f"{api}/{path}")
            assert (status, said in json.loads(body)["error"]) == (400, True), (path, status, body)
        stream = urllib.request.urlopen(f"{api}/local/r1/log?token={token}", timeout=30)
        first = stream.readline()
        assert first.startswith(b"event: lines"), first
        rest = []
        reader = threading.Thread(target=lambda: rest.append(stream.read()), daemon=True)
        reader.start()
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=20) == 130
        reader.join(timeout=10)
        assert rest, "the open stream did not end with the server"
        output = server.stdout.read()
        assert "Traceback" not in output and "ERROR" not in output, output
        assert output.splitlines()[-2:] == ["dashboard: stopped", "interrupted"], output
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
