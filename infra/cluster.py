"""The Pulumi program's resources: one ComponentResource per concept.

    ClusterNetwork   a dedicated VPC, one public subnet in a zone that offers the type, IGW, routes
    SharedStorage    encrypted EFS (elastic throughput), its mount target, NFS only from the nodes
    GpuCluster       both of the above, the node security group, a cluster placement group, the key
                     pair and the instances (IMDSv2, encrypted gp3 root, optional spot); with spot, each
                     worker is an Auto Scaling group of one (replaced by EC2 when reclaimed or dead); the
                     stack tag activated as a cost-allocation tag once billing lists it (kept at destroy: the
                     account's, shared)

Every resource that takes tags is tagged `gpu-cluster:stack` = the stack and `Name`, which is how
`deploy.py down` proves nothing is left behind. No resource is created inside `apply()`.
"""

import base64
import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra import cloud_init
from infra.cloud_init import SSH_USER
from infra.config import StackConfig
from infra.tags import NODE_TAG, STACK_TAG

ROOT_DEVICE = "/dev/sda1"  # the root device of Ubuntu's AMIs, the DLAMI's included
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
        if config.cost_allocation_tag and config.cost_allocation_tag_seen:
            # The stack tag as a cost-allocation tag, so the bill can be filtered by stack (`cost --reconcile`).
            # Only once billing lists the key (preflight asked): AWS refuses to activate one it has not seen
            # yet, which would fail the `up` half-way (hashicorp/terraform-provider-aws#29068).
            # The key is the account's, shared by every stack: `down` leaves it active for the others.
            aws.costexplorer.CostAllocationTag(
                f"{name}-cost-tag",
                tag_key=STACK_TAG,
                status="Active",
                opts=pulumi.ResourceOptions(parent=self, retain_on_delete=True),
            )
        dns_name = self.storage.file_system.dns_name
        self.worker_groups: list[aws.autoscaling.Group] = []
        if config.spot:
            # Spot: each worker is an Auto Scaling group of one, so a reclaimed or dead worker is replaced
            # with nobody connected; the replacement joins from EFS at boot (cloud_init.worker_join). The
            # head node keeps its fixed address (MASTER_ADDR, slurmctld); its guard scales the groups to
            # zero before it powers off, which its instance role allows for this stack's groups only.
            self.worker_groups = [
                self._worker_group(name, i, args.ami_id, dns_name.apply(_named_user_data(f"node-{i}")))
                for i in range(1, config.nodes)
            ]
            groups = pulumi.Output.all(*[group.name for group in self.worker_groups])
            head_data = pulumi.Output.all(dns_name, groups).apply(
                lambda found: cloud_init.user_data(
                    found[0], node="node-0", worker_groups=list(found[1]), region=config.region
                )
            )
            self.instances = [self._node(name, 0, args.ami_id, head_data, self._scaler_profile(name, child))]
        else:
            user_data = dns_name.apply(cloud_init.user_data)
            self.instances = [self._node(name, i, args.ami_id, user_data) for i in range(config.nodes)]
        head = pulumi.Output.all(
            *[pulumi.Output.all(i.id, i.public_ip, i.private_ip, i.availability_zone) for i in self.instances]
        )
        group_names = pulumi.Output.all(*[group.name for group in self.worker_groups])
        self.nodes = pulumi.Output.all(head, group_names).apply(
            lambda found: (
                [
                    {"name": f"node-{k}", "instance_id": r[0], "public_ip": r[1], "private_ip": r[2], "zone": r[3]}
                    for k, r in enumerate(found[0])
                ]
                + [{"name": f"node-{k}", "group": g} for k, g in enumerate(found[1], start=len(found[0]))]
            )
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

    def _scaler_profile(self, name: str, child: pulumi.ResourceOptions) -> aws.iam.InstanceProfile:
        """The head node's role: it may set this stack's worker groups' sizes to zero, nothing else."""
        stack = self.config.stack
        role = aws.iam.Role(
            f"{name}-head",
            assume_role_policy=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [
                        {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}
                    ],
                }
            ),
            tags=tags_for(stack, f"{name}-head"),
            opts=child,
        )
        aws.iam.RolePolicy(
            f"{name}-scale-workers",
            role=role.id,
            policy=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [
                        {
                            "Effect": "Allow",
                            "Action": "autoscaling:UpdateAutoScalingGroup",
                            "Resource": "*",
                            # To zero only: a process on the head that reads these credentials cannot
                            # start workers with them.
                            "Condition": {
                                "StringEquals": {f"autoscaling:ResourceTag/{STACK_TAG}": stack},
                                "NumericEquals": {
                                    "autoscaling:MinSize": 0,
                                    "autoscaling:MaxSize": 0,
                                    "autoscaling:DesiredCapacity": 0,
                                },
                            },
                        }
                    ],
                }
            ),
            opts=child,
        )
        return aws.iam.InstanceProfile(f"{name}-head", role=role.name, tags=tags_for(stack, f"{name}-head"), opts=child)

    def _node_tags(self, index: int) -> dict[str, str]:
        stack = self.config.stack
        return tags_for(stack, f"{stack}-node-{index}", **{NODE_TAG: f"node-{index}"})

    def _worker_group(self, name: str, index: int, ami_id, user_data) -> aws.autoscaling.Group:
        """A spot worker as an Auto Scaling group of one: EC2 starts a new one when it is reclaimed or dies.
        Not capacity rebalancing: it would end the old worker on its own schedule, a run with it, when the
        notice would have let the run save; and one node name is one instance at a time."""
        config = self.config
        node_tags = self._node_tags(index)
        template = aws.ec2.LaunchTemplate(
            f"{name}-node-{index}",
            image_id=ami_id,
            instance_type=config.instance_type,
            key_name=self.key_pair.key_name,
            instance_initiated_shutdown_behavior="terminate",  # a spot instance can only terminate
            user_data=pulumi.Output.from_input(user_data).apply(lambda text: base64.b64encode(text.encode()).decode()),
            instance_market_options=aws.ec2.LaunchTemplateInstanceMarketOptionsArgs(
                market_type="spot",
                spot_options=aws.ec2.LaunchTemplateInstanceMarketOptionsSpotOptionsArgs(
                    spot_instance_type="one-time", instance_interruption_behavior="terminate"
                ),
            ),
            metadata_options=aws.ec2.LaunchTemplateMetadataOptionsArgs(
                http_endpoint="enabled", http_tokens="required", http_put_response_hop_limit=1
            ),
            block_device_mappings=[
                aws.ec2.LaunchTemplateBlockDeviceMappingArgs(
                    device_name=ROOT_DEVICE,
                    ebs=aws.ec2.LaunchTemplateBlockDeviceMappingEbsArgs(
                        volume_type="gp3",
                        volume_size=config.root_volume_gb,
                        encrypted="true",
                        delete_on_termination="true",
                    ),
                )
            ],
            network_interfaces=[
                aws.ec2.LaunchTemplateNetworkInterfaceArgs(
                    device_index=0,
                    subnet_id=self.network.subnet.id,
                    security_groups=[self.node_group.id],
                    associate_public_ip_address="true",
                    delete_on_termination="true",
                )
            ],
            placement=aws.ec2.LaunchTemplatePlacementArgs(group_name=self.placement_group.name),
            tag_specifications=[
                aws.ec2.LaunchTemplateTagSpecificationArgs(resource_type=kind, tags=node_tags)
                for kind in ("instance", "volume")
            ],
            tags=node_tags,
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=["image_id"]),
        )
        return aws.autoscaling.Group(
            f"{name}-node-{index}",
            min_size=1,
            max_size=1,
            desired_capacity=1,
            vpc_zone_identifiers=[self.network.subnet.id],
            launch_template=aws.autoscaling.GroupLaunchTemplateArgs(
                id=template.id, version=template.latest_version.apply(str)
            ),
            health_check_type="EC2",
            capacity_rebalance=False,
            force_delete=True,  # destroy ends its instance with it
            wait_for_capacity_timeout="0",  # `up` waits for the instance itself, with progress
            tags=[
                aws.autoscaling.GroupTagArgs(key=key, value=value, propagate_at_launch=False)
                for key, value in node_tags.items()
            ],
            # No wait for the mount target (a minute or more to become available): the instance boots
            # meanwhile, and cloud-init mounts EFS as soon as it answers.
            opts=pulumi.ResourceOptions(parent=self),
        )

    def _node(self, name: str, index: int, ami_id, user_data, profile=None) -> aws.ec2.Instance:
        config = self.config
        node_tags = self._node_tags(index)
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
            iam_instance_profile=profile.name if profile is not None else None,
            instance_initiated_shutdown_behavior=config.shutdown_behavior,
            user_data=user_data,
            user_data_replace_on_change=True,
            tags=node_tags,
            volume_tags=node_tags,
            # A newer AMI published later must not replace a running node.
            # No wait for the mount target either (cloud-init mounts EFS once it answers).
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=["ami"]),
        )


def build(config: StackConfig) -> GpuCluster:
    """The whole program for a validated config: AMI and zone looked up unless the config pins them."""
    ami_id = config.ami_id or aws.ssm.get_parameter_output(name=DLAMI_PARAMETER).value
    zone = config.availability_zone or aws.ec2.get_instance_type_offerings_output(
        location_type="availability-zone",
        filters=[aws.ec2.GetInstanceTypeOfferingsFilterArgs(name="instance-type", values=[config.instance_type])],
    ).locations.apply(_first_zone(config))
    return GpuCluster(config.stack, GpuClusterArgs(config, ami_id, zone))


def _named_user_data(node: str):
    def render(dns_name: str) -> str:
        return cloud_init.user_data(dns_name, node=node)

    return render


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
