"""The docs cannot go stale: every `deploy.py` command and flag and every `fab` task and flag is shown in
docs/, and every repository file and node verb that the docs (docs/, README, ARCHITECTURE, CONTRIBUTING)
name exists.

What counts as documenting a flag: a line of docs/ that names the command (`deploy.py image create`,
`fab logs`) shows the flag (`--follow`), on that line or on the indented lines under it in a code block
(a synopsis that wraps). Flags every launch task takes are shown once, on a line that says "every launch
task" (and the `#` lines under it); `--stack` of every fab task on a line that says "every task takes".
Short forms (`-f`) do not count: the long name is the one a reader searches for.
"""

import argparse
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PROSE = [REPO / "README.md", REPO / "ARCHITECTURE.md", REPO / "CONTRIBUTING.md"]


def docs_lines(folder: Path = DOCS) -> list[tuple[str, bool]]:
    """Every line of the docs pages, with whether it is inside a code block."""
    lines = []
    for page in sorted(folder.glob("*.md")):
        fenced = False
        for line in page.read_text().splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            lines.append((line, fenced))
    return lines


def flags_in(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))


def spans(lines: list[tuple[str, bool]], names) -> list[str]:
    """The text of each line that `names(line)` accepts, with the code-block lines that continue it
    (indented under it, or `#` comment lines under a `#` line)."""
    found = []
    for i, (line, fenced) in enumerate(lines):
        if not names(line):
            continue
        text = [line]
        for following, also_fenced in lines[i + 1 :]:
            continues = following.startswith((" ", "\t")) or (
                line.lstrip().startswith("#") and following.lstrip().startswith("#")
            )
            if not (fenced and also_fenced and continues and following.strip()):
                break
            text.append(following)
        found.append("\n".join(text))
    return found


def deploy_commands() -> dict[str, set[str]]:
    """`deploy.py` command (`image create`) -> its long flags, from its argparse parser."""
    import deploy

    commands: dict[str, set[str]] = {}

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif path and not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
                flags = {o for o in action.option_strings if o.startswith("--") and o != "--help"}
                commands.setdefault(" ".join(path), set()).update(flags)

    walk(deploy.build_parser(), [])
    return commands


def fab_tasks() -> dict[str, set[str]]:
    """`fab` task -> its long flags, from the task collection fab loads."""
    from remote.tasks import ns

    return {name: _long_flags(ns[name]) for name in ns.task_names}


def _long_flags(task) -> set[str]:
    """The task's long flags; invoke's `get_arguments` pops the task's help as it reads it: put back."""
    help_before = dict(task.help)
    try:
        return {f"--{arg.names[0]}" for arg in task.get_arguments()}
    finally:
        task.help = help_before


def undocumented_deploy(commands: dict[str, set[str]], lines: list[tuple[str, bool]]) -> list[str]:
    missing = []
    for command, flags in sorted(commands.items()):
        pattern = re.compile(rf"deploy\.py {re.escape(command)}(?![\w-])")
        shown = spans(lines, pattern.search)
        if not shown:
            missing.append(f"deploy.py {command}: no line of docs/ names it")
            continue
        for flag in sorted(flags - flags_in("\n".join(shown))):
            missing.append(f"deploy.py {command} {flag}: not on any docs/ line that names `deploy.py {command}`")
    return missing


def undocumented_fab(tasks: dict[str, set[str]], lines: list[tuple[str, bool]]) -> list[str]:
    every_launch = flags_in("\n".join(spans(lines, lambda line: "every launch task" in line.lower())))
    every_task = flags_in("\n".join(spans(lines, lambda line: "every task takes" in line.lower())))
    missing = []
    for task, flags in sorted(tasks.items()):
        pattern = re.compile(rf"\bfab (?:-r \S+ )?{re.escape(task)}(?![\w-])")
        shown = spans(lines, pattern.search)
        if not shown:
            missing.append(f"fab {task}: no line of docs/ names it")
            continue
        covered = flags_in("\n".join(shown)) | every_task
        if "--max-restarts" in flags:  # a launch task
            covered |= every_launch
        for flag in sorted(flags - covered):
            missing.append(f"fab {task} {flag}: not on any docs/ line that names `fab {task}`")
    return missing


PATH = re.compile(
    r"(?<![\w./~$<>-])((?:infra|remote|node|harness|examples|bench|tests|scripts|dashboard|docs|\.ci)/[\w./-]*[\w/])"
)
TOP = re.compile(
    r"(?<![\w./-])(deploy\.py|fabfile\.py|mkdocs\.yml|pyproject\.toml|requirements(?:-node)?\.(?:txt|in)"
    r"|Pulumi\.[a-z0-9]+\.yaml|[A-Z]+\.md)(?![\w-])"
)
MADE_BY_RUNS = {"tests/support/openssh"}
"""Paths the docs name that are not files of the repository on purpose: a module run with `-m`."""


