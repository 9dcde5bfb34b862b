"""`drill spot` on AWS: the FIS experiment it starts, against Stubber (moto has no FIS)."""

import boto3
import pytest
from botocore.stub import ANY, Stubber

from infra import spot_fis
from infra.errors import UsageError

ROLE = "arn:aws:iam::123456789012:role/fis-spot"


def clients():
    session = boto3.Session(region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    return session.client("ec2"), session.client("fis")


def instances(lifecycle: str | None = "spot") -> dict:
    instance = {"InstanceId": "i-0abc", "State": {"Name": "running"}}
    if lifecycle:
        instance["InstanceLifecycle"] = lifecycle
    return {"Reservations": [{"OwnerId": "123456789012", "Instances": [instance]}]}


FILTERS = [
    {"Name": "tag:gpu-cluster:stack", "Values": ["dev"]},
    {"Name": "tag:gpu-cluster:node", "Values": ["node-1"]},
    {"Name": "instance-state-name", "Values": ["running"]},
]


def test_the_experiment_interrupts_the_nodes_spot_instance_after_the_notice():
    ec2, fis = clients()
    with Stubber(ec2) as ec2_stub, Stubber(fis) as fis_stub:
        ec2_stub.add_response("describe_instances", instances(), {"Filters": FILTERS})
        expected = {
            "clientToken": ANY,
            "description": "gpu-cluster drill spot dev node-1",
            "stopConditions": [{"source": "none"}],
            "targets": {
                "node": {
                    "resourceType": "aws:ec2:spot-instance",
                    "resourceArns": ["arn:aws:ec2:us-east-1:123456789012:instance/i-0abc"],
                    "selectionMode": "ALL",
                }
            },
            "actions": {
                "interrupt": {
                    "actionId": "aws:ec2:send-spot-instance-interruptions",
                    "parameters": {"durationBeforeInterruption": "PT3M"},
                    "targets": {"SpotInstances": "node"},
                }
            },
            "roleArn": ROLE,
            "tags": {"gpu-cluster:stack": "dev", "gpu-cluster:node": "node-1"},
        }
        fis_stub.add_response("create_experiment_template", {"experimentTemplate": {"id": "EXT1"}}, expected)
        fis_stub.add_response(
            "start_experiment",
            {"experiment": {"id": "EXP1"}},
            {"clientToken": ANY, "experimentTemplateId": "EXT1", "tags": ANY},
        )
        assert spot_fis.interrupt(ec2, fis, "dev", "node-1", "us-east-1", 180, ROLE) == "EXP1"
        fis_stub.assert_no_pending_responses()


def test_an_on_demand_node_is_refused_before_fis_is_asked():
    ec2, fis = clients()
    with Stubber(ec2) as ec2_stub, Stubber(fis):
        ec2_stub.add_response("describe_instances", instances(lifecycle=None), {"Filters": FILTERS})
        with pytest.raises(UsageError, match="on-demand instance: .*up --spot"):
            spot_fis.interrupt(ec2, fis, "dev", "node-1", "us-east-1", 120, ROLE)


def test_a_node_without_a_running_instance_is_refused():
    ec2, fis = clients()
    with Stubber(ec2) as ec2_stub, Stubber(fis):
        ec2_stub.add_response("describe_instances", {"Reservations": []}, {"Filters": FILTERS})
        with pytest.raises(UsageError, match="node-1 has no running instance"):
            spot_fis.interrupt(ec2, fis, "dev", "node-1", "us-east-1", 120, ROLE)


@pytest.mark.parametrize("notice_s", [3, 60, 150, 960])
def test_notice_outside_what_fis_gives_is_refused(notice_s):
    with pytest.raises(UsageError, match="2 to 15 whole minutes"):
        spot_fis.check_notice(notice_s)
