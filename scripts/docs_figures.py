"""The docs' pictures, drawn from the repository and from a real local run (`make docs-figures`).

    make docs-figures        # or: PYTHONPATH=. .venv/bin/python scripts/docs_figures.py [--only architecture]

- `docs/img/architecture.png`: one box per package, one arrow per package another imports (counted from
  the code with `ast`, so the picture cannot drift from the imports).
- `docs/img/timeline.png`: the phases of a real `up`, `fab bootstrap` and `fab run-ddp` on a 2-node local
  cluster, from the timelines they record (the inventory, `bootstrap.json`, the run's `summary.json`).
- `docs/img/dashboard.png`: `deploy.py dashboard`'s page of that run, in Debian's chromium (Playwright).

The cluster lives in a scratch state folder on free loopback addresses and ports, and is taken down at
the end, also when a step fails.
"""

import argparse
import ast
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

from bench.common import REPO, bootstrapped_local_cluster, deploy, fab, started  # noqa: E402
from infra.state import BOOTSTRAP, BootstrapRecord  # noqa: E402

OUT = REPO / "docs" / "img"
CHROMIUM = "/usr/bin/chromium"

LAYERS: list[list[tuple[str, str]]] = [
    [("deploy.py", "the CLI: up, down, status,\nplan, cost, image, dashboard"), ("fabfile.py", "the fab task table")],
    [("dashboard", "the web page"), ("remote", "fab tasks: bootstrap, launch,\nrun holders, streams")],
    [("infra", "providers, inventory, ledger,\nprices, Pulumi program")],
    [
        ("harness", "runs on the nodes: train loop,\nmodels, metrics (torch)"),
        ("node", "runs on the nodes: node calls,\nSlurm, torchrun (stdlib only)"),
    ],
    [("examples", "scripts on the harness")],
]
"""The packages by layer, top first: every import runs down (or across to `node/`)."""


def package_imports() -> Counter[tuple[str, str]]:
    """(importer, imported) -> how many import statements, between the project's top-level packages."""
    names = [name.removesuffix(".py") for layer in LAYERS for name, _ in layer]
    edges: Counter[tuple[str, str]] = Counter()
    for name in names:
        single = REPO / f"{name}.py"
        files = [single] if single.exists() else sorted((REPO / name).rglob("*.py"))
        for path in files:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top in names and top != name:
                        edges[(name, top)] += 1
    return edges


def module_count(name: str) -> int:
    return 1 if name.endswith(".py") else len(list((REPO / name).rglob("*.py")))