def named_paths(text: str) -> set[str]:
    paths = {match.rstrip(".") for match in PATH.findall(text)}
    return paths | set(TOP.findall(text))


def missing_paths(text: str, repo: Path = REPO) -> list[str]:
    missing = []
    for path in sorted(named_paths(text)):
        bare = path.split("::")[0].rstrip("/")
        if bare in MADE_BY_RUNS or (repo / bare).exists() or (repo / f"{bare}.py").exists():
            continue
        module, _, name = bare.rpartition(".")  # `remote/stream.Terminal`: a module's class or function
        source = repo / f"{module}.py"
        if module and source.exists() and re.search(rf"^(?:(?:async )?def |class )?{name}\b", source.read_text(), re.M):
            continue
        missing.append(path)
    return missing


def unknown_node_verbs(text: str) -> list[str]:
    """`calls.Verb` that node/calls.py does not define, and `node/x.py word` where node/x.py takes no
    command `word` (a node module run as a command spells its commands as string literals)."""
    from node import calls

    unknown = [f"calls.{verb}" for verb in re.findall(r"\bcalls\.([A-Z]\w+)", text) if verb not in calls.VERBS]
    for code in re.findall(r"`([^`\n]+)`", text):
        for module, word in re.findall(r"(?<![\w.])(?:node/)?(\w+)\.py ([a-z][a-z_-]+)\b", code):
            source = REPO / "node" / f"{module}.py"
            if not source.exists() or word in ("and", "or", "in", "on"):
                continue
            body = source.read_text()
            if "__main__" not in body or f'"{word}"' not in body:
                unknown.append(f"node/{module}.py {word}")
    return sorted(set(unknown))


def all_prose() -> str:
    pages = sorted(DOCS.glob("*.md")) + [p for p in PROSE if p.exists()]
    return "\n".join(page.read_text() for page in pages)


def test_every_deploy_command_and_flag_is_in_the_docs():
    missing = undocumented_deploy(deploy_commands(), docs_lines())
    assert not missing, "undocumented in docs/:\n" + "\n".join(missing)


def test_every_fab_task_and_flag_is_in_the_docs():
    missing = undocumented_fab(fab_tasks(), docs_lines())
    assert not missing, "undocumented in docs/:\n" + "\n".join(missing)


def test_every_file_the_docs_name_exists():
    missing = missing_paths(all_prose())
    assert not missing, "the docs name files that do not exist:\n" + "\n".join(missing)


def test_every_node_verb_the_docs_name_exists():
    unknown = unknown_node_verbs(all_prose())
    assert not unknown, "the docs name node calls that do not exist:\n" + "\n".join(unknown)


def test_every_node_verb_is_on_the_map():
    from node import calls

    named = set(re.findall(r"\bcalls\.([A-Z]\w+)", (REPO / "ARCHITECTURE.md").read_text()))
    assert not set(calls.VERBS) - named, f"ARCHITECTURE.md's node-call table lacks {sorted(set(calls.VERBS) - named)}"


def test_a_flag_missing_from_the_docs_is_named(tmp_path):
    (tmp_path / "commands.md").write_text(
        "```\npython deploy.py up [--local] [--nodes N]\n           [--stack NAME]\n"
        "fab logs [--run ID] [-f]\n```\nEvery task takes `--stack NAME`.\n"
    )
    lines = docs_lines(tmp_path)
    assert undocumented_deploy({"up": {"--local", "--nodes", "--stack", "--gpus"}, "down": set()}, lines) == [
        "deploy.py down: no line of docs/ names it",
        "deploy.py up --gpus: not on any docs/ line that names `deploy.py up`",
    ]
    assert undocumented_fab({"logs": {"--run", "--follow", "--stack"}}, lines) == [
        "fab logs --follow: not on any docs/ line that names `fab logs`"
    ]


def test_a_stale_name_is_found(tmp_path):
    (tmp_path / "infra").mkdir()
    (tmp_path / "infra" / "ledger.py").write_text("")
    text = "see `infra/ledger.py` and infra/gone.py; `~/.gpu-cluster/runs/` is a node's; ARCHITECTURE.md"
    assert missing_paths(text, tmp_path) == ["ARCHITECTURE.md", "infra/gone.py"]
    assert unknown_node_verbs("the watch asks `hang.py status` and `calls.HangStatus`, `calls.HangPing`") == [
        "calls.HangPing",
        "node/hang.py status",
    ]


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_every_page_is_in_the_site_nav(page):
    assert f": {page}" in (REPO / "mkdocs.yml").read_text(), f"docs/{page} is in no nav entry of mkdocs.yml"
