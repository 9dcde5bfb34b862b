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
INSTANCE_ID_FILE = "/var/lib/cloud/data/instance-id"
"""cloud-init's record of the instance it runs on (written at every boot of a new instance)."""
STOP_MARKER = f"{SHARED_DIR}/{contract.STOP_MARKER}"
MOUNT_OPTIONS = "nfsvers=4.1,rsize=1048576,wsize=1048576,hard,timeo=600,retrans=2,noresvport"
SCHEDULER_PACKAGES = ("slurm-wlm", "munge", "slurmdbd", "mariadb-server")
"""Slurm, and its accounting (slurmdbd over MariaDB: node/slurm_accounting.py, on the head node)."""
SCHEDULER_SERVICES = ("munge", "slurmctld", "slurmd", "slurmdbd", "mariadb")

SCHEDULER_SETUP = f"""\
# Slurm's programs for `fab bootstrap --scheduler slurm` (node/scheduler.py runs its own daemons, as the
# node user, with the cluster's own configuration): the system's services are masked before the
# install so they never start with Ubuntu's defaults. A failed install is logged, never fatal: the node
# serves attached launches, and bootstrap's scheduler stage names what is missing.
systemctl mask {" ".join(SCHEDULER_SERVICES)} >/dev/null 2>&1 || true
if ! {{ command -v slurmctld && command -v slurmd && command -v munged && command -v slurmdbd && command -v mariadbd; }} \
    >/dev/null 2>&1; then
  {{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq {" ".join(SCHEDULER_PACKAGES)}; }} \\
    || echo "warning: {", ".join(SCHEDULER_PACKAGES)} not installed; fab bootstrap --scheduler slurm will fail on this node"
fi
"""


NODE_ADDRESSES = f"{SHARED_DIR}/{contract.NODE_ADDRESSES}"
JOIN_KIT = f"{SHARED_DIR}/{contract.JOIN_KIT}"
JOIN_LOG = "/var/log/gpu-cluster-join.log"
HOSTS_BEGIN = "# gpu-cluster nodes (from the shared folder)"
HOSTS_END = "# end of gpu-cluster nodes"


IMDS_ADDRESS = (
    'token=$(curl -sf -X PUT -H "X-aws-ec2-metadata-token-ttl-seconds: 60" http://169.254.169.254/latest/api/token)'
    ' && curl -sf -H "X-aws-ec2-metadata-token: $token" http://169.254.169.254/latest/meta-data/local-ipv4'
)
"""This instance's private address, as EC2 gives it (IMDSv2): `hostname -I` may name a docker bridge first."""


def named_node_setup(node: str, ssh_user: str) -> str:
    """For a cluster whose workers come back at new addresses (spot workers in Auto Scaling groups): the
    host takes the node's name, writes its address to the shared folder, and keeps /etc/hosts mapping every
    node's name to its address now (Slurm looks the names up at each connection). The shared state
    folder is the node user's (0700): root made here, the watchdog and bootstrap could not write there."""
    return f"""
# This node is {node}: Slurm knows the nodes by name, and a replacement comes back at a new address.
install -d -o {ssh_user} -g {ssh_user} -m 700 {SHARED_DIR}/{contract.SHARED_STATE}
hostnamectl set-hostname {node} || hostname {node}
address=$({IMDS_ADDRESS})
mkdir -p {NODE_ADDRESSES}
echo "$address" > {NODE_ADDRESSES}/.{node}.tmp && mv {NODE_ADDRESSES}/.{node}.tmp {NODE_ADDRESSES}/{node}
cat > /usr/local/sbin/gpu-cluster-hosts <<'HOSTS'
#!/bin/bash
# /etc/hosts maps every node's name to the address it wrote into the shared folder. The new file replaces
# the old whole (a name must never be missing while Slurm looks it up).
block=$(for f in {NODE_ADDRESSES}/node-*; do [ -f "$f" ] && echo "$(cat "$f") $(basename "$f")"; done)
current=$(sed -n '/^{HOSTS_BEGIN}$/,/^{HOSTS_END}$/p' /etc/hosts | sed '1d;$d')
[ "$block" = "$current" ] && exit 0
sed '/^{HOSTS_BEGIN}$/,/^{HOSTS_END}$/d' /etc/hosts > /etc/.hosts.gpu-cluster
printf '%s\\n%s\\n%s\\n' "{HOSTS_BEGIN}" "$block" "{HOSTS_END}" >> /etc/.hosts.gpu-cluster
chmod 644 /etc/.hosts.gpu-cluster && mv /etc/.hosts.gpu-cluster /etc/hosts
HOSTS
chmod 755 /usr/local/sbin/gpu-cluster-hosts
cat > /etc/systemd/system/gpu-cluster-hosts.service <<'UNIT'
[Unit]
Description=gpu-cluster node names in /etc/hosts
[Service]
Type=oneshot
ExecStart=/usr/local/sbin/gpu-cluster-hosts
UNIT
cat > /etc/systemd/system/gpu-cluster-hosts.timer <<'UNIT'
[Unit]
Description=gpu-cluster node names in /etc/hosts, every 10 s
[Timer]
OnBootSec=5
OnUnitActiveSec=10
AccuracySec=1
[Install]
WantedBy=timers.target
UNIT
systemctl daemon-reload
/usr/local/sbin/gpu-cluster-hosts
systemctl enable --now gpu-cluster-hosts.timer
"""


