"""The user data every AWS node boots with: EFS at /shared, the power-off guard, Slurm's programs, a ready marker.

The guard is a systemd timer that powers the node off when the watchdog (harness/watchdog.py, started
on the head node by `fab bootstrap`) writes its stop marker into the shared folder, so a budget or
idle stop reaches every node without SSH between nodes. What power-off means for the instance
(terminate or stop) is the instance's shutdown behaviour, set by the Pulumi program.
"""

from node import contract

SHARED_DIR = "/shared"
SSH_USER = "ubuntu"  # the login of the AMI (the Deep Learning Base AMI on Ubuntu)
READY_MARKER = "/var/lib/gpu-cluster/ready"
STOP_MARKER = f"{SHARED_DIR}/{contract.STOP_MARKER}"
MOUNT_OPTIONS = "nfsvers=4.1,rsize=1048576,wsize=1048576,hard,timeo=600,retrans=2,noresvport"
SCHEDULER_PACKAGES = ("slurm-wlm", "munge")
SCHEDULER_SERVICES = ("munge", "slurmctld", "slurmd")

SCHEDULER_SETUP = f"""\
# Slurm's programs for `fab bootstrap --scheduler slurm` (node/scheduler.py runs its own daemons, as the
# node user, with the cluster's own configuration): the system's services are masked before the
# install so they never start with Ubuntu's defaults. A failed install is logged, never fatal: the node
# serves attached launches, and bootstrap's scheduler stage names what is missing.
systemctl mask {" ".join(SCHEDULER_SERVICES)} >/dev/null 2>&1 || true
if ! {{ command -v slurmctld && command -v slurmd && command -v munged; }} >/dev/null 2>&1; then
  {{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq {" ".join(SCHEDULER_PACKAGES)}; }} \\
    || echo "warning: {" and ".join(SCHEDULER_PACKAGES)} not installed; fab bootstrap --scheduler slurm will fail on this node"
fi
"""


def user_data(efs_dns_name: str, ssh_user: str = "ubuntu") -> str:
    """A bash cloud-init script; safe to run again (every step checks before it acts)."""
    return f"""#!/bin/bash
# gpu-cluster node setup: mount EFS, install the power-off guard, mark ready.
set -euo pipefail
exec >>/var/log/gpu-cluster-init.log 2>&1
echo "gpu-cluster init start $(date -Is)"

command -v mount.nfs4 >/dev/null || {{ apt-get update -qq && apt-get install -y -qq nfs-common; }}
mkdir -p {SHARED_DIR}
# The mount target may take a minute to resolve and answer after the instance boots.
for attempt in $(seq 1 60); do
  mountpoint -q {SHARED_DIR} && break
  mount -t nfs4 -o {MOUNT_OPTIONS} {efs_dns_name}:/ {SHARED_DIR} && break
  echo "EFS not ready (attempt $attempt), retrying in 10 s"; sleep 10
done
mountpoint -q {SHARED_DIR}
grep -q " {SHARED_DIR} " /etc/fstab || echo "{efs_dns_name}:/ {SHARED_DIR} nfs4 {MOUNT_OPTIONS},_netdev,nofail 0 0" >> /etc/fstab
chown {ssh_user}:{ssh_user} {SHARED_DIR}

cat > /usr/local/sbin/gpu-cluster-guard <<'GUARD'
#!/bin/bash
# Power off when the watchdog has decided the cluster must stop (budget or idle).
if [ -f {STOP_MARKER} ]; then
  logger -t gpu-cluster "stop marker found: $(cat {STOP_MARKER}); powering off"
  echo "gpu-cluster-watchdog: $(cat {STOP_MARKER})" > /dev/console
  systemctl poweroff
fi
GUARD
chmod 755 /usr/local/sbin/gpu-cluster-guard
cat > /etc/systemd/system/gpu-cluster-guard.service <<'UNIT'
[Unit]
Description=gpu-cluster power-off guard
[Service]
Type=oneshot
ExecStart=/usr/local/sbin/gpu-cluster-guard
UNIT
cat > /etc/systemd/system/gpu-cluster-guard.timer <<'UNIT'
[Unit]
Description=gpu-cluster power-off guard, every 30 s
[Timer]
OnBootSec=60
OnUnitActiveSec=30
[Install]
WantedBy=timers.target
UNIT
systemctl daemon-reload
systemctl enable --now gpu-cluster-guard.timer

{SCHEDULER_SETUP}
mkdir -p "$(dirname {READY_MARKER})"
date -Is > {READY_MARKER}
echo "gpu-cluster init done $(date -Is)"
"""
