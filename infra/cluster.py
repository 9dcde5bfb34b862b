"""The Pulumi program's resources: one ComponentResource per concept.

    ClusterNetwork   a dedicated VPC, one public subnet in a zone that offers the type, IGW, routes
    SharedStorage    encrypted EFS (elastic throughput), its mount target, NFS only from the nodes
    GpuCluster       both of the above, the node security group, a cluster placement group, the key
                     pair and the instances (IMDSv2, encrypted gp3 root, optional spot)

Every resource that takes tags is tagged `gpu-cluster:stack` = the stack and `Name`, which is how
`deploy.py down` proves nothing is left behind. No resource is created inside `apply()`.
"""

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra import cloud_init
from infra.cloud_init import SSH_USER
from infra.config import StackConfig

STACK_TAG = "gpu-cluster:stack"
VPC_CIDR = "10.42.0.0/16"
SUBNET_CIDR = "10.42.1.0/24"
FIRST_NODE_HOST = 10  # node i is 10.42.1.(10+i): ascending addresses put global rank 0 on node-0
DLAMI_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"


def node_private_ip(index: int) -> str:
    return f"10.42.1.{FIRST_NODE_HOST + index}"


def tags_for(stack: str, name: str, **extra: str) -> dict[str, str]:
    return {STACK_TAG: stack, "Name": name, **extra}


# ------------------------------------------------------------------------------------------ network


@dataclass
class NetworkArgs:
    """Where the cluster's network goes."""

    stack: str
    """Tags every resource."""
    availability_zone: pulumi.Input[str]
    """The one zone of the subnet (a zone that offers the instance type)."""


class ClusterNetwork(pulumi.ComponentResource):
    """A VPC of the cluster's own, so teardown never touches anything the user had."""

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-cluster:index:ClusterNetwork", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = lambda suffix: tags_for(args.stack, f"{name}-{suffix}")  # noqa: E731
        self.vpc = aws.ec2.Vpc(
            f"{name}-vpc",
            cidr_block=VPC_CIDR,
            enable_dns_support=True,
            enable_dns_hostnames=True,
            tags=tags("vpc"),
            opts=child,
        )
        self.gateway = aws.ec2.InternetGateway(f"{name}-igw", vpc_id=self.vpc.id, tags=tags("igw"), opts=child)
        self.subnet = aws.ec2.Subnet(
            f"{name}-subnet",
            vpc_id=self.vpc.id,
            cidr_block=SUBNET_CIDR,
            availability_zone=args.availability_zone,
            map_public_ip_on_launch=True,
            tags=tags("subnet"),
            opts=child,
        )
        self.route_table = aws.ec2.RouteTable(
            f"{name}-routes",
            vpc_id=self.vpc.id,
            routes=[aws.ec2.RouteTableRouteArgs(cidr_block="0.0.0.0/0", gateway_id=self.gateway.id)],
            tags=tags("routes"),
            opts=child,
        )
        aws.ec2.RouteTableAssociation(
            f"{name}-routes-subnet", subnet_id=self.subnet.id, route_table_id=self.route_table.id, opts=child
        )
        self.register_outputs({"vpc_id": self.vpc.id, "subnet_id": self.subnet.id})


# ------------------------------------------------------------------------------------------ storage


@dataclass
class StorageArgs:
    """Where the shared file system is mounted from."""

    stack: str
    """Tags every resource."""
    vpc_id: pulumi.Input[str]
    """The cluster's VPC."""
    subnet_id: pulumi.Input[str]
    """The subnet its mount target lives in."""
    client_security_group_id: pulumi.Input[str]
    """The only group allowed to reach NFS (the nodes)."""


