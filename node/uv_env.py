"""Installing a node environment's packages: with uv where it runs, else with pip, saying why.

Used by the node venv (python_env.py, bootstrap's deps stage) and by each `--requirements` env
(job_env.py). uv is the `uv` wheel (requirements-node.txt pins it), found beside the interpreter or in the bin
folder of a layer below it (the local provider's nodes find the project's own), else pip-installed into
the node venv by the deps stage. Its cache is node-local (`contract.UV_CACHE`, in the home folder, on
the same filesystem as the venvs: uv copies every file across filesystems, so never the shared folder).

Two things uv does unlike pip, handled here:
- uv reads no pip configuration: what pip on this node would use (its config files, `PIP_*`) is passed
  on as uv's variables (`uv_environment`), so uv reaches the registries pip does and no other.
- uv does not see packages of a layer below the venv (`--system-site-packages`, our `.pth` layer) and
  would install torch again. So the requirements are resolved first (`uv pip compile`, preferring the
  versions the layers have), and only what the layers lack is installed (`--no-deps`), as pip would.

Standard library only.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

PIP_TO_UV = {
    "index-url": "UV_INDEX_URL",
    "extra-index-url": "UV_EXTRA_INDEX_URL",
    "find-links": "UV_FIND_LINKS",
    "constraint": "UV_CONSTRAINT",
    "trusted-host": "UV_INSECURE_HOST",
    "cert": "SSL_CERT_FILE",
    "default-timeout": "UV_HTTP_TIMEOUT",
    "timeout": "UV_HTTP_TIMEOUT",
}
"""pip's setting -> uv's variable (values that are lists keep pip's whitespace separation)."""
COMMA_LISTS = ("UV_FIND_LINKS",)
"""uv's variables whose list is comma-separated."""


def pip_config_files(environ: dict, home: str) -> list:
    """The files pip reads, lowest precedence first (pip's `configuration.py`: global, user, site, env)."""
    xdg = environ.get("XDG_CONFIG_DIRS") or "/etc/xdg"
    files = [os.path.join(d, "pip", "pip.conf") for d in reversed(xdg.split(":")) if d] + ["/etc/pip.conf"]
    files += [os.path.join(home, ".pip", "pip.conf")]
    files += [os.path.join(environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config"), "pip", "pip.conf")]
    files += [os.path.join(sys.prefix, "pip.conf")]
    if environ.get("PIP_CONFIG_FILE") and environ["PIP_CONFIG_FILE"] != os.devnull:
        files.append(environ["PIP_CONFIG_FILE"])
    return files


def pip_settings(environ: dict | None = None, home: str | None = None) -> dict:
    """What pip on this node would use: its config files' `[global]` and `[install]`, then `PIP_*`."""
    environ = dict(os.environ if environ is None else environ)
    home = home or os.path.expanduser("~")
    settings: dict = {}
    if environ.get("PIP_CONFIG_FILE") != os.devnull:
        for path in pip_config_files(environ, home):
            parser = configparser.RawConfigParser()
            try:
                parser.read(path)
            except (configparser.Error, UnicodeDecodeError):
                continue
            for section in ("global", "install"):
                if parser.has_section(section):
                    settings.update({key: " ".join(value.split()) for key, value in parser.items(section)})
    for name, value in environ.items():
        if name.startswith("PIP_") and name != "PIP_CONFIG_FILE":
            settings[name[4:].lower().replace("_", "-")] = " ".join(value.split())
    return settings


def uv_environment(settings: dict, cache: str, environ: dict | None = None) -> dict:
    """uv's variables for pip's `settings`: the registries pip reaches, pip's choice among indexes (the best
    match anywhere), the node-local `cache`; a uv variable already set is left as it is."""
    environ = dict(os.environ if environ is None else environ)
    wanted = {"UV_CACHE_DIR": cache, "UV_INDEX_STRATEGY": "unsafe-best-match", "UV_PYTHON_DOWNLOADS": "never"}
    wanted["UV_NO_PROGRESS"] = "1"
    for key, value in settings.items():
        variable = PIP_TO_UV.get(key)
        if variable and value:
            wanted[variable] = ",".join(value.split()) if variable in COMMA_LISTS else value
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        wanted["UV_NO_INDEX"] = "1"
    return {**environ, **{k: v for k, v in wanted.items() if k not in environ}}


def find_uv(python: str) -> tuple:
    """(uv's path, '') where uv runs for `python`'s environments, else (None, why not)."""
    folders = [os.path.dirname(python), os.path.dirname(sys.executable)]
    for entry in sys.path:
        if os.path.basename(entry) in ("site-packages", "dist-packages"):
            folders.append(os.path.normpath(os.path.join(entry, os.pardir, os.pardir, os.pardir, "bin")))
    found = next((os.path.join(f, "uv") for f in folders if os.access(os.path.join(f, "uv"), os.X_OK)), None)
    found = found or shutil.which("uv")
    if found is None:
        return None, "no uv on this node"
    try:
        answer = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{found} does not run ({exc})"
    if answer.returncode != 0:
        return None, f"{found} does not run ({(answer.stderr.strip() or f'exit {answer.returncode}')[-200:]})"
    return found, ""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def layer_packages(python: str) -> dict:
    """{canonical name: version} of every distribution `python` sees (its own and its layers')."""
    code = (
        "import json, importlib.metadata as m\n"
        "seen = {}\n"
        "for d in m.distributions():\n"
        "    name = d.metadata['Name']\n"
        "    if name: seen.setdefault(name, d.version)\n"
        "print(json.dumps(seen))\n"
    )
    answer = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return {canonical(name): version for name, version in json.loads(answer.stdout).items()}


def pinned_lines(compiled: str, have: dict) -> list:
    """The resolved requirements the layers do not already satisfy, behind the index options uv used
    (`--no-index` where it used none: uv emits no line for it)."""
    options, wanted = [], []
    for line in compiled.splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            options.append(line)
            continue
        name, _, version = line.partition("==")
        if version and have.get(canonical(name.split("[")[0].strip())) == version.split(";")[0].strip():
            continue
        wanted.append(line)
    if not any(o.startswith(("--index-url", "-i ")) for o in options):
        options.append("--no-index")
    return options + wanted if wanted else []


def uv_install(uv: str, python: str, requirements: str, cwd: str, log, environ: dict) -> None:
    """`requirements` (a file, read as pip would from `cwd`) into `python`'s venv with uv; CalledProcessError
    where uv fails (its output in `log`)."""
    with open(requirements) as f:
        text = f.read()
    have = layer_packages(python)
    compile_ = [uv, "pip", "compile", "-", "--python", python, "--quiet", "--no-header", "--no-annotate"]
    compile_ += ["--emit-index-url", "--emit-find-links"]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as prefer:
        prefer.write("".join(f"{name}=={version}\n" for name, version in sorted(have.items())))
    try:
        resolved = _run(compile_ + ["--constraint", prefer.name], text, cwd, log, environ, check=False)
        if resolved.returncode != 0:  # the file needs other versions than the layers': pip installs them too
            log.write("gpu-cluster: the layers' versions do not fit; resolving without them\n")
            resolved = _run(compile_, text, cwd, log, environ)
    finally:
        os.unlink(prefer.name)
    pins = pinned_lines(resolved.stdout, have)
    if pins:
        _run(
            [uv, "pip", "install", "-r", "-", "--python", python, "--no-deps"],
            "\n".join(pins) + "\n",
            cwd,
            log,
            environ,
        )


def _run(argv: list, stdin: str, cwd: str, log, environ: dict, check: bool = True):
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    answer = subprocess.run(argv, input=stdin, stdout=subprocess.PIPE, stderr=log, text=True, cwd=cwd, env=environ)
    log.write(answer.stdout)
    log.flush()
    if check and answer.returncode != 0:
        raise subprocess.CalledProcessError(answer.returncode, argv)
    return answer


def install(python: str, requirements: str, cwd: str, log, cache: str, ensure_pip) -> dict:
    """`requirements` into `python`'s venv: with uv where it runs, else with pip (`ensure_pip(python)`
    first), saying so in `log`; which installer, and why not uv. CalledProcessError where it fails."""
    uv, why = find_uv(python)
    if uv is not None:
        uv_install(uv, python, requirements, cwd, log, uv_environment(pip_settings(), cache))
        return {"installer": "uv", "installer_why": ""}
    log.write(f"gpu-cluster: {why}: installing with pip\n")
    log.flush()
    ensure_pip(python)
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "-r", requirements]
    subprocess.run(pip, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, check=True)
    return {"installer": "pip", "installer_why": why}


if __name__ == "__main__":
    print(json.dumps(pip_settings()))
