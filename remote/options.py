"""Checks of `fab` option values, made before anything is created: a bad value is one line, exit 2.

invoke would convert integer options itself and crash with a traceback on `--lines abc`, so the tasks
take them as text and read them here, where the message can name the flag and the range.
"""

import os
import re
import shlex
import stat
from pathlib import Path

from infra.errors import UsageError, shown
from remote import dotenv
from remote.job_command import reserved_variable
from remote.packages import Requirements, include_problem

PORT_RANGE = (1024, 65535)  # below 1024 needs root on the nodes
# Each process is a whole Python with torch (hundreds of MB), and one per GPU on GPU nodes (8 at most on
# the catalog's types): past this, a number is a typo that would leave torchrun starting processes for minutes.
MAX_NPROC_PER_NODE = 256
# torchrun restarts the whole worker group each time; a thousand restarts of one run is already a loop.
MAX_RESTARTS = 1000
# `--env` and `--args` travel on the job's command line, which reaches the node as the one argument of
# `sh -c`: Linux refuses an argument over 128 kB (MAX_ARG_STRLEN, execve(2)) and the node exits 255 with
# no log. Half of it for the user's text, as quoted, leaves the launch's own words room to spare.
MAX_JOB_TEXT_BYTES = 65_536
# An --env-file is read whole before anything runs; its values fit in MAX_JOB_TEXT_BYTES, so a file far
# bigger is a wrong path (a log, a dataset), refused before it is read.
MAX_ENV_FILE_BYTES = 1_048_576
# A requirements file is read whole and sent to every node: /dev/zero, a pipe or a wheel given by mistake
# would be read for ever or sent as text; the longest lock files are a few hundred kB.
MAX_REQUIREMENTS_BYTES = 4_000_000
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # a folder name: no '/', never '.' or '..'
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
WHOLE_NUMBER = re.compile(r"-?[0-9]{1,18}")  # what int() takes, less its leniency: ' 2', '2\n', '1_0', '٢'
SECONDS = re.compile(r"[0-9]+(\.[0-9]+)?")  # float() would also take ' 30', '30\n', 'nan', 'inf', '1e3'


def refuse(message: str) -> UsageError:
    """The exception for bad input: `raise refuse("...")`."""
    return UsageError(message)


def integer(
    flag: str, value: str | int | None, default: int, minimum: int | None = None, maximum: int | None = None
) -> int:
    """`value` as an int within [minimum, maximum]; `default` when the flag was not given."""
    if value is None:
        return default
    bounds = _bounds(minimum, maximum)
    if not WHOLE_NUMBER.fullmatch(str(value)):  # 18 digits at most: int() refuses 4,300 with its own error
        raise refuse(f"{flag} must be a whole number{bounds}, not {shown(value)}")
    number = int(str(value))
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise refuse(f"{flag} must be a whole number{bounds}, not {number}")
    return number


