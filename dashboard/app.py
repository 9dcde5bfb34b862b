"""The dashboard's web application (Starlette) and its server (uvicorn), on 127.0.0.1 only.

Every request needs the token `deploy.py dashboard` printed: in the URL (`?token=`) the first time, then
in a cookie scoped to this port (HttpOnly, SameSite=Strict); the one action (cancel, a POST) needs it in
a header too, which another site's page cannot send. The Host header must name this loopback address,
so a DNS name rebound to 127.0.0.1 reaches nothing. uvicorn's access log is off: URLs carry the token.

`/metrics` (dashboard/metrics.py) takes the same token as a bearer token (`Authorization: Bearer`, what
Prometheus' `authorization` sends), and only so: 401 without it. While the dashboard serves, the token is
in `.cluster/dashboard-<port>.token` (0600, removed when it stops) for Prometheus' `credentials_file`,
which Prometheus reads again at every scrape: a restarted dashboard needs no change to the scrape config.
"""

import asyncio
import json
import secrets
import signal
import socket
import time
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from dashboard import metrics, sources
from infra import state
from infra.errors import UsageError
from remote import options

STATIC = Path(__file__).with_name("static")
ADDRESS = "127.0.0.1"
TOKEN_HEADER = "x-dashboard-token"
METRICS_PATH = "/metrics"
LOG_POLL_S = 0.1
"""How often a log stream looks for lines the follow brought (the tail is in this process's memory)."""
SHUTDOWN_S = 1
"""How long Ctrl-C waits for open pages' streams before closing them."""


class TokenGate:
    """No token, no page: 403 for any request without it (URL, cookie or header), and for a POST without
    it in the header."""

    def __init__(self, app: ASGIApp, token: str, cookie: str):
        self.app, self.token, self.cookie = app, token, cookie

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        if request.url.path == METRICS_PATH:
            await self._bearer(request, scope, receive, send)
            return
        header = request.headers.get(TOKEN_HEADER, "")
        offered = header if request.method == "POST" else request.query_params.get("token") or header
        offered = offered or ("" if request.method == "POST" else request.cookies.get(self.cookie, ""))
        if not secrets.compare_digest(offered.encode(), self.token.encode()):
            response = PlainTextResponse(
                "a valid token is needed: open the URL that python deploy.py dashboard printed\n", status_code=403
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _bearer(self, request: Request, scope: Scope, receive: Receive, send: Send) -> None:
        scheme, _, offered = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(offered.strip().encode(), self.token.encode()):
            response = PlainTextResponse(
                "the dashboard's token is needed as a bearer token (Authorization: Bearer <token>)\n",
                status_code=401,
                headers={"WWW-Authenticate": 'Bearer realm="gpu-cluster dashboard"'},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def token_file(port: int) -> Path:
    """Where the dashboard on `port` keeps its token while it serves (Prometheus' `credentials_file`)."""
    return state.state_root() / f"dashboard-{port}.token"


def build_app(live: sources.Live, token: str, port: int) -> Starlette:
    cookie = f"gpu_cluster_dashboard_{port}"
    reader = metrics.Reader()

    def index(request: Request) -> Response:
        response = FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})
        response.set_cookie(cookie, token, httponly=True, samesite="strict", path="/")
        return response

    def overview(request: Request) -> Response:
        now = time.time()
        stacks = [
            sources.stack_view(s, live.statuses.get(s, {}), live.problem(s), now)
            for s in sources.shown_stacks(live.only)
        ]
        return JSONResponse({"stacks": stacks, "now": now})

    def run_page(request: Request) -> Response:
        try:
            stack, run_id = run_names(request)
        except UsageError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        try:
            return JSONResponse(sources.run_view(stack, run_id, live.tails.get((stack, run_id)), time.time()))
        except UsageError as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)

    async def log(request: Request) -> Response:
        try:
            stack, run_id = run_names(request)
            seen = options.integer("since", request.query_params.get("since") or "0", 0, minimum=0)
        except UsageError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        try:
            tail = await asyncio.to_thread(live.tail, stack, run_id)
        except UsageError as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)

        async def events():
            nonlocal seen
            while not live.stopping.is_set():  # Ctrl-C: each open stream ends, none is cancelled mid-write
                ended = tail.ended  # read before the lines: the last lines come before the end is said
                fresh = tail.since(seen)
                if fresh:
                    seen = fresh[-1][0]
                    yield f"event: lines\ndata: {json.dumps([[n, line] for n, _, line in fresh])}\n\n"
                if ended:
                    yield "event: end\ndata: {}\n\n"
                    return
                if await request.is_disconnected():
                    return
                await asyncio.sleep(LOG_POLL_S)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})

    async def prometheus(request: Request) -> Response:
        body = await asyncio.to_thread(
            lambda: metrics.render(
                reader.scrape(
                    sources.shown_stacks(live.only), dict(live.statuses), dict(live.tails), time.time(), dict(live.gpus)
                )
            )
        )
        return Response(body, media_type=metrics.CONTENT_TYPE, headers={"Cache-Control": "no-store"})

    async def cancel(request: Request) -> Response:
        try:
            stack, run_id = run_names(request)
        except UsageError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        try:
            line = await asyncio.to_thread(sources.cancel, stack, run_id)
        except UsageError as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        except Exception as exc:
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=502)
        return JSONResponse({"line": line})

    routes = [
        Route("/", index),
        Route("/favicon.ico", lambda request: Response(status_code=204)),
        Route("/api/state", overview),
        Route(METRICS_PATH, prometheus),
        Route("/api/runs/{stack}/{run_id}", run_page),
        Route("/api/runs/{stack}/{run_id}/log", log),
        Route("/api/runs/{stack}/{run_id}/cancel", cancel, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    hosts = [ADDRESS, f"{ADDRESS}:{port}", "localhost", f"localhost:{port}"]
    return Starlette(
        routes=routes,
        middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=hosts), Middleware(TokenGate, token, cookie)],
    )


