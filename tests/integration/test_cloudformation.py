"""The CloudFormation template: cfn-lint and checkov (static), its security properties read from
the template, and a deployment to a moto server (``moto_server`` on 127.0.0.1: CloudFormation,
EC2, IAM, S3 cannot run here) whose outputs the ec2 backend then launches instances from.

moto builds the VPC, subnet, security groups and their ingress rule, the KMS key, the bucket
with its encryption, the IAM role with its inline policy, the instance profile and the launch
template; it does not apply a bucket's public access block, lifecycle or policy, and has no
placement group: those are checked in the template itself (and by checkov).
"""
import json
import os
import subprocess
import sys
import urllib.parse

import boto3
import pytest
from cfnlint.decode import decode_str
from infra.cluster import ClusterSpec, provision
from tests.integration.moto_server import moto_server
from testkit import REPO

pytestmark = pytest.mark.integration

TEMPLATE = os.path.join(REPO, "infra", "cloudformation", "mxpipe-cluster.yaml")
BIN = os.path.dirname(sys.executable)
# checkov with its PyPI update check stubbed out; --skip-download stops its Prisma Cloud calls.
CHECKOV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkov_offline.py")


@pytest.fixture(scope="module")
def template():
    with open(TEMPLATE) as fh:
        tpl, errors = decode_str(fh.read())
    assert not errors
    return tpl["Resources"]


def test_cfn_lint_passes():
    out = subprocess.run([os.path.join(BIN, "cfn-lint"), TEMPLATE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_checkov_passes():
    # --skip-download: checkov must not call home (this machine has no network, CI neither).
    out = subprocess.run([sys.executable, CHECKOV, "-f", TEMPLATE, "--framework", "cloudformation",
                          "--compact", "--quiet", "--skip-download", "--output", "json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    summary = json.loads(out.stdout)["summary"]
    assert summary["failed"] == 0 and summary["passed"] >= 30, summary


def test_template_security_properties(template):
    bucket = template["ArtifactBucket"]["Properties"]
    assert all(bucket["PublicAccessBlockConfiguration"].values()) and len(bucket["PublicAccessBlockConfiguration"]) == 4
    sse = bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]["ServerSideEncryptionByDefault"]
    assert sse["SSEAlgorithm"] == "aws:kms"
    rules = {r["Id"]: r for r in bucket["LifecycleConfiguration"]["Rules"]}
    assert "ExpirationInDays" in rules["expire-run-artifacts"] and "AbortIncompleteMultipartUpload" in rules[
        "abort-incomplete-uploads"]
    # ps-lite ports only from members of the cluster's own security group; no SSH, no CIDR.
    ingress = [r for r in template.values() if r["Type"] == "AWS::EC2::SecurityGroupIngress"]
    assert [r["Properties"]["SourceSecurityGroupId"] for r in ingress] == [{"Ref": "ClusterSecurityGroup"}]
    assert "SecurityGroupIngress" not in template["ClusterSecurityGroup"]["Properties"]
    # The instance role reaches only its prefix of the bucket.
    statements = template["InstanceRole"]["Properties"]["Policies"][0]["PolicyDocument"]["Statement"]
    s3_objects = next(s for s in statements if s["Sid"] == "ReadWriteTheRunPrefix")
    assert s3_objects["Resource"] == {"Fn::Sub": "${ArtifactBucket.Arn}/${ArtifactPrefix}/*"}
    records = next(s for s in statements if s["Sid"] == "ReadWriteTheClusterRecords")
    assert records["Resource"] == {"Fn::Sub": "${ArtifactBucket.Arn}/clusters/*"}
    data = template["LaunchTemplate"]["Properties"]["LaunchTemplateData"]
    assert data["MetadataOptions"]["HttpTokens"] == "required"
    assert data["BlockDeviceMappings"][0]["Ebs"]["Encrypted"] is True
    assert template["PlacementGroup"]["Properties"]["Strategy"] == "cluster"


def test_deploys_to_moto_and_the_ec2_backend_launches_from_its_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with moto_server(str(tmp_path)) as url:
        kw = {"region_name": "us-east-1", "endpoint_url": url}
        cfn, ec2, s3, iam = (boto3.client(s, **kw) for s in ("cloudformation", "ec2", "s3", "iam"))
        ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        with open(TEMPLATE) as fh:
            body = fh.read()
        params = {"ImageId": ami, "ArtifactBucketName": "mxpipe-artifacts-test", "AvailabilityZone": "us-east-1a",
                  "CodeUri": "s3://mxpipe-artifacts-test/runs/mxnet_training/code/mxpipe.tar.gz"}
        cfn.create_stack(StackName="mxpipe", TemplateBody=body, Capabilities=["CAPABILITY_IAM"],
                         Parameters=[{"ParameterKey": k, "ParameterValue": v} for k, v in params.items()])
        stack = cfn.describe_stacks(StackName="mxpipe")["Stacks"][0]
        assert stack["StackStatus"] == "CREATE_COMPLETE", stack.get("StackStatusReason")
        out = {o["OutputKey"]: o["OutputValue"] for o in stack["Outputs"]}

        enc = s3.get_bucket_encryption(Bucket=out["ArtifactBucket"])["ServerSideEncryptionConfiguration"]
        assert enc["Rules"][0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "aws:kms"
        sg = ec2.describe_security_groups(GroupIds=[out["SecurityGroupId"]])["SecurityGroups"][0]
        assert [(p["FromPort"], p["ToPort"], [g["GroupId"] for g in p["UserIdGroupPairs"]], p["IpRanges"])
                for p in sg["IpPermissions"]] == [(1024, 65535, [out["SecurityGroupId"]], [])]
        role = next(r["RoleName"] for r in iam.list_roles()["Roles"] if "InstanceRole" in r["RoleName"])
        doc = iam.get_role_policy(RoleName=role, PolicyName="artifact-prefix-only")["PolicyDocument"]
        text = urllib.parse.unquote(doc) if isinstance(doc, str) else json.dumps(doc)  # moto: a string
        assert "arn:aws:s3:::mxpipe-artifacts-test/runs/mxnet_training/*" in text
        assert "arn:aws:s3:::mxpipe-artifacts-test/*" not in text

        spec = ClusterSpec(run_tag="mxnet_training--cfn", workers=2, servers=1, backend="ec2", options={
            "launch_template": out["LaunchTemplateName"], "subnet_id": out["SubnetId"], "endpoint_url": url,
            "poll_s": 0.1, "running_timeout_s": 30, "status_timeout_s": 30, "terminate_timeout_s": 30})
        cluster = provision(spec, home=str(tmp_path / "home"))
        try:
            insts = [i for r in ec2.describe_instances(InstanceIds=cluster.instance_ids)["Reservations"]
                     for i in r["Instances"]]
            assert {i["SubnetId"] for i in insts} == {out["SubnetId"]}
            assert {i["InstanceType"] for i in insts} == {"g5.xlarge"}  # the template's default
        finally:
            cluster.teardown()
        live = ec2.describe_instances(Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])
        assert live["Reservations"] == [] or all(not r["Instances"] for r in live["Reservations"])
