"""moto's S3 authorisation, completed where it falls short of AWS's, for the tests of the
nodes' storage policies (tests/test_aws_identity.py).

moto (5.x, ``INITIAL_NO_AUTH_ACTION_COUNT``) checks every request of a principal against its
IAM policies, but it gives a statement with a ``Condition`` no request values (only
``sts:ExternalId``): every such statement fails its condition, and a failed condition counts
as an explicit *deny* (moto/iam/access_control.py, ``IAMPolicyStatement``), so no conditioned
policy can be tested on it as it is. :func:`enforced` replaces the check of S3 requests with
AWS's evaluation of identity policies (IAM User Guide, "Policy evaluation logic": an explicit
Deny wins, else any Allow whose Action, Resource and Condition all match, else an implicit
deny; a condition on a key the request does not carry does not match), with the request
values S3 gives (``s3:prefix`` of a listing; ``s3:ResourceAccount``, the account holding the
bucket), and S3's rule for a missing key: a HEAD or GET of it answers 404 only to a caller
who may list the bucket without a prefix, 403 otherwise (Amazon S3 API Reference,
HeadObject, "Permissions"). Everything else is moto's (signatures, credentials of assumed
roles, the objects)."""

from __future__ import annotations

import contextlib
import fnmatch
from urllib.parse import parse_qs

from moto.iam import access_control as ac


def _list(v):
    return v if isinstance(v, list) else [v]


def _glob(pattern: str, value: str) -> bool:
    return fnmatch.fnmatchcase(value, pattern)  # IAM's * and ? (no [] classes in ARNs here)


def _condition(cond: dict | None, ctx: dict) -> bool:
    for op, pairs in (cond or {}).items():
        for key, want in pairs.items():
            if key not in ctx:
                return False
            got = ctx[key]
            if op == "StringEquals" and got not in _list(want):
                return False
            if op == "StringLike" and not any(_glob(w, got) for w in _list(want)):
                return False
            if op not in ("StringEquals", "StringLike"):
                raise AssertionError(f"condition operator {op} not evaluated here")
    return True


def allows(policies: list[dict], action: str, resource: str, ctx: dict) -> bool:
    """AWS's evaluation of identity policies (module docstring) for one request."""
    allowed = False
    for doc in policies:
        for st in _list(doc.get("Statement", [])):
            if not any(_glob(a.lower(), action.lower()) for a in _list(st.get("Action", []))):
                continue
            if not any(_glob(r, resource) for r in _list(st.get("Resource", "*"))):
                continue
            if not _condition(st.get("Condition"), ctx):
                continue
            if st["Effect"] == "Deny":
                return False
            allowed = True
    return allowed


def _check(self, resource: str) -> None:
    policies = [ac.IAMPolicy(p)._policy_json for p in self._access_key.collect_policies()]
    query = parse_qs(self._path.partition("?")[2], keep_blank_values=True)
    bucket, _, key = resource.split(":::", 1)[1].partition("/")
    ctx = {"s3:ResourceAccount": self.account_id}
    if "prefix" in query:
        ctx["s3:prefix"] = query["prefix"][0]
    if not allows(policies, self._action, resource, ctx):
        self._raise_access_denied()
    if self._action == "s3:GetObject" and self._method in ("GET", "HEAD") and key:
        from moto.s3.models import s3_backends
        backend = s3_backends[self.account_id]["aws"]
        found = backend.buckets.get(bucket)
        if (found is None or key not in found.keys) and not allows(
                policies, "s3:ListBucket", f"arn:aws:s3:::{bucket}",
                {"s3:ResourceAccount": self.account_id}):
            self._raise_access_denied()


def _one(v):
    return v[0] if isinstance(v, list) else v


