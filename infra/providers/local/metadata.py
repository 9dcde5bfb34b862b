"""A local node's instance metadata service, answering as EC2's IMDSv2 does for spot interruptions.

Each local node server runs one (`MetadataServer`, a thread) on the node's own loopback address and a
port of its own, and puts its URL in every session as `AWS_EC2_METADATA_SERVICE_ENDPOINT`, botocore's
variable, so `node/spot_watch.py` (and boto3) find it as they find 169.254.169.254 on EC2:

- `PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds` (1..21600) gives a token;
- every `GET` needs a live token in `X-aws-ec2-metadata-token` (401 without one, as IMDSv2-only);
- `GET /latest/meta-data/spot/instance-action`: 404 until a notice is posted, then
  `{"action": "terminate", "time": "<ISO UTC>"}`;
- `GET /latest/meta-data/events/recommendations/rebalance`: 404 until then, then `{"noticeTime": ...}`.

The operator side posts a notice by writing the node's notice file (`post_notice`, which
`deploy.py drill spot` calls) in the stack's state folder, beside the host keys and out of the node's
home; the server reads it on every request, and the node server powers the node off once the notice's
time has passed (`reclaim_due`), as EC2 reclaims the instance.
"""

import json
import secrets
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from infra import state
from node import contract

MAX_TOKEN_TTL_S = 21600
"""IMDSv2's longest token lifetime (six hours)."""


def iso_utc(epoch_s: float) -> str:
    """A time as EC2's metadata spells it: `2026-11-24T10:30:00Z`."""
    return datetime.fromtimestamp(epoch_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def post_notice(path: Path, notice_s: float, now_s: float | None = None) -> dict:
    """Post a spot interruption notice (and the rebalance recommendation that precedes one): the node
    is reclaimed `notice_s` seconds from now. Returns the record written."""
    now_s = time.time() if now_s is None else now_s
    record = {
        "action": "terminate",
        "time": iso_utc(now_s + notice_s),
        "notice_time": iso_utc(now_s),
        "reclaim_at_s": now_s + notice_s,
    }
    state.write_atomic(path, json.dumps(record))
    return record


def read_notice(path: Path) -> dict | None:
    """The posted notice, or None where there is none (or it cannot be read)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "time" in record else None


def reclaim_due(path: Path, now_s: float | None = None) -> bool:
    """Whether a posted notice's time has passed: the node is to be powered off."""
    notice = read_notice(path)
    if notice is None:
        return False
    try:
        return float(notice["reclaim_at_s"]) <= (time.time() if now_s is None else now_s)
    except (KeyError, TypeError, ValueError):
        return False


class MetadataServer:
    """The IMDSv2 subset above, served from a daemon thread until `stop()`."""

    def __init__(self, address: str, port: int, notice_file: Path):
        self.notice_file = notice_file
        self.tokens: dict[str, float] = {}
        """Live tokens and when each expires (time.monotonic())."""
        self.lock = threading.Lock()
        self.address = address
        self.httpd = ThreadingHTTPServer((address, port), _handler_for(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.1,), name="metadata", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}:{self.httpd.server_port}"

    def start(self) -> "MetadataServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()

    def issue_token(self, ttl_s: int) -> str:
        token = secrets.token_urlsafe(32)
        with self.lock:
            now = time.monotonic()
            self.tokens = {t: expiry for t, expiry in self.tokens.items() if expiry > now}
            self.tokens[token] = now + ttl_s
        return token

    def token_valid(self, token: str | None) -> bool:
        with self.lock:
            expiry = self.tokens.get(token or "")
        return expiry is not None and expiry > time.monotonic()

    def answer(self, path: str) -> dict | None:
        """The JSON document at `path`, or None (404)."""
        notice = read_notice(self.notice_file)
        if notice is None:
            return None
        if path == contract.SPOT_ACTION_PATH:
            return {"action": notice["action"], "time": notice["time"]}
        if path == contract.REBALANCE_PATH:
            return {"noticeTime": notice.get("notice_time", notice["time"])}
        return None


def _handler_for(server: MetadataServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            if self.path != contract.IMDS_TOKEN_PATH:
                return self._reply(404, "Not Found")
            if self.headers.get("X-Forwarded-For"):  # IMDSv2 refuses proxied token requests
                return self._reply(403, "Forbidden")
            try:
                ttl_s = int(self.headers.get(contract.IMDS_TTL_HEADER, ""))
            except ValueError:
                return self._reply(400, "Bad Request")
            if not 1 <= ttl_s <= MAX_TOKEN_TTL_S:
                return self._reply(400, "Bad Request")
            self._reply(200, server.issue_token(ttl_s), {contract.IMDS_TTL_HEADER: str(ttl_s)})

        def do_GET(self) -> None:
            if not server.token_valid(self.headers.get(contract.IMDS_TOKEN_HEADER)):
                return self._reply(401, "Unauthorized")
            document = server.answer(self.path)
            if document is None:
                return self._reply(404, "Not Found")
            self._reply(200, json.dumps(document), {"Content-Type": "application/json"})

        def _reply(self, code: int, body: str, headers: dict[str, str] | None = None) -> None:
            data = body.encode()
            self.send_response(code)
            for name, value in {"Content-Type": "text/plain", **(headers or {})}.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
            pass  # the node server's log is for the node; polling every 5 s would fill it

    return Handler
