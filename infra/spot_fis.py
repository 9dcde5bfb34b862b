"""`deploy.py drill spot` on AWS: an AWS FIS experiment that sends one instance a spot interruption.

FIS's `aws:ec2:send-spot-instance-interruptions` posts the rebalance recommendation and the
instance-action notice on the instance's metadata service, then interrupts it after
`durationBeforeInterruption` (2 to 15 minutes), as EC2 would
(https://docs.aws.amazon.com/fis/latest/userguide/fis-actions-reference.html#send-spot-instance-interruptions).
It needs an IAM role FIS may assume with `ec2:SendSpotInstanceInterruptions` and `ec2:DescribeInstances`,
and the caller needs `fis:CreateExperimentTemplate`, `fis:StartExperiment` and `iam:PassRole` on it.
"""

import secrets

from infra.errors import UsageError
from infra.tags import NODE_TAG, STACK_TAG

ACTION_ID = "aws:ec2:send-spot-instance-interruptions"
MIN_NOTICE_S = 120
MAX_NOTICE_S = 900


def check_notice(notice_s: float) -> str:
    """`durationBeforeInterruption` for FIS (ISO 8601 minutes); UsageError outside FIS's range."""
    if not MIN_NOTICE_S <= notice_s <= MAX_NOTICE_S or notice_s % 60:
        raise UsageError(
            f"--notice {notice_s:g}: FIS interrupts 2 to 15 whole minutes after its notice (120, 180, ... 900 s)"
        )
    return f"PT{int(notice_s) // 60}M"


def spot_instance_arn(ec2, stack: str, node: str, region: str) -> str:
    """The ARN of `node`'s running spot instance; UsageError where it has none."""
    filters = [
        {"Name": f"tag:{STACK_TAG}", "Values": [stack]},
        {"Name": f"tag:{NODE_TAG}", "Values": [node]},
        {"Name": "instance-state-name", "Values": ["running"]},
    ]
    for reservation in ec2.describe_instances(Filters=filters)["Reservations"]:
        for instance in reservation["Instances"]:
            if instance.get("InstanceLifecycle") != "spot":
                raise UsageError(
                    f"{node} ({instance['InstanceId']}) is an on-demand instance: spot interruptions need "
                    f"a cluster made with python deploy.py up --spot"
                )
            return f"arn:aws:ec2:{region}:{reservation['OwnerId']}:instance/{instance['InstanceId']}"
    raise UsageError(f"{node} has no running instance in stack {stack!r}: python deploy.py status shows the nodes")


def template_request(instance_arn: str, role_arn: str, duration: str, stack: str, node: str) -> dict:
    """create_experiment_template's arguments: one action on one instance, no stop condition."""
    return {
        "clientToken": secrets.token_hex(16),
        "description": f"gpu-cluster drill spot {stack} {node}",
        "stopConditions": [{"source": "none"}],
        "targets": {
            "node": {"resourceType": "aws:ec2:spot-instance", "resourceArns": [instance_arn], "selectionMode": "ALL"}
        },
        "actions": {
            "interrupt": {
                "actionId": ACTION_ID,
                "parameters": {"durationBeforeInterruption": duration},
                "targets": {"SpotInstances": "node"},
            }
        },
        "roleArn": role_arn,
        "tags": {STACK_TAG: stack, NODE_TAG: node},
    }


def interrupt(ec2, fis, stack: str, node: str, region: str, notice_s: float, role_arn: str) -> str:
    """Start the experiment; its id."""
    duration = check_notice(notice_s)
    arn = spot_instance_arn(ec2, stack, node, region)
    template = fis.create_experiment_template(**template_request(arn, role_arn, duration, stack, node))
    started = fis.start_experiment(
        clientToken=secrets.token_hex(16),
        experimentTemplateId=template["experimentTemplate"]["id"],
        tags={STACK_TAG: stack, NODE_TAG: node},
    )
    return started["experiment"]["id"]