def _ec2_requests(self) -> list[tuple[str, str, dict]]:
    """The (action, resource ARN, condition values) an EC2 or IAM request of moto's asks,
    as AWS authorises it ("Actions, resources, and condition keys for Amazon EC2"):
    RunInstances once per resource it creates (with ``aws:RequestTag/*`` of its tag
    specification) and per resource it uses (image, subnet, security groups, key pair, with
    ``ec2:ResourceTag/*``), CreateTags per tagged resource type (``ec2:CreateAction``),
    iam:PassRole of the instance profile's role; TerminateInstances per instance (its
    ``ec2:ResourceTag/*``); any other action once on ``*`` with no condition values."""
    from moto.ec2.models import ec2_backends
    from moto.iam.models import iam_backends
    data = {k: _one(v) for k, v in (self._data or {}).items()}
    arn = f"arn:aws:ec2:{self._region}:{self.account_id}:"
    ec2 = ec2_backends[self.account_id][self._region]

    def tagged(rid: str) -> dict:
        return {f"ec2:ResourceTag/{k}": v for k, v in ec2.tags.get(rid, {}).items()}
    action = self._action
    if action == "ec2:TerminateInstances":
        ids = [v for k, v in data.items() if k.startswith("InstanceId.")]
        return [(action, f"{arn}instance/{i}", tagged(i)) for i in ids]
    if action != "ec2:RunInstances":
        return [(action, "*", {})]
    specs: dict[str, dict] = {}
    for k, v in data.items():
        if k.startswith("TagSpecification.") and k.endswith(".ResourceType"):
            n = k.split(".")[1]
            tags = {}
            for kk, vv in data.items():
                parts = kk.split(".")
                if kk.startswith(f"TagSpecification.{n}.Tag.") and parts[-1] == "Key":
                    tags[f"aws:RequestTag/{vv}"] = data[kk[:-3] + "Value"]
            specs[v] = tags
    out = []
    for kind in ("instance", "volume", "network-interface"):
        out.append((action, f"{arn}{kind}/*", specs.get(kind, {})))
    if "InstanceMarketOptions.MarketType" in data:
        out.append((action, f"{arn}spot-instances-request/*",
                    specs.get("spot-instances-request", {})))
    out.append((action, f"arn:aws:ec2:{self._region}::image/{data['ImageId']}", {}))
    groups = [v for k, v in data.items() if "SecurityGroupId" in k]
    for g in groups:
        out.append((action, f"{arn}security-group/{g}", tagged(g)))
    for k, v in data.items():
        if k.endswith("SubnetId"):
            out.append((action, f"{arn}subnet/{v}", {}))
    if data.get("KeyName"):
        pair = ec2.key_pairs.get(data["KeyName"])
        out.append((action, f"{arn}key-pair/{data['KeyName']}",
                    tagged(pair.id) if pair is not None else {}))
    for kind in specs:
        out.append(("ec2:CreateTags", f"{arn}{kind}/*", {"ec2:CreateAction": "RunInstances"}))
    profile = data.get("IamInstanceProfile.Name")
    if profile:
        iam = iam_backends[self.account_id]["aws"]
        for role in iam.get_instance_profile(profile).roles:
            out.append(("iam:PassRole", role.arn,
                        {"iam:PassedToService": "ec2.amazonaws.com"}))
    return out


def _check_normal(self, resource: str) -> None:
    if self._service not in ("ec2", "iam"):
        return _saved_normal(self, resource)
    policies = [ac.IAMPolicy(p)._policy_json for p in self._access_key.collect_policies()]
    for action, arn, ctx in _ec2_requests(self):
        if not allows(policies, action, arn, ctx):
            self._action = action
            self._raise_access_denied()


_saved_normal = ac.IAMRequest.check_action_permitted


@contextlib.contextmanager
def enforced():
    """S3 requests checked as :func:`allows` says, inside the block (module docstring);
    EC2 and IAM requests too, with the resources and condition values of
    :func:`_ec2_requests`."""
    saved = ac.S3IAMRequest.check_action_permitted
    ac.S3IAMRequest.check_action_permitted = _check
    ac.IAMRequest.check_action_permitted = _check_normal
    try:
        yield
    finally:
        ac.S3IAMRequest.check_action_permitted = saved
        ac.IAMRequest.check_action_permitted = _saved_normal
