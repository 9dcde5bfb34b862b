"""The Pulumi program (Pulumi.yaml: `main: infra/`): `pulumi up` and `python deploy.py up` both run it.

Run through `deploy.py`, sshCidr and sshPublicKey are filled in for you (your IP /32, the cluster's own
key); with plain `pulumi up`, set them: `pulumi config set gpu-cluster:sshCidr 203.0.113.7/32` and
`pulumi config set gpu-cluster:sshPublicKey "$(cat ~/.ssh/id_ed25519.pub)"`. The cost-allocation tag is
activated only with `gpu-cluster:costAllocationTagSeen true`, which `deploy.py up` sets once Cost Explorer
lists the key (set it yourself once Billing > Cost allocation tags lists `gpu-cluster:stack`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # Pulumi runs this folder as a script

import pulumi  # noqa: E402

from infra import config as stack_config  # noqa: E402
from infra.cluster import build, export_outputs  # noqa: E402


def read_config() -> stack_config.StackConfig:
    namespace = pulumi.Config(stack_config.NAMESPACE)
    raw = {key: namespace.get(key) for key in stack_config.CONFIG_KEYS}
    raw["region"] = pulumi.Config("aws").get("region")
    config = stack_config.validate(pulumi.get_stack(), raw)
    missing = [
        key for key, value in (("sshCidr", config.ssh_cidr), ("sshPublicKey", config.ssh_public_key)) if not value
    ]
    if missing:
        raise pulumi.RunError(
            f"set gpu-cluster:{' and gpu-cluster:'.join(missing)} (python deploy.py up sets them for you)"
        )
    return config


export_outputs(build(read_config()))
