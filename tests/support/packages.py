"""Packages for tests that install a job's requirements offline (`fab run --requirements`)."""

import base64
import hashlib
import zipfile
from pathlib import Path


def tiny_wheel(folder: Path) -> Path:
    """A wheel of a one-module package, built here with zipfile: no build backend, no network."""
    files = {
        "gc_tinypkg/__init__.py": "MESSAGE = 'tiny package 0.1'\n",
        "gc_tinypkg-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: gc-tinypkg\nVersion: 0.1\n",
        "gc_tinypkg-0.1.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = (
        "".join(
            f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
            f"{len(text)}\n"
            for path, text in files.items()
        )
        + "gc_tinypkg-0.1.dist-info/RECORD,,\n"
    )
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "gc_tinypkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in {**files, "gc_tinypkg-0.1.dist-info/RECORD": record}.items():
            archive.writestr(path, text)
    return wheel