def run_names(request: Request) -> tuple[str, str]:
    """The stack and run a URL names, each a valid name (else UsageError: a path is made of them)."""
    stack, run_id = request.path_params["stack"], request.path_params["run_id"]
    return state.check_stack_name(stack), options.run_id(run_id)


def listen(port: int) -> socket.socket:
    """A listening socket on 127.0.0.1 (`port` 0: any free one); UsageError where the port is taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((ADDRESS, port))
    except OSError as exc:
        sock.close()
        raise UsageError(
            f"cannot listen on {ADDRESS}:{port} ({exc.strerror or exc}): "
            "pass another --port, or --port 0 for any free one"
        ) from None
    sock.listen(64)
    sock.set_inheritable(True)
    return sock


class Server(uvicorn.Server):
    """uvicorn's server, whose Ctrl-C first tells the open log streams to end: else each is cancelled
    mid-write after SHUTDOWN_S, with a traceback."""

    def __init__(self, config: uvicorn.Config, live: sources.Live):
        super().__init__(config)
        self.live = live
        self.interrupted = False
        """Ctrl-C came. uvicorn raises it again after its shutdown, but inside asyncio.run, whose own SIGINT
        handler only cancels the main task: where that task ends without another await, `run` returns as if
        nothing happened (exit 0; seen under load). `serve` raises it itself."""

    def handle_exit(self, sig, frame) -> None:
        self.interrupted = self.interrupted or sig == signal.SIGINT
        self.live.stop()
        super().handle_exit(sig, frame)


def serve(port: int, only: str | None, status: sources.StatusFn | None, say) -> None:
    """Serve until Ctrl-C; the URL (with its token) is said once the port listens."""
    sock = listen(port)
    bound = sock.getsockname()[1]
    token = secrets.token_urlsafe(24)
    live = sources.Live(only, status)
    config = uvicorn.Config(
        build_app(live, token, bound),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=SHUTDOWN_S,
    )
    server = Server(config, live)
    try:
        state.write_atomic(token_file(bound), token)  # removed below, whenever Ctrl-C comes
        say(f"dashboard: http://{ADDRESS}:{bound}/?token={token}")
        say("dashboard: serving on 127.0.0.1 only; Ctrl-C stops it")
        say(f"dashboard: Prometheus scrapes /metrics with the token in {token_file(bound)} (dashboard/prometheus.yml)")
        live.start()
        server.run(sockets=[sock])
        if server.interrupted:
            raise KeyboardInterrupt  # Ctrl-C is exit 130, as for any command, whatever asyncio made of it
    finally:
        token_file(bound).unlink(missing_ok=True)
        live.stop()
        sock.close()
        say("dashboard: stopped")