class SharedStorage(pulumi.ComponentResource):
    """EFS at /shared on every node: encrypted, elastic throughput, NFS from the nodes only."""

    def __init__(self, name: str, args: StorageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-cluster:index:SharedStorage", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.security_group = aws.ec2.SecurityGroup(
            f"{name}-nfs",
            vpc_id=args.vpc_id,
            description="gpu-cluster EFS: NFS from the cluster's nodes only",
            tags=tags_for(args.stack, f"{name}-nfs"),
            opts=child,
        )
        aws.vpc.SecurityGroupIngressRule(
            f"{name}-nfs-from-nodes",
            security_group_id=self.security_group.id,
            referenced_security_group_id=args.client_security_group_id,
            ip_protocol="tcp",
            from_port=2049,
            to_port=2049,
            description="NFS from the nodes",
            tags=tags_for(args.stack, f"{name}-nfs-from-nodes"),
            opts=child,
        )
        self.file_system = aws.efs.FileSystem(
            f"{name}-efs",
            encrypted=True,
            throughput_mode="elastic",
            performance_mode="generalPurpose",
            tags=tags_for(args.stack, f"{name}-efs"),
            opts=child,
        )
        self.mount_target = aws.efs.MountTarget(
            f"{name}-efs-mount",
            file_system_id=self.file_system.id,
            subnet_id=args.subnet_id,
            security_groups=[self.security_group.id],
            opts=child,
        )
        self.register_outputs({"file_system_id": self.file_system.id, "dns_name": self.file_system.dns_name})


# ------------------------------------------------------------------------------------------ cluster


@dataclass
class GpuClusterArgs:
    """The cluster to build: the validated stack config plus what is looked up at deploy time."""

    config: StackConfig
    """Validated stack config (nodes, type, sshCidr, spot, ...)."""
    ami_id: pulumi.Input[str]
    """The image every node boots."""
    availability_zone: pulumi.Input[str]
    """The zone of the subnet and placement group."""


