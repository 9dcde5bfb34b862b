"""The cluster's own SSH key and the pinned host keys (`known_hosts`)."""

import os
from pathlib import Path

from infra import state


def ensure_client_key(stack_dir: Path) -> Path:
    """The cluster's ed25519 key (`id_ed25519`, mode 0600, and `.pub`), created once per stack."""
    key_path = stack_dir / state.SSH_KEY
    if not key_path.exists():
        import asyncssh  # loaded where a key is made: `deploy.py cost` or `status` never needs it

        key = asyncssh.generate_private_key("ssh-ed25519", comment=f"gpu-cluster-{stack_dir.name}")
        state.write_atomic(key_path, key.export_private_key().decode(), mode=0o600)
        state.write_atomic(key_path.with_suffix(".pub"), key.export_public_key().decode())
    os.chmod(key_path, 0o600)
    return key_path


def public_key_text(key_path: Path) -> str:
    return key_path.with_suffix(".pub").read_text().strip()


def generate_host_key(path: Path) -> str:
    """A fresh ed25519 host key at `path` (0600); returns its public half, `ssh-ed25519 AAAA...`."""
    import asyncssh

    key = asyncssh.generate_private_key("ssh-ed25519")
    state.write_atomic(path, key.export_private_key().decode(), mode=0o600)
    return key.export_public_key().decode().strip()


def known_hosts_entry(address: str, port: int, public_key: str) -> str:
    """One `known_hosts` line, in OpenSSH's `[host]:port` form when the port is not 22."""
    host = address if port == 22 else f"[{address}]:{port}"
    key_type, key_body = public_key.split()[:2]
    return f"{host} {key_type} {key_body}"


def write_known_hosts(path: Path, entries: list[str]) -> None:
    state.write_atomic(path, "".join(line + "\n" for line in entries), mode=0o600)