def stop_at_boot() -> str:
    """A worker that boots while the cluster is stopping (the watchdog's marker) powers off at once, before
    it installs anything: its group started it in place of one that powered itself off."""
    return f"""
if [ -f {STOP_MARKER} ]; then
  echo "the cluster is stopping ($(cat {STOP_MARKER})): powering off"; systemctl poweroff; exit 0
fi
"""


def own_power_off(node: str) -> str:
    """The guard's check for a worker: power off on this node's power-off marker written since the machine
    booted (a run's batch job names it a straggler, `--on-straggler replace`); its Auto Scaling group then
    replaces it as it replaces a reclaimed spot instance (a spot instance's shutdown terminates it)."""
    marker = f"{SHARED_DIR}/{contract.power_off_marker(node)}"
    return f"""
if [ -f {marker} ] && [ "$(stat -c %Y {marker})" -ge "$(date -d "$(uptime -s)" +%s)" ]; then
  logger -t gpu-cluster "power-off marker found: $(cat {marker}); powering off to be replaced"
  systemctl poweroff
fi"""


def worker_join(node: str, ssh_user: str) -> str:
    """A replacement worker joins by itself: where bootstrap left its join kit in the shared folder, the node
    user runs node/join.py (the venv, the env file, slurmd) from a unit that tries again every 30 s until it
    passes (the head node may be being replaced too). A first boot before any bootstrap has nothing to
    join."""
    return f"""
cat > /etc/systemd/system/gpu-cluster-join.service <<'UNIT'
[Unit]
Description=gpu-cluster: join the cluster as {node} from the shared folder
After=network-online.target remote-fs.target
StartLimitIntervalSec=0
[Service]
Type=oneshot
User={ssh_user}
WorkingDirectory=~
ExecStart=/usr/bin/python3 {SHARED_DIR}/code/node/join.py --node {node}
StandardOutput=append:{JOIN_LOG}
StandardError=append:{JOIN_LOG}
Restart=on-failure
RestartSec=30
UNIT
systemctl daemon-reload
if [ -f {JOIN_KIT} ]; then
  echo "joining the cluster as {node} from {JOIN_KIT} (log: {JOIN_LOG})"
  systemctl start --no-block gpu-cluster-join.service
else
  echo "no join kit yet: fab bootstrap prepares this node"
fi
"""


SCALE_IN_GRACE_S = 300
"""How long the head's guard keeps trying to scale the worker groups to zero before it powers off anyway."""


def scale_in_first(groups_file: str, region: str) -> str:
    """The head node's guard, before it powers off: the worker groups go to zero (each would otherwise start
    a new worker in place of one that powered itself off). The head's instance role may do only this, and
    only to groups tagged with its stack. Where it fails, the guard tries again at its next run and powers
    off anyway after SCALE_IN_GRACE_S (a head left up would bill on)."""
    return f"""
  if [ -f {groups_file} ]; then
    failed=0
    while read -r group; do
      [ -n "$group" ] || continue
      aws autoscaling update-auto-scaling-group --region {region} --auto-scaling-group-name "$group" \\
        --min-size 0 --max-size 0 --desired-capacity 0 \\
        || {{ failed=1; logger -t gpu-cluster "could not scale $group to zero"; }}
    done < {groups_file}
    age=$(( $(date +%s) - $(stat -c %Y {STOP_MARKER}) ))
    if [ "$failed" = 1 ] && [ "$age" -lt {SCALE_IN_GRACE_S} ]; then
      exit 0  # tried again at the next run
    fi
  fi"""


WORKER_GROUPS_FILE = "/etc/gpu-cluster/worker-groups"