def architecture(path: Path) -> None:
    edges = package_imports()
    fig, ax = plt.subplots(figsize=(10, 7.5))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, len(LAYERS) * 1.6)
    ax.axis("off")
    centre: dict[str, tuple[float, float]] = {}
    width, height = 2.9, 1.0
    for row, layer in enumerate(LAYERS):
        y = (len(LAYERS) - row - 1) * 1.6 + 0.3
        for col, (name, what) in enumerate(layer):
            x = (5.0 if len(layer) == 1 else 2.3 + 5.4 * col) - width / 2
            on_node = name in ("harness", "node", "examples")
            ax.add_patch(
                FancyBboxPatch(
                    (x, y),
                    width,
                    height,
                    boxstyle="round,pad=0.02",
                    facecolor="#e8f1fb" if not on_node else "#eaf6e8",
                    edgecolor="#35618f" if not on_node else "#3c7a34",
                    zorder=2,
                )
            )
            label = name if name.endswith(".py") else f"{name}/"
            ax.text(
                x + width / 2,
                y + height - 0.22,
                f"{label}  ({module_count(name)})",
                ha="center",
                weight="bold",
                zorder=3,
            )
            ax.text(x + width / 2, y + 0.38, what, ha="center", va="center", fontsize=8.5, zorder=3)
            centre[name.removesuffix(".py")] = (x + width / 2, y + height / 2)
    for (src, dst), count in sorted(edges.items()):
        (x0, y0), (x1, y1) = centre[src], centre[dst]
        dy = 0.5 if y0 > y1 else -0.5 if y0 < y1 else 0
        dx = 0 if dy else (width / 2 if x1 > x0 else -width / 2)
        ax.annotate(
            "",
            xy=(x1 - dx, y1 + dy),
            xytext=(x0 + dx, y0 - dy),
            arrowprops={"arrowstyle": "->", "color": "#555", "lw": 0.6 + min(count, 60) / 20},
            zorder=1,
        )
        ax.text(
            0.4 * x0 + 0.6 * x1,
            0.4 * (y0 - dy) + 0.6 * (y1 + dy),
            str(count),
            fontsize=7,
            color="#555",
            ha="center",
            backgroundcolor="w",
            zorder=4,
        )
    ax.set_title(
        "gpu-cluster: packages (modules) and imports between them (import statements);\n"
        "blue runs on your machine, green on the nodes",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def timeline_rows(state: Path, run_dir: Path) -> list[tuple[str, list[dict]]]:
    stack = state / "local"
    inventory = json.loads((stack / "inventory.json").read_text())
    bootstrap = BootstrapRecord.read(stack / BOOTSTRAP)
    summary = json.loads((run_dir / "summary.json").read_text())
    return [
        ("deploy.py up --local", inventory["timeline"]["phases"]),
        ("fab bootstrap", (bootstrap.timeline or {})["phases"]),
        (f"fab {summary['task']}", summary["timeline"]["phases"]),
    ]


def timeline(rows: list[tuple[str, list[dict]]], path: Path) -> None:
    day = time.strftime("%Y-%m-%d", time.gmtime())
    fig, axes = plt.subplots(len(rows), 1, figsize=(12, 1.9 * len(rows) + 0.6))
    colours = [plt.get_cmap("tab20")(i) for i in range(20)]
    for ax, (name, phases) in zip(axes, rows, strict=True):
        start = 0.0
        total = sum(phase["s"] for phase in phases)
        for i, phase in enumerate(phases):
            label = f"{phase['phase']} {phase['s']:.1f} s"
            ax.barh(0, phase["s"], left=start, color=colours[i % len(colours)], edgecolor="white", label=label)
            if phase["s"] >= total * 0.06:
                ax.text(
                    start + phase["s"] / 2,
                    0,
                    f"{phase['phase']}\n{phase['s']:.1f} s",
                    ha="center",
                    va="center",
                    fontsize=7.5,
                )
            start += phase["s"]
        ax.set_yticks([])
        ax.set_xlim(0, total * 1.01)
        ax.set_title(f"{name}: {total:.1f} s", fontsize=9, loc="left")
        ax.set_xlabel("seconds from the command's start", fontsize=8)
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7, frameon=False, ncol=2)
    fig.suptitle(
        f"Where the seconds go: the recorded timelines of a real 2-node local cluster, {day} (2 shared CPU cores)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def dashboard_screenshot(env: dict[str, str], run_id: str, path: Path) -> None:
    from playwright.sync_api import sync_playwright

    server = started([sys.executable, "deploy.py", "dashboard", "--port", "0", "--stack", "local"], env)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line.startswith("dashboard: http://"):
            raise RuntimeError(f"the dashboard did not start: {line}")
        url = line.split()[1]
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1300, "height": 850})
            page.goto(f"{url}#run/local/{run_id}")
            page.wait_for_function("document.querySelector('#run-state').textContent === 'COMPLETED'", timeout=60_000)
            time.sleep(3)  # the plots draw from metrics.jsonl after the state
            page.screenshot(path=str(path), full_page=False)
            browser.close()
    finally:
        server.send_signal(2)
        server.wait(timeout=15)


def from_a_local_run(with_dashboard: bool) -> None:
    from tests.support import slurm

    env = bootstrapped_local_cluster("slurm" if not slurm.unavailable() else "none")
    try:
        output = fab("run-ddp", "--args", "--steps 200 --log-every 5", env=env).stdout
        state = Path(env["CLUSTER_STATE_DIR"])
        run_dir = max((state / "local" / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
        timeline(timeline_rows(state, run_dir), OUT / "timeline.png")
        print(f"docs/img/timeline.png from run {run_dir.name}: {output.strip().splitlines()[-1]}")
        if with_dashboard and Path(CHROMIUM).exists():
            dashboard_screenshot(env, run_dir.name, OUT / "dashboard.png")
            print("docs/img/dashboard.png")
        elif with_dashboard:
            print("docs/img/dashboard.png left as it was: no /usr/bin/chromium (apt-get install chromium)")
    finally:
        if deploy("down", "--stack", "local", env=env, check=False).returncode == 0:
            shutil.rmtree(env["CLUSTER_STATE_DIR"], ignore_errors=True)  # kept where down failed: it finds the nodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["architecture", "timeline", "dashboard"], help="draw one picture")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "architecture"):
        architecture(OUT / "architecture.png")
        print("docs/img/architecture.png")
    if args.only != "architecture":
        from_a_local_run(with_dashboard=args.only in (None, "dashboard"))
    subprocess.run(["git", "status", "--short", "docs/img"], cwd=REPO, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