def _bounds(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" from {minimum} to {maximum}"
    if minimum is not None:
        return f" >= {minimum}"
    return f" <= {maximum}" if maximum is not None else ""


def port(flag: str, value: str | int | None, default: int) -> int:
    return integer(flag, value, default, *PORT_RANGE)


def script_arguments(text: str, plain_only: tuple[str, ...] = (), task: str = "") -> list[str]:
    """`--args "..."` split as a shell would; an unbalanced quote is bad input, not a traceback. With
    `plain_only`, those flags are refused (`refuse_plain_only`: a replica group's run)."""
    try:
        arguments = shlex.split(text or "")
    except ValueError as exc:
        raise refuse(f"--args {text!r} cannot be split into arguments ({exc}): check its quotes") from None
    refuse_plain_only(arguments, plain_only, task)
    return arguments


def refuse_plain_only(arguments: list[str], plain_only: tuple[str, ...], task: str) -> None:
    """Refuse `--args` a replica group's loop does not take (`plain_only`: `--flag`, or `--flag=KEPT` where
    only the value KEPT is taken), as flags, `--flag=value` or argparse's abbreviations of 4+ letters."""
    given = []
    for at, word in enumerate(arguments):
        name, equals, value = word.partition("=")
        if not name.startswith("--") or len(name) < 6:
            continue
        for entry in plain_only:
            flag, _, kept = entry.partition("=")
            if not flag.startswith(name):
                continue
            if kept:
                value = value if equals else (arguments[at + 1] if at + 1 < len(arguments) else "")
                if value == kept:
                    continue
            given.append(flag)
    if given:
        raise refuse(
            f"--args {' '.join(sorted(set(given)))}: {task} --replicas trains in torchft replica groups, which "
            "take no such flag (they train plain DDP only): leave them out, or drop --replicas"
        )


def run_id(value: str) -> str:
    """A run folder's name as `--run` gives it; paths such as `../..` are refused."""
    if not RUN_ID.fullmatch(value):
        raise refuse(f"--run {shown(value)} is not a run id (a folder name under runs/, as fab logs prints it)")
    return value


def compiled_script(value: str | None, workdir: Path | None = None) -> Path:
    """`--script`: a readable Python file that compiles here, so a typo never reaches the nodes.

    With `workdir` (resolved), a path relative to it, which may not lead outside it, by `..` or
    through a link; the path returned is then the one inside the workdir, links not resolved.
    """
    where = " (relative to --workdir)" if workdir else " on this machine"
    if not value:
        raise refuse(f"fab run needs --script PATH: a torchrun-able Python script{where}")
    path = Path(value)
    if workdir is not None:
        path = Path(os.path.normpath(workdir / path))
        if not _inside(path.resolve(), workdir) or not _inside(path, workdir):
            raise refuse(
                f"--script {value} is outside --workdir {workdir}: only the workdir reaches the nodes; "
                "give a path inside it"
            )
    if path.is_dir():
        raise refuse(f"--script {value} is a folder: give the Python file to run")
    if not path.is_file():
        raise refuse(f"no such script: {value}" + (f" in --workdir {workdir}" if workdir else ""))
    try:
        source = path.read_bytes()
    except OSError as exc:
        raise refuse(f"cannot read the script {value}: {exc.strerror or exc}") from None
    try:
        compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        where = f"{exc.filename or value}, line {exc.lineno}" if exc.lineno else (exc.filename or value)
        raise refuse(f"the script does not compile: {where}: {exc.msg}") from None
    except ValueError as exc:  # Python < 3.12 raises this for NUL bytes in the source
        raise refuse(f"the script does not compile: {value}: {exc}") from None
    return path


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def workdir(value: str) -> Path:
    """`--workdir`: an existing folder, resolved ('' is refused: it would mean the current folder)."""
    if not value:
        raise refuse("--workdir '' is empty: give your project's folder (use --workdir . for the current one)")
    path = Path(value).expanduser()
    if not path.exists():
        raise refuse(f"no such folder: --workdir {value}")
    if not path.is_dir():
        raise refuse(f"--workdir {value} is not a folder: give your project's folder (--script is relative to it)")
    return path.resolve()


def environment(pairs: list[str], env_file: str | None = None) -> dict[str, str]:
    """`--env KEY=VALUE`, repeatable, and `--env-file FILE` (dotenv): a variable for every rank, its value
    taken literally. A name given twice, in the file or the flags, is refused; no value is ever shown."""
    found: dict[str, str] = {}
    for variable in _env_file(env_file) if env_file is not None else []:
        _add(found, variable.key, variable.value, f"--env-file {env_file} line {variable.line}:")
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals:
            raise refuse(f"--env {pair!r} is not KEY=VALUE")
        _add(found, key, value, "--env")
    return found


def _add(found: dict[str, str], key: str, value: str, where: str) -> None:
    if not ENV_KEY.fullmatch(key):
        raise refuse(f"{where} {key!r} is not a variable name: letters, digits and '_', not starting with a digit")
    if reserved_variable(key):
        raise refuse(
            f"{where} {key}: the node environment, torchrun or the launch sets {key} itself "
            "(CLUSTER_* and TORCHELASTIC_* included); pick another name"
        )
    if "\0" in value:  # no process can take it in its environment (execve ends a string at NUL)
        raise refuse(f"{where} {key}: the value holds a NUL byte, which no environment variable can carry")
    if key in found:
        raise refuse(f"{where} {key} is given twice (--env and --env-file together count once each)")
    found[key] = value


def _env_file(value: str) -> list[dotenv.Variable]:
    """The file's assignments: a regular file only (a FIFO, /dev/zero or a terminal would never end or
    never start), at most MAX_ENV_FILE_BYTES, UTF-8."""
    if not value:
        raise refuse("--env-file '' is empty: give a file of KEY=VALUE lines")
    try:
        text = _regular_file_text(Path(value).expanduser(), MAX_ENV_FILE_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise refuse(f"no such env file: --env-file {value}") from None
    except IsADirectoryError:
        raise refuse(f"--env-file {value} is a folder: give a file of KEY=VALUE lines") from None
    except NotARegularFile:
        raise refuse(
            f"--env-file {value} is not a regular file (a device, a pipe?): give a file of KEY=VALUE lines"
        ) from None
    except TooBig:
        raise refuse(
            f"--env-file {value} is over {MAX_ENV_FILE_BYTES:,} bytes: give a file of KEY=VALUE lines"
        ) from None
    except UnicodeDecodeError:
        raise refuse(f"--env-file {value} is not UTF-8 text") from None
    except OSError as exc:
        raise refuse(f"cannot read --env-file {value}: {exc.strerror or exc}") from None
    try:
        return dotenv.parse(text)
    except dotenv.DotenvError as exc:
        raise refuse(f"--env-file {value} {exc}") from None


class NotARegularFile(OSError):
    """A path that names a device, a pipe or a socket."""


class TooBig(OSError):
    """A file over the size asked for."""


def _regular_file_text(path: Path, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most `max_bytes`. Opened without blocking (a FIFO's open waits
    for a writer otherwise) and checked on the open file, so what is read is what was checked."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        found = os.fstat(fd)
        if stat.S_ISDIR(found.st_mode):
            raise IsADirectoryError(path)
        if not stat.S_ISREG(found.st_mode):
            raise NotARegularFile(path)
        if found.st_size > max_bytes:
            raise TooBig(path)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew since fstat
        raise TooBig(path)
    return data


NODE_NAME = re.compile(r"node-(0|[1-9][0-9]*)")


def node_name(flag: str, value: str | None) -> str | None:
    """A node as `node-1` or `1` (its rank), as `node-1`; None when the flag was not given."""
    if value is None:
        return None
    name = f"node-{value}" if WHOLE_NUMBER.fullmatch(str(value)) and not str(value).startswith("-") else str(value)
    if not NODE_NAME.fullmatch(name):
        raise refuse(f"{flag} must name a node as node-1 or 1, not {value!r}")
    return name


def megabytes(flag: str, value: str | None, default: int) -> int:
    """A size limit in MB (1 MB = 1,000,000 bytes), as bytes."""
    return integer(flag, value, default, minimum=1) * 1_000_000


def requirements_file(value: str | None) -> Requirements | None:
    """`--requirements`: a pip requirements file on this machine, read now (what is sent is what was checked)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        text = _regular_file_text(path, MAX_REQUIREMENTS_BYTES)
    except FileNotFoundError:
        raise refuse(f"no such requirements file: {value}") from None
    except IsADirectoryError:
        raise refuse(f"--requirements {value} is a folder: give a pip requirements file") from None
    except NotARegularFile:
        raise refuse(
            f"--requirements {value} is not a regular file (a device, a pipe?): give a pip requirements file"
        ) from None
    except TooBig:
        raise refuse(
            f"--requirements {value} is over {MAX_REQUIREMENTS_BYTES:,} bytes: give a pip requirements file"
        ) from None
    except OSError as exc:
        raise refuse(f"cannot read the requirements file {value}: {exc.strerror or exc}") from None
    problem = include_problem(text, value)
    if problem:
        raise refuse(problem)
    return Requirements(path.resolve(), text)


def hang_policy(timeout: str | None, on_hang: str | None, on_straggler: str | None = None):
    """`--hang-timeout S` (seconds, 0 turns the recorder and the watch off), `--on-hang stop|wait` and
    `--on-straggler report|replace` (the verdict rides on the watch: replace needs it on)."""
    from remote.hangwatch import DEFAULT_HANG_TIMEOUT_S, ON_HANG, ON_STRAGGLER, HangPolicy

    seconds = DEFAULT_HANG_TIMEOUT_S if timeout is None else _seconds("--hang-timeout", timeout)
    action = "stop" if on_hang is None else choice("--on-hang", str(on_hang), ON_HANG)
    straggler = "report" if on_straggler is None else choice("--on-straggler", str(on_straggler), ON_STRAGGLER)
    if straggler == "replace" and not seconds:
        raise refuse("--on-straggler replace needs the run's watch, which --hang-timeout 0 turns off: leave one out")
    return HangPolicy(seconds, action, straggler)


def _seconds(flag: str, value: str) -> float:
    seconds = float(value) if SECONDS.fullmatch(str(value)) else float("nan")
    if not 0 <= seconds < float("inf"):  # 400 nines are a float too: inf
        raise refuse(f"{flag} must be a number of seconds >= 0 (0 turns hang detection off), not {shown(value)}")
    return seconds


def choice(flag: str, value: str, allowed: tuple[str, ...]) -> str:
    """`value` when it is one of `allowed`, whole (no stripping: `'slurm\\n'` is refused)."""
    if value not in allowed:
        raise refuse(f"{flag} must be {' or '.join(allowed)}, not {shown(value)}")
    return value


def job_text(args: list[str], env: dict[str, str]) -> None:
    """Refuse `--args` and `--env` that would not fit on the job's command line over SSH."""
    words = [shlex.quote(a) for a in args] + [f"{key}={shlex.quote(value)}" for key, value in env.items()]
    size = sum(len(word.encode()) + 1 for word in words)
    if size > MAX_JOB_TEXT_BYTES:
        given = " and ".join(flag for flag, used in (("--env", env), ("--args", args)) if used)
        raise refuse(
            f"{given} come(s) to {size:,} bytes on the job's command line (quoted), over the limit of "
            f"{MAX_JOB_TEXT_BYTES:,}: put long values in a file of the --workdir and pass its path"
        )