class GpuCluster(pulumi.ComponentResource):
    """N GPU nodes in a cluster placement group on a private network, with shared storage."""

    def __init__(self, name: str, args: GpuClusterArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-cluster:index:GpuCluster", name, None, opts)
        self.config = config = args.config
        child = pulumi.ResourceOptions(parent=self)
        self.network = ClusterNetwork(f"{name}-net", NetworkArgs(config.stack, args.availability_zone), opts=child)
        self.node_group = self._node_security_group(name, child)
        self.storage = SharedStorage(
            f"{name}-shared",
            StorageArgs(config.stack, self.network.vpc.id, self.network.subnet.id, self.node_group.id),
            opts=child,
        )
        self.placement_group = aws.ec2.PlacementGroup(
            f"{name}-placement", strategy="cluster", tags=tags_for(config.stack, f"{name}-placement"), opts=child
        )
        self.key_pair = aws.ec2.KeyPair(
            f"{name}-key", public_key=config.ssh_public_key, tags=tags_for(config.stack, f"{name}-key"), opts=child
        )
        user_data = self.storage.file_system.dns_name.apply(cloud_init.user_data)
        self.instances = [self._node(name, i, args.ami_id, user_data) for i in range(config.nodes)]
        self.nodes = pulumi.Output.all(
            *[pulumi.Output.all(i.id, i.public_ip, i.private_ip, i.availability_zone) for i in self.instances]
        ).apply(
            lambda rows: [
                {"name": f"node-{k}", "instance_id": r[0], "public_ip": r[1], "private_ip": r[2], "zone": r[3]}
                for k, r in enumerate(rows)
            ]
        )
        self.register_outputs({"nodes": self.nodes, "efs_id": self.storage.file_system.id})

    def _node_security_group(self, name: str, child: pulumi.ResourceOptions) -> aws.ec2.SecurityGroup:
        """SSH only from sshCidr; everything between members (NCCL, gloo, rendezvous); nothing else in."""
        stack = self.config.stack
        group = aws.ec2.SecurityGroup(
            f"{name}-nodes",
            vpc_id=self.network.vpc.id,
            description="gpu-cluster nodes: SSH from the operator, all traffic between nodes",
            tags=tags_for(stack, f"{name}-nodes"),
            opts=child,
        )
        cidr = self.config.ssh_cidr
        if cidr is None:  # `up` and `plan` resolve it (the caller's /32) before the program runs
            raise ValueError("sshCidr is not set")
        address = {"cidr_ipv6": cidr} if ":" in cidr else {"cidr_ipv4": cidr}
        aws.vpc.SecurityGroupIngressRule(
            f"{name}-ssh",
            security_group_id=group.id,
            ip_protocol="tcp",
            from_port=22,
            to_port=22,
            description="SSH from the operator",
            **address,
            tags=tags_for(stack, f"{name}-ssh"),
            opts=child,
        )
        aws.vpc.SecurityGroupIngressRule(
            f"{name}-intra-cluster",
            security_group_id=group.id,
            ip_protocol="-1",
            referenced_security_group_id=group.id,
            description="all traffic between the cluster's nodes",
            tags=tags_for(stack, f"{name}-intra-cluster"),
            opts=child,
        )
        aws.vpc.SecurityGroupEgressRule(
            f"{name}-egress",
            security_group_id=group.id,
            ip_protocol="-1",
            cidr_ipv4="0.0.0.0/0",
            description="out to anywhere (packages, EFS)",
            tags=tags_for(stack, f"{name}-egress"),
            opts=child,
        )
        return group

    def _node(self, name: str, index: int, ami_id, user_data) -> aws.ec2.Instance:
        config = self.config
        node_tags = tags_for(config.stack, f"{config.stack}-node-{index}", **{"gpu-cluster:node": f"node-{index}"})
        market = None
        if config.spot:
            market = aws.ec2.InstanceInstanceMarketOptionsArgs(
                market_type="spot",
                spot_options=aws.ec2.InstanceInstanceMarketOptionsSpotOptionsArgs(
                    spot_instance_type="one-time", instance_interruption_behavior="terminate"
                ),
            )
        return aws.ec2.Instance(
            f"{name}-node-{index}",
            ami=ami_id,
            instance_type=config.instance_type,
            subnet_id=self.network.subnet.id,
            private_ip=node_private_ip(index),
            associate_public_ip_address=True,
            vpc_security_group_ids=[self.node_group.id],
            key_name=self.key_pair.key_name,
            placement_group=self.placement_group.name,
            metadata_options=aws.ec2.InstanceMetadataOptionsArgs(
                http_endpoint="enabled", http_tokens="required", http_put_response_hop_limit=1
            ),
            root_block_device=aws.ec2.InstanceRootBlockDeviceArgs(
                volume_type="gp3", volume_size=config.root_volume_gb, encrypted=True, delete_on_termination=True
            ),
            instance_market_options=market,
            instance_initiated_shutdown_behavior=config.shutdown_behavior,
            user_data=user_data,
            user_data_replace_on_change=True,
            tags=node_tags,
            volume_tags=node_tags,
            # A newer AMI published later must not replace a running node.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.storage.mount_target], ignore_changes=["ami"]),
        )


def build(config: StackConfig) -> GpuCluster:
    """The whole program for a validated config: AMI and zone looked up unless the config pins them."""
    ami_id = config.ami_id or aws.ssm.get_parameter_output(name=DLAMI_PARAMETER).value
    zone = config.availability_zone or aws.ec2.get_instance_type_offerings_output(
        location_type="availability-zone",
        filters=[aws.ec2.GetInstanceTypeOfferingsFilterArgs(name="instance-type", values=[config.instance_type])],
    ).locations.apply(_first_zone(config))
    return GpuCluster(config.stack, GpuClusterArgs(config, ami_id, zone))


def _first_zone(config: StackConfig):
    def pick(zones: list[str]) -> str:
        if not zones:
            raise ValueError(f"{config.instance_type} is not offered in any zone of {config.region}")
        return sorted(zones)[0]

    return pick


def export_outputs(cluster: GpuCluster) -> None:
    config = cluster.config
    pulumi.export("nodes", cluster.nodes)
    pulumi.export("region", config.region)
    pulumi.export("instance_type", config.instance_type)
    pulumi.export("ssh_user", SSH_USER)
    pulumi.export("shared_dir", cloud_init.SHARED_DIR)
    pulumi.export("efs_id", cluster.storage.file_system.id)
    pulumi.export("efs_dns_name", cluster.storage.file_system.dns_name)
    pulumi.export("vpc_id", cluster.network.vpc.id)
    pulumi.export("security_group_id", cluster.node_group.id)
    pulumi.export("placement_group", cluster.placement_group.name)
    pulumi.export("availability_zone", cluster.network.subnet.availability_zone)
