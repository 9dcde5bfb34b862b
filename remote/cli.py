"""`fab` keeps this project's exit-code contract: a refusal is one `error: ...` line and exit 2.

`fab` is Fabric's own console script, and Fabric exits 1 with a bare message when it cannot parse a
command line (an unknown task or option, a flag without its value). `fabfile.py` hands the running
program to `adopt` while Fabric loads it, which is before Fabric parses the task arguments, so the
same `fab` users type gets the contract without an entry point of our own.
"""

import functools
import re

import invoke
from invoke import Program
from invoke.exceptions import Exit, ParseError

from infra.errors import ClusterError

INTERRUPTED = 130
"""A shell's exit code for a command that SIGINT ended (128 + 2)."""
HINT = "fab --list shows the tasks, fab --help TASK a task's options"
FLAG_WITHOUT_VALUE = re.compile(r"Flag <Argument: (\w+)\b.*needed value")  # invoke's wording of it


def adopt(program: Program) -> None:
    """Make `program` (the running `fab`) report parse errors and ClusterErrors as one line."""
    # Wrapping the running program's own bound methods is the point: Fabric calls them by these names.
    program.parse_tasks = _refusing_bad_input(_no_list_flag_without_value(program, program.parse_tasks))  # type: ignore[method-assign]
    program.parse_cleanup = _refusing_bad_input(program.parse_cleanup)  # type: ignore[method-assign]
    program.execute = _one_line_errors(program.execute)  # type: ignore[method-assign]


def parse_error_line(error: ParseError) -> str:
    """invoke's parse error as our one line: `error: no idea what '--x' is (fab --list ...)`."""
    text = str(error).rstrip("!").strip()
    flag = FLAG_WITHOUT_VALUE.match(text)
    if flag:
        text = f"--{flag.group(1).replace('_', '-')} needs a value"
    return f"error: {text[:1].lower()}{text[1:]} ({HINT})"


def _no_list_flag_without_value(program: Program, parse_tasks):
    """invoke drops a repeatable flag (`--env`) given last with no value, and the job would run without
    it; every such flag on the command line must have brought a value."""

    @functools.wraps(parse_tasks)
    def wrapped(*args, **kwargs):
        parse_tasks(*args, **kwargs)
        argv = list(program.core.unparsed)
        argv = argv[: argv.index("--")] if "--" in argv else argv
        for name, values in _list_values(program.tasks).items():
            flag = f"--{name}"
            given = sum(1 for token in argv if token == flag or token.startswith(flag + "="))
            if given > values:
                raise ParseError(f"Flag <Argument: {name}> needed value and was not given one")

    return wrapped


def _list_values(contexts) -> dict[str, int]:
    """How many values each repeatable flag (dashed name) received, over the tasks on the line."""
    counts: dict[str, int] = {}
    for context in contexts:
        for argument in {id(a): a for a in context.args.values()}.values():  # aliases name one argument twice
            if argument.kind is list:
                name = argument.name.replace("_", "-")
                counts[name] = counts.get(name, 0) + len(argument.value or [])
    return counts


def _refusing_bad_input(step):
    @functools.wraps(step)
    def wrapped(*args, **kwargs):
        try:
            return step(*args, **kwargs)
        except ParseError as exc:
            raise Exit(parse_error_line(exc), code=2) from None

    return wrapped


def _one_line_errors(execute):
    """An infra error raised inside a task (a bad stack name, a corrupt inventory) is one line with
    its own exit code, as in deploy.py; a Ctrl-C that no task said more about is `interrupted`, 130
    (invoke would exit 1 without a word, as if the task had failed)."""

    @functools.wraps(execute)
    def wrapped(*args, **kwargs):
        try:
            return execute(*args, **kwargs)
        except KeyboardInterrupt:
            raise Exit("fab: interrupted (Ctrl-C)", code=INTERRUPTED) from None
        except ClusterError as exc:
            if not str(exc):  # already reported line by line (ReportedFailure)
                raise Exit(code=exc.exit_code) from None
            raise Exit(f"error: {exc}", code=exc.exit_code) from None

    return wrapped


class Task(invoke.Task):
    """invoke's task, whose automatic short flags are letters or digits: invoke takes the first character
    of the option's name not taken, and for `on-straggler` (`-o` and `-n` taken) that is the dash, which
    `fab --help` lists as `--=STRING`. Such an option goes without a short flag (taking another letter
    would take it from an option after it: `-s` is `--skip-preflight`)."""

    def arg_opts(self, name, default, taken_names):
        opts = super().arg_opts(name, default, taken_names)
        opts["names"] = [flag for flag in opts["names"] if len(flag) > 1 or flag.isalnum()]
        return opts


task = functools.partial(invoke.task, klass=Task)
"""invoke's `@task`, making `Task`s."""