ONLY_THIS_KEY = (
    'token=$(curl -sf -X PUT -H "X-aws-ec2-metadata-token-ttl-seconds: 60" http://169.254.169.254/latest/api/token)'
    ' && key=$(curl -sf -H "X-aws-ec2-metadata-token: $token"'
    " http://169.254.169.254/latest/meta-data/public-keys/0/openssh-key)"
    ' && [ -n "$key" ] && install -d -o {user} -g {user} -m 700 {home}/.ssh'
    " && printf '%s\\n' \"$key\" > {home}/.ssh/authorized_keys.new"
    " && chown {user}:{user} {home}/.ssh/authorized_keys.new && chmod 600 {home}/.ssh/authorized_keys.new"
    " && mv {home}/.ssh/authorized_keys.new {home}/.ssh/authorized_keys || true"
)
"""This instance's key (IMDSv2) as the login's only authorized key; left as it is where IMDS does not say."""


def user_data(
    efs_dns_name: str,
    ssh_user: str = "ubuntu",
    node: str | None = None,
    worker_groups: list[str] | tuple[str, ...] = (),
    region: str = "",
) -> str:
    """A bash cloud-init script; safe to run again (every step checks before it acts). With `node`, the
    node is known by name (its workers move); a worker (not node-0) joins from the shared folder at boot;
    with `worker_groups`, the head's guard scales those Auto Scaling groups to zero before powering off."""
    named, joins, power_off = "", "", ""
    if node:
        worker = node != "node-0"
        named = (stop_at_boot() if worker else "") + named_node_setup(node, ssh_user)
        joins = worker_join(node, ssh_user) if worker else ""
        power_off = own_power_off(node) if worker else ""
    groups = ""
    scale_in = ""
    if worker_groups:
        listed = "\n".join(worker_groups)
        groups = f"mkdir -p {WORKER_GROUPS_FILE.rsplit('/', 1)[0]}\nprintf '%s\\n' '{listed}' > {WORKER_GROUPS_FILE}\n"
        scale_in = scale_in_first(WORKER_GROUPS_FILE, region)
    return f"""#!/bin/bash
# gpu-cluster node setup: mount EFS, install the power-off guard, mark ready.
set -euo pipefail
exec >>/var/log/gpu-cluster-init.log 2>&1
echo "gpu-cluster init start $(date -Is)"
# A node booted from an image of another cluster's head node must not run that cluster's watchdog
# (bootstrap starts this cluster's own on node-0).
systemctl disable --now {contract.WATCHDOG_UNIT} >/dev/null 2>&1 || true
# Only this cluster's key logs in: an image carries the keys of the node it was made from, and cloud-init
# adds this instance's key (IMDSv2's public-keys/0) beside them rather than in their place.
{ONLY_THIS_KEY.format(home=f"/home/{ssh_user}", user=ssh_user)}

command -v mount.nfs4 >/dev/null || {{ apt-get update -qq && apt-get install -y -qq nfs-common; }}
mkdir -p {SHARED_DIR}
# The instance boots while its mount target is still being created (a minute or more): mount it as soon as
# it resolves and answers, trying every 2 s for up to 10 minutes.
for attempt in $(seq 1 300); do
  mountpoint -q {SHARED_DIR} && break
  mount -t nfs4 -o {MOUNT_OPTIONS} {efs_dns_name}:/ {SHARED_DIR} 2>/dev/null && break
  [ $((attempt % 15)) -eq 0 ] && echo "EFS not ready after $((attempt * 2)) s, still trying"
  sleep 2
done
mountpoint -q {SHARED_DIR}
# This cluster's EFS, in place of any other: an image of another cluster's node carries that one's line.
grep -qF "{efs_dns_name}:/ {SHARED_DIR} " /etc/fstab || {{
  sed -i '\\| {SHARED_DIR} nfs4 |d' /etc/fstab
  echo "{efs_dns_name}:/ {SHARED_DIR} nfs4 {MOUNT_OPTIONS},_netdev,nofail 0 0" >> /etc/fstab
}}
chown {ssh_user}:{ssh_user} {SHARED_DIR}
{named}{groups}
cat > /usr/local/sbin/gpu-cluster-guard <<'GUARD'
#!/bin/bash
# Power off when the watchdog has decided the cluster must stop (budget or idle).
if [ -f {STOP_MARKER} ]; then{scale_in}
  logger -t gpu-cluster "stop marker found: $(cat {STOP_MARKER}); powering off"
  echo "gpu-cluster-watchdog: $(cat {STOP_MARKER})" > /dev/console
  systemctl poweroff
fi{power_off}
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
# The marker names this instance: one booted from an image of another node finds that node's marker here.
{{ cat {INSTANCE_ID_FILE}; date -Is; }} > {READY_MARKER}
{joins}echo "gpu-cluster init done $(date -Is)"
"""
