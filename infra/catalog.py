"""The one instance catalog: which EC2 types are supported and what each one is.

The catalog is a data file, `harness/catalog.json`, not a table in this module: the harness runs on the
nodes, may import only torch, nvidia-ml-py and the standard library (never `infra/`), and needs the GPU
peaks for model FLOPs utilisation. Bootstrap's code sync ships `harness/` to every node, so the harness
reads the very file that config validation, preflight, pricing and plan read here; there is no second
copy to drift. Prices stay in `infra/prices.json` (dated, per region); the catalog says for each type
whether that table has its price or only the AWS Price List API knows it, and a test holds the two
files to that.
"""

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from infra.errors import UsageError

CATALOG_PATH = Path(__file__).resolve().parent.parent / "harness" / "catalog.json"
QUOTA_FAMILIES = ("G", "P")


@dataclass(frozen=True)
class InstanceType:
    """One supported EC2 instance type."""

    name: str
    """The EC2 name, e.g. g4dn.2xlarge."""
    gpu: str
    """The GPU model, a key of the catalog's peak table (T4, A10G, L4, ...)."""
    gpus: int
    """GPUs per node: torchrun starts one process per GPU."""
    vcpus: int
    """vCPUs per node, what the running-instance quota counts."""
    quota_family: str
    """`G` (Running On-Demand G and VT instances) or `P` (... P instances)."""
    bundled_price: bool
    """True when infra/prices.json has its price; False when only the Price List API prices it."""


@functools.cache
def _document() -> dict:
    return json.loads(CATALOG_PATH.read_text(encoding="utf-8"))


def instance_types() -> dict[str, InstanceType]:
    """Every supported type, by name, in catalog order."""
    return {name: InstanceType(name, **facts) for name, facts in _document()["instance_types"].items()}


def gpu_peak_tflops() -> dict[str, dict[str, float]]:
    """GPU model -> precision -> dense datasheet peak TFLOP/s."""
    return _document()["gpu_peak_tflops"]


def families() -> list[str]:
    """The type families, in catalog order: g4dn, g5, ..."""
    return list(dict.fromkeys(name.split(".")[0] for name in instance_types()))


def lookup(name: str) -> InstanceType:
    """The catalog's entry for `name`; one line naming what is supported when it has none."""
    found = instance_types().get(name) if isinstance(name, str) else None
    if found is None:
        raise UsageError(
            f"instance type {name!r} is not supported (not in {CATALOG_PATH.parent.name}/{CATALOG_PATH.name}): "
            f"use one of its {', '.join(families())} types, e.g. g4dn.2xlarge"
        )
    return found
