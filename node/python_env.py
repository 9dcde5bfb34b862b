"""The node venv: layered over an interpreter that may already have torch, topped up only where needed.

    PYTHON python_env.py DEST REQUIREMENTS     # run BY the interpreter to layer over; prints one JSON object

The venv is made with `--system-site-packages` and without pip (a second or so). Where PYTHON is
itself a venv or a conda env, `--system-site-packages` would see only the base interpreter's
packages, so a `.pth` file in the new venv names PYTHON's own site-packages too. Then: where torch
is missing, pip installs REQUIREMENTS whole; where only the smaller packages are missing, just
those (a CUDA build of torch the image has is never replaced). Standard library only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import venv

if not __package__:  # run as a file (`python node/python_env.py`): its siblings from the code folder
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from node import contract, uv_env  # noqa: E402

LAYER_PTH = "_gpu_cluster_layer.pth"
# requirement name -> the module it provides
MODULES = {"torch": "torch", "nvidia-ml-py": "pynvml", "matplotlib": "matplotlib", "rich": "rich"}
# requirement name -> the program it installs (beside an interpreter whose site-packages hold it)
PROGRAMS = {"py-spy": "py-spy"}


def is_layered_env() -> bool:
    """A venv, or a conda env: packages that `--system-site-packages` over it would not see."""
    return sys.prefix != sys.base_prefix or os.path.isdir(os.path.join(sys.prefix, "conda-meta"))


def own_site_packages() -> list:
    found = site.getsitepackages() + [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    return [p for i, p in enumerate(found) if p not in found[:i] and os.path.isdir(p)]


def venv_site_packages(dest: str) -> str:
    return sysconfig.get_path("purelib", vars={"base": dest, "platbase": dest})


def create(dest: str) -> bool:
    """Make the venv unless it is there and built over this interpreter; True if it was made."""
    config = os.path.join(dest, "pyvenv.cfg")
    home = os.path.dirname(getattr(sys, "_base_executable", sys.executable))
    try:
        with open(config) as f:
            if f"home = {home}\n" in f.read() and os.path.exists(os.path.join(dest, "bin", "python")):
                return False
    except OSError:
        pass
    venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True, clear=True).create(dest)
    return True


def layer_paths() -> list:
    """This interpreter's own site-packages, then what its own layer file names: a venv layered over
    this one sees everything this one does, however many layers deep (a `.pth` file's folders are
    added to sys.path, but `.pth` files in them are not read)."""
    paths = own_site_packages()
    for folder in list(paths):
        try:
            with open(os.path.join(folder, LAYER_PTH)) as f:
                paths += [line.strip() for line in f if line.strip() and line.strip() not in paths]
        except OSError:
            continue
    return paths


def write_layer(dest: str) -> None:
    path = os.path.join(venv_site_packages(dest), LAYER_PTH)
    if is_layered_env():
        with open(path, "w") as f:
            f.write("".join(p + "\n" for p in layer_paths()))
    elif os.path.exists(path):
        os.unlink(path)


def missing_requirements() -> list:
    """Run inside the venv: the requirements whose module or program it cannot find (nothing is imported)."""
    missing = [name for name, module in MODULES.items() if importlib.util.find_spec(module) is None]
    return missing + [name for name, program in PROGRAMS.items() if find_program(program) is None]


def find_program(name: str):
    """A program installed with the packages this interpreter sees: beside it, or in the bin folder of
    any environment whose site-packages are on its path (the layered venv's base), else on PATH."""
    folders = [os.path.dirname(sys.executable)]
    for entry in sys.path:
        if os.path.basename(entry) in ("site-packages", "dist-packages"):
            folders.append(os.path.join(entry, os.pardir, os.pardir, os.pardir, "bin"))
    for folder in folders:
        candidate = os.path.normpath(os.path.join(folder, name))
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which(name)


def facts() -> dict:
    """Run inside the venv: what it has (torch's version and CUDA, the missing requirements). Without an
    NVIDIA driver (no nvidia-smi) CUDA cannot be available, and torch's version is read from its
    metadata: importing torch costs seconds of CPU, and the health stage imports it anyway."""
    missing = missing_requirements()
    found: dict[str, object] = {"torch": None, "cuda_available": False, "nccl": None, "missing": missing}
    if "torch" in missing:
        return found
    if shutil.which("nvidia-smi") is None and (version := _distribution_version("torch")):
        found["torch"] = version
    else:
        import torch

        found.update(torch=torch.__version__, cuda_available=torch.cuda.is_available())
        if found["cuda_available"]:
            found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return found


def _distribution_version(name: str):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def in_venv(python: str, mode: str):
    """This file's `mode` run by the venv's interpreter; its JSON answer."""
    result = subprocess.run([python, os.path.abspath(__file__), mode], stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def ensure_pip(python: str) -> None:
    if (
        subprocess.run(
            [python, "-m", "pip", "--version"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        ).returncode
        == 0
    ):
        return
    if subprocess.run([python, "-m", "ensurepip", "--default-pip"], stdout=subprocess.DEVNULL).returncode == 0:
        return
    # Debian and Ubuntu ship ensurepip apart, in python3.X-venv; install it where sudo needs no password.
    package = f"python{sys.version_info[0]}.{sys.version_info[1]}-venv"
    installed = (
        subprocess.run(
            ["sudo", "-n", "apt-get", "install", "-y", "-qq", package],
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        ).returncode
        == 0
    )
    if not installed or subprocess.run([python, "-m", "ensurepip", "--default-pip"]).returncode != 0:
        sys.exit(
            f"{sys.executable} has no pip or ensurepip: install {package} (or set python: to an interpreter "
            "that has torch)"
        )


def requirement_lines(path: str) -> list:
    with open(path) as f:
        return [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]


def top_up(python: str, requirements: str, missing: list) -> tuple:
    """Install what is missing: everything where torch is, else only the missing packages; with uv (the
    file's `uv` line pip-installed first where the node has none), else with pip, saying why uv could
    not. (the lines installed, {installer, installer_why})."""
    lines = requirement_lines(requirements)
    wanted = lines if "torch" in missing else [line for line in lines if _name(line) in missing]
    wanted = [line for line in wanted if _name(line) != "uv"]
    uv, why = uv_env.find_uv(python)
    installed = []
    if uv is None and (uv_lines := [line for line in lines if _name(line) == "uv"]):
        try:
            ensure_pip(python)
            subprocess.run(_pip(python) + uv_lines, check=True, stdout=sys.stderr)
            installed += uv_lines
            uv, why = uv_env.find_uv(python)
        except subprocess.CalledProcessError as exc:
            why = f"uv could not be installed with pip (exit {exc.returncode})"
    how = {"installer": "uv" if uv else "pip", "installer_why": why}
    if not wanted:
        return installed, how
    if uv is None:
        print(f"gpu-cluster: {why}: installing with pip", file=sys.stderr, flush=True)
        ensure_pip(python)
        subprocess.run(_pip(python) + wanted, check=True, stdout=sys.stderr)
        return installed + wanted, how
    cache = os.path.join(os.path.expanduser("~"), contract.UV_CACHE)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as listed:
        listed.write("".join(line + "\n" for line in wanted))
    try:
        environ = uv_env.uv_environment(uv_env.pip_settings(), cache)
        uv_env.uv_install(uv, python, listed.name, os.path.dirname(requirements), sys.stderr, environ)
    finally:
        os.unlink(listed.name)
    return installed + wanted, how


def _pip(python: str) -> list:
    return [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]


def _name(requirement: str) -> str:
    for separator in ("==", ">=", "<=", "~=", "<", ">", "["):
        requirement = requirement.split(separator)[0]
    return requirement.strip().lower()


def main(argv: list) -> None:
    if argv == ["--facts"]:
        print(json.dumps(facts()))
        return
    if argv == ["--missing"]:
        print(json.dumps(missing_requirements()))
        return
    if len(argv) != 2:
        sys.exit("usage: PYTHON python_env.py DEST REQUIREMENTS")
    dest, requirements = os.path.abspath(os.path.expanduser(argv[0])), os.path.expanduser(argv[1])
    created = create(dest)
    write_layer(dest)
    python = os.path.join(dest, "bin", "python")
    installed, how = top_up(python, requirements, in_venv(python, "--missing"))
    found = in_venv(python, "--facts")
    if found["missing"]:
        sys.exit(f"{python} still lacks {', '.join(found['missing'])} after installing {requirements}")
    print(
        json.dumps(
            {
                **found,
                "python": python,
                "over": sys.executable,
                "created": created,
                "layered": is_layered_env(),
                "installed": installed,
                **how,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
