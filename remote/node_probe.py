"""What a node is: OS, Python, GPUs, driver and CUDA, and the interface that routes to MASTER_ADDR.

Sent by `fab bootstrap` and run on the node as `python -c <this file> MASTER_ADDR`; standard library
only (nothing is installed yet when it runs). Prints one JSON object.
"""

import json
import platform
import re
import shutil
import subprocess
import sys


def run(*argv: str) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def gpus() -> dict:
    if not shutil.which("nvidia-smi"):
        return {"gpus": [], "driver": None, "cuda": None}
    rows = run("nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits")
    found = [dict(zip(("name", "memory_mib", "driver"), (c.strip() for c in row.split(",")))) for row in rows.splitlines() if row.strip()]
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", run("nvidia-smi"))
    return {"gpus": found, "driver": found[0]["driver"] if found else None, "cuda": cuda.group(1) if cuda else None}


def route_interface(address: str) -> str | None:
    """The interface the kernel would use to reach `address` (never guessed from names)."""
    if shutil.which("ip"):
        match = re.search(r"\bdev\s+(\S+)", run("ip", "route", "get", address))
        if match:
            return match.group(1)
    if shutil.which("route"):  # macOS / BSD
        match = re.search(r"interface:\s*(\S+)", run("route", "-n", "get", address))
        if match:
            return match.group(1)
    return None


def distro() -> str:
    try:
        return platform.freedesktop_os_release().get("PRETTY_NAME", "")
    except (OSError, AttributeError):  # not Linux, or Python before 3.10
        return ""


def main() -> None:
    master_addr = sys.argv[1]
    facts = {
        "os": f"{platform.system()} {platform.release()}",
        "distro": distro(),
        "python": platform.python_version(),
        "interface": route_interface(master_addr),
        **gpus(),
    }
    print(json.dumps(facts))


main()
