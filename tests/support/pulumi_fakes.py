"""The Pulumi CLI for tests: a PulumiCommand that records what the Automation API asks of it and answers
as the CLI would, with no capacity in the zones a test names."""

import json

from pulumi.automation._cmd import CommandResult, PulumiCommand
from pulumi.automation.errors import create_command_error
from semver import VersionInfo

HISTORY = json.dumps(
    [
        {
            "kind": "update",
            "startTime": "2026-11-21T00:00:00.000Z",
            "endTime": "2026-11-21T00:01:00.000Z",
            "message": "",
            "environment": {},
            "config": {},
            "result": "succeeded",
            "resourceChanges": {},
        }
    ]
)
OUTPUTS = {
    "nodes": [{"name": "node-0", "public_ip": "203.0.113.10", "private_ip": "10.42.1.10"}],
    "region": "us-east-1",
}


class FakePulumi(PulumiCommand):
    """Records every CLI invocation; `up` fails for zones listed in `no_capacity`."""

    def __init__(self, no_capacity=(), pending=()):
        self.command, self.version = "pulumi", VersionInfo.parse("3.200.0")
        self.calls: list[list[str]] = []
        self.config: dict[str, str] = {}
        self.no_capacity, self.pending = set(no_capacity), list(pending)
        self.imported = None

    def run(self, args, cwd, additional_env, on_output=None, on_error=None):
        self.calls.append(list(args))
        self.env = dict(additional_env)
        stdout, stderr, code = "", "", 0
        if args[:2] == ["config", "set-all"]:
            for pair in args[args.index("--plaintext") :]:
                if "=" in pair:
                    key, value = pair.split("=", 1)
                    self.config[key] = value
        elif args[:2] == ["config", "set"]:
            self.config[args[2]] = args[3]
        elif args[0] == "up":
            if self.config.get("gpu-cluster:availabilityZone") in self.no_capacity:
                stderr = (
                    "error: creating EC2 Instance: InsufficientInstanceCapacity: "
                    "We currently do not have sufficient g4dn.2xlarge capacity"
                )
                code = 255
            elif on_output:
                on_output("Updating (dev)\n")
        elif args[:2] == ["stack", "output"]:
            stdout = json.dumps(OUTPUTS)
        elif args[:2] == ["stack", "history"]:
            stdout = HISTORY
        elif args[:2] == ["stack", "export"]:
            stdout = json.dumps({"version": 3, "deployment": {"pending_operations": self.pending, "resources": []}})
        elif args[:2] == ["stack", "import"]:
            self.imported = json.loads(open(args[args.index("--file") + 1]).read())
        result = CommandResult(stdout, stderr, code)
        if code:
            raise create_command_error(result)
        return result

    def commands(self) -> list[str]:
        return [" ".join(c[:2]) if c[0] in ("stack", "config") else c[0] for c in self.calls]
