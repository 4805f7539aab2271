"""The IAM (service accounts) and Cloud Storage bucket IAM policy parts of the GCP stand-in
(:class:`gcpfake.ComputeFake` serves them on the same endpoint), with the real paths and JSON
shapes:

* ``/v1/projects/{p}/serviceAccounts[/{email}]``: create (``accountId`` 6-30 characters,
  ``[a-z]([-a-z0-9]*[a-z0-9])``; 409 when it exists), get, list, patch (``updateMask``),
  delete; ``.../{email}/keys`` (``sa_keys``) and ``.../{email}:getIamPolicy`` /
  ``:setIamPolicy`` (``sa_policies``: who may act as the account, :meth:`IAMFake.may_act_as`);
* ``/v1/projects/{p}/roles[/{id}][:undelete]``: custom roles (create, get, patch
  ``includedPermissions``, undelete), kept in ``roles``;
* ``/compute/v1/projects/{p}/zones/{z}/instances/{name}/setIamPolicy`` (kept in
  ``instance_policies``; a role must be a predefined one known here or a custom role of the
  project that is not deleted);
* ``/v1/projects/{p}:getIamPolicy`` and ``:setIamPolicy`` (Resource Manager:
  ``project_policy``, the roles principals hold in the project, with IAM conditions over
  ``resource.name`` (:func:`cel_on_name`); a conditional policy needs version 3, a write
  with a stale etag is refused 409);
* ``/v1/projects/{p}:testIamPermissions`` (Resource Manager) and
  ``/storage/v1/b/{bucket}/iam/testPermissions``: the asked permissions that are not in
  ``deny``;
* ``/storage/v1/b/{bucket}/iam``: getIamPolicy (``optionsRequestedPolicyVersion``; a policy
  with conditions asked below version 3 is refused, HTTP 400) and setIamPolicy (the etag
  must match, else 412; a binding with a condition needs ``version: 3``; conditional
  bindings need uniform bucket-level access).

Principals: a request whose bearer token is in ``tokens`` (token → member, e.g.
``serviceAccount:hyper-c1-...-0@proj.iam.gserviceaccount.com``: a node's token, as its
metadata server hands it out) may do exactly what that member's bindings allow
(:meth:`IAMFake.may_on_instance`, :meth:`IAMFake.allowed`) and nothing project-wide; any
other request is the caller's, who may do everything but ``deny``.
:func:`storage_request` names the permission, bucket and object of a Cloud Storage JSON API
request, for a proxy that enforces the bucket policies in front of a storage emulator.

Faults: ``races[bucket] = n`` (``project_races = n`` for the project's policy): the next n
policy reads are each followed by another writer's change (the etag read is stale: 412, or
409 ABORTED for the project's); ``deny`` holds the permissions the caller lacks
(``iam.serviceAccounts.create``,
``storage.buckets.setIamPolicy``, ...): such a call is answered 403 with the real body.
:meth:`IAMFake.allowed` evaluates the bucket policies as Cloud Storage would for one member,
permission and object (the conditions hypercli writes: ``resource.name`` prefixes and the
``objectListPrefix`` attribute).
"""

from __future__ import annotations

import json
import re

ACCOUNT_ID_RE = r"[a-z](?:[-a-z0-9]{4,28}[a-z0-9])"
#: a predefined role hypercli once bound per instance, for the tests that show what it allowed
INSTANCE_ADMIN = {f"compute.instances.{p}" for p in (
    "get", "delete", "setLabels", "setMetadata", "stop", "reset", "start", "setTags",
    "setServiceAccount", "attachDisk", "detachDisk", "getSerialPortOutput", "setMachineType")}
ROLE_PERMISSIONS = {
    "roles/iam.serviceAccountUser": {"iam.serviceAccounts.actAs", "iam.serviceAccounts.get",
                                     "iam.serviceAccounts.list"},
    "roles/storage.objectViewer": {"storage.objects.get", "storage.objects.list"},
    "roles/storage.objectUser": {"storage.objects.get", "storage.objects.list",
                                 "storage.objects.create", "storage.objects.delete",
                                 "storage.objects.update"},
    "roles/storage.admin": {"storage.objects.get", "storage.objects.list",
                            "storage.objects.create", "storage.objects.delete",
                            "storage.objects.update", "storage.buckets.setIamPolicy"},
}


def _cel_to_python(expr: str) -> str:
    """The subset of CEL hypercli's conditions use, as a Python expression over ``name``
    (``resource.name``) and ``lp`` (the listing's prefix)."""
    s = re.sub(r'api\.getAttribute\("storage\.googleapis\.com/objectListPrefix",\s*""\)',
               "lp", expr)
    s = s.replace("resource.name", "name").replace(".startsWith(", ".startswith(")
    s = s.replace("&&", " and ").replace("||", " or ")
    if re.search(r"[a-zA-Z_]+\(", re.sub(r"\.startswith\(", "", s)):
        raise ValueError(f"unsupported condition {expr!r}")
    return s


def _extract(name: str, template: str) -> str:
    """CEL's ``extract`` on a resource name: the part matching the template's ``{var}``,
    "" when the template does not occur (cloud.google.com/iam/docs/conditions-overview)."""
    head, _, tail = template.partition("{")
    tail = tail.partition("}")[2]
    m = re.search(re.escape(head) + (r"(.*?)" + re.escape(tail) if tail else r"([^/]*)$"),
                  name)
    return m[1] if m else ""


def cel_on_name(expr: str, name: str) -> bool:
    """Evaluate an IAM condition over a resource name: the CEL subset of terms
    ``resource.name.startsWith("x")`` and ``resource.name.extract("T").startsWith("x")``
    joined by ``||`` / ``&&`` (a ValueError for anything else, as the API answers 400)."""
    s = re.sub(r'resource\.name\.extract\(("[^"]*")\)', r"_extract(name, \1)", expr)
    s = s.replace("resource.name", "name").replace(".startsWith(", ".startswith(")
    s = s.replace("&&", " and ").replace("||", " or ")
    if re.search(r"[a-zA-Z_]+\(", re.sub(r"\.startswith\(|_extract\(", "", s)):
        raise ValueError(f"unsupported condition {expr!r}")
    return bool(eval(s, {"__builtins__": {}, "_extract": _extract},  # noqa: S307
                     {"name": name}))


class IAMFake:
    """Mixed into :class:`gcpfake.ComputeFake`: ``service_accounts`` (email → account),
    ``buckets`` (name → {"policy", "ubla"}), ``deny`` (permissions refused)."""

    def _iam_init(self) -> None:
        self.service_accounts: dict[str, dict] = {}
        self.buckets: dict[str, dict] = {}
        self.deny: set[str] = set()
        self._etag = 0
        self.instance_policies: dict[tuple[str, str], dict] = {}  # (zone, name) → policy
        self.races: dict[str, int] = {}  # bucket → policy reads followed by another writer
        self.roles: dict[str, dict] = {}  # custom role id → role
        self.sa_keys: dict[str, list] = {}  # e-mail → user-managed keys
        self.sa_policies: dict[str, dict] = {}  # e-mail → its own IAM policy
        self.tokens: dict[str, str] = {}  # bearer token → member (a node's identity)
        self.project_policy: dict = {"bindings": []}  # the project's IAM policy
        self.project_races = 0  # project policy reads followed by another writer

    def role_permissions(self, role: str) -> set:
        """The permissions of a predefined role known here or a custom role of the project
        (none for a deleted or unknown one)."""
        if role == "roles/compute.instanceAdmin.v1":
            return INSTANCE_ADMIN
        if role in ROLE_PERMISSIONS:
            return ROLE_PERMISSIONS[role]
        m = re.fullmatch(rf"projects/{re.escape(self.project)}/roles/([^/]+)", role)
        r = self.roles.get(m[1]) if m else None
        return set(r["includedPermissions"]) if r and not r.get("deleted") else set()

    def may_on_instance(self, member: str, zone: str, name: str, permission: str) -> bool:
        """Whether ``member`` holds ``permission`` on instance ``zone/name`` (its
        instance-level policy: the only place hypercli binds a node's account in Compute)."""
        policy = self.instance_policies.get((zone, name)) or {}
        return any(member in b.get("members", []) and
                   permission in self.role_permissions(b.get("role", ""))
                   for b in policy.get("bindings", []))

    def may_act_as(self, member: str, email: str) -> bool:
        """Whether ``member`` holds ``iam.serviceAccounts.actAs`` on the account ``email``:
        by the account's own IAM policy (``sa_policies``) or the project's, unconditioned."""
        return any(member in b.get("members", []) and "iam.serviceAccounts.actAs" in
                   self.role_permissions(b.get("role", "")) and not b.get("condition")
                   for b in (self.sa_policies.get(email) or {}).get("bindings", []) +
                   (self.project_policy.get("bindings") or []))

    def add_bucket(self, name: str, uniform: bool = True) -> None:
        """A bucket with an empty policy (``uniform``: uniform bucket-level access)."""
        self._etag += 1
        self.buckets[name] = {"ubla": uniform, "policy": {
            "kind": "storage#policy", "resourceId": f"projects/_/buckets/{name}",
            "version": 1, "bindings": [], "etag": f"CA{self._etag}="}}

    def add_service_account(self, email: str) -> None:
        """An account the caller made elsewhere (e.g. named by ``cluster.service_account``)."""
        self.service_accounts[email] = self._account(email, "", "")

    def _account(self, email: str, display: str, description: str) -> dict:
        return {"name": f"projects/{self.project}/serviceAccounts/{email}",
                "projectId": self.project, "uniqueId": str(next(self._ids)),
                "email": email, "displayName": display, "description": description,
                "etag": "MDEwMjE5MjA=", "oauth2ClientId": str(next(self._ids))}

    def _denied(self, permission: str, resource: str, storage: bool = False) -> tuple:
        if storage:
            msg = (f"caller@{self.project}.iam.gserviceaccount.com does not have "
                   f"{permission} access to the Google Cloud Storage bucket. Permission "
                   f"'{permission}' denied on resource (or it may not exist).")
            return 403, {"error": {"code": 403, "message": msg, "errors": [
                {"message": msg, "domain": "global", "reason": "forbidden"}]}}
        return 403, {"error": {
            "code": 403, "status": "PERMISSION_DENIED",
            "message": f"Permission '{permission}' denied on resource (or it may not exist).",
            "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                         "reason": "IAM_PERMISSION_DENIED", "domain": "iam.googleapis.com",
                         "metadata": {"permission": permission, "resource": resource}}]}}

    def _status_error(self, code: int, status: str, message: str) -> tuple:
        return code, {"error": {"code": code, "message": message, "status": status}}

    def iam_route(self, method: str, path: str, query: dict, body):
        """The answer to an IAM or storage policy call, or None for another path."""
        m = re.fullmatch(rf"/v1/projects/{re.escape(self.project)}/serviceAccounts/([^/:]+)"
                         r"(/keys|:getIamPolicy|:setIamPolicy)", path)
        if m:
            if m[1] not in self.service_accounts:
                return self._status_error(404, "NOT_FOUND", "Unknown service account")
            if m[2] == "/keys":
                return 200, {"keys": list(self.sa_keys.get(m[1], []))}
            if m[2] == ":setIamPolicy":
                if "iam.serviceAccounts.setIamPolicy" in self.deny:
                    return self._denied("iam.serviceAccounts.setIamPolicy",
                                        f"projects/{self.project}/serviceAccounts/{m[1]}")
                policy = (body or {}).get("policy") or {}
                for b in policy.get("bindings", []):
                    if not self.role_permissions(b.get("role", "")):
                        return self._status_error(400, "INVALID_ARGUMENT",
                                                  f"Role {b.get('role')} is not supported")
                self.sa_policies[m[1]] = {"bindings": policy.get("bindings", [])}
                return 200, dict(self.sa_policies[m[1]], etag="ACAB")
            return 200, dict(self.sa_policies.get(m[1]) or {}, etag="ACAB")
        m = re.fullmatch(rf"/v1/projects/{re.escape(self.project)}/serviceAccounts"
                         r"(?:/([^/]+))?", path)
        if m:
            return self._accounts(method, m[1], query, body)
        m = re.fullmatch(rf"/v1/projects/{re.escape(self.project)}/roles(?:/([^/:]+))?"
                         r"(:undelete)?", path)
        if m:
            return self._roles(method, m[1], m[2], query, body)
        m = re.fullmatch(r"/storage/v1/b/([^/]+)/iam/testPermissions", path)
        if m:
            if m[1] not in self.buckets:
                return self._status_error(404, "NOT_FOUND", "The specified bucket does not "
                                          "exist.")
            asked = query.get("permissions", "").split(",")
            return 200, {"kind": "storage#testIamPermissionsResponse",
                         "permissions": [x for x in asked if x and x not in self.deny]}
        m = re.fullmatch(rf"/compute/v1/projects/{re.escape(self.project)}/zones/([^/]+)/"
                         r"instances/([^/]+)/setIamPolicy", path)
        if m and method == "POST":
            if "compute.instances.setIamPolicy" in self.deny:
                return self._denied("compute.instances.setIamPolicy", path)
            if m[2] not in self.instances.get(m[1], {}):
                return self._status_error(404, "NOT_FOUND", f"instance {m[2]} not found")
            for b in body["policy"].get("bindings", []):
                if not self.role_permissions(b.get("role", "")):
                    return self._status_error(400, "INVALID_ARGUMENT",
                                              f"Role {b.get('role')} is not supported")
            self.instance_policies[(m[1], m[2])] = dict(body["policy"], etag="BwX=")
            return 200, self.instance_policies[(m[1], m[2])]
        m = re.fullmatch(r"/storage/v1/b/([^/]+)/iam", path)
        if m:
            return self._policy(method, m[1], query, body)
        if path == f"/v1/projects/{self.project}:getIamPolicy" and method == "POST":
            if "resourcemanager.projects.getIamPolicy" in self.deny:
                return self._denied("resourcemanager.projects.getIamPolicy",
                                    f"projects/{self.project}")
            asked = int(((body or {}).get("options") or {}).get("requestedPolicyVersion", 1))
            conditional = any("condition" in b for b in self.project_policy["bindings"])
            if conditional and asked < 3:  # the real API leaves such bindings out: refuse
                return self._status_error(400, "INVALID_ARGUMENT", "conditional bindings "
                                          "need requestedPolicyVersion 3")
            answer = json.loads(json.dumps(dict(
                self.project_policy, version=3 if conditional else 1,
                etag=self.project_policy.get("etag", "BwYP="))))
            if self.project_races:  # someone else writes the policy right after
                self.project_races -= 1
                self._etag += 1
                self.project_policy["etag"] = f"BwP{self._etag}="
            return 200, answer
        if path == f"/v1/projects/{self.project}:setIamPolicy" and method == "POST":
            return self._set_project_policy(body.get("policy") or {})
        if path == f"/v1/projects/{self.project}:testIamPermissions" and method == "POST":
            return 200, {"permissions": [x for x in body.get("permissions", [])
                                         if x not in self.deny]}
        return None

    def _set_project_policy(self, policy: dict):
        """Resource Manager ``projects.setIamPolicy``: the etag must match (409 ABORTED
        otherwise, as the API answers a concurrent change), a conditional binding needs
        ``version: 3``, every role must exist and every condition must parse."""
        if "resourcemanager.projects.setIamPolicy" in self.deny:
            return self._denied("resourcemanager.projects.setIamPolicy",
                                f"projects/{self.project}")
        if policy.get("etag") and policy["etag"] != self.project_policy.get("etag", "BwYP="):
            return self._status_error(409, "ABORTED", "There were concurrent policy changes.")
        bindings = policy.get("bindings") or []
        if any("condition" in b for b in bindings) and policy.get("version") != 3:
            return self._status_error(400, "INVALID_ARGUMENT", "IAM policy with conditions "
                                      "requires version 3")
        for b in bindings:
            if not self.role_permissions(b.get("role", "")) or not b.get("members"):
                return self._status_error(400, "INVALID_ARGUMENT", f"bad binding {b}")
            if "condition" in b:
                cel_on_name(b["condition"]["expression"], "")
        self._etag += 1
        self.project_policy = json.loads(json.dumps(dict(policy, etag=f"BwP{self._etag}=")))
        return 200, self.project_policy

    def _roles(self, method, rid, undelete, query, body):
        base = f"projects/{self.project}/roles"
        if rid is None and method == "POST":
            if "iam.roles.create" in self.deny:
                return self._denied("iam.roles.create", f"projects/{self.project}")
            rid = body["roleId"]
            if rid in self.roles:
                return self._status_error(409, "ALREADY_EXISTS", f"Role {rid} already exists")
            bad = [p for p in body["role"].get("includedPermissions", [])
                   if not re.fullmatch(r"[a-z]+\.[a-zA-Z]+\.[a-zA-Z]+", p)]
            if bad:
                return self._status_error(400, "INVALID_ARGUMENT", f"bad permission {bad[0]}")
            self.roles[rid] = dict(body["role"], name=f"{base}/{rid}", etag="BwA=",
                                   deleted=False)
            return 200, self.roles[rid]
        if rid not in self.roles:
            return self._status_error(404, "NOT_FOUND", f"Role {base}/{rid} not found")
        role = self.roles[rid]
        if method == "GET":
            return 200, role
        if "iam.roles.update" in self.deny:
            return self._denied("iam.roles.update", f"{base}/{rid}")
        if undelete and method == "POST":
            role["deleted"] = False
            return 200, role
        if method == "PATCH":
            for f in (query.get("updateMask") or "").split(","):
                if f:
                    role[f] = body[f]
            return 200, role
        return self._status_error(405, "METHOD_NOT_ALLOWED", method)

    def _accounts(self, method, email, query, body):
        res = f"projects/{self.project}/serviceAccounts/{email or ''}"
        if email is None and method == "GET":
            if "iam.serviceAccounts.list" in self.deny:
                return self._denied("iam.serviceAccounts.list", res)
            return 200, {"accounts": list(self.service_accounts.values())}
        if email is None and method == "POST":
            if "iam.serviceAccounts.create" in self.deny:
                return self._denied("iam.serviceAccounts.create", f"projects/{self.project}")
            aid = body.get("accountId", "")
            if not re.fullmatch(ACCOUNT_ID_RE, aid):
                return self._status_error(400, "INVALID_ARGUMENT",
                                          "accountId must match [a-z]([-a-z0-9]*[a-z0-9])"
                                          " and be 6 to 30 characters long")
            email = f"{aid}@{self.project}.iam.gserviceaccount.com"
            if email in self.service_accounts:
                return self._status_error(409, "ALREADY_EXISTS",
                                          f"Service account {aid} already exists within "
                                          f"project projects/{self.project}.")
            sa = body.get("serviceAccount") or {}
            if len(sa.get("description", "")) > 256:
                return self._status_error(400, "INVALID_ARGUMENT", "description too long")
            self.service_accounts[email] = self._account(
                email, sa.get("displayName", ""), sa.get("description", ""))
            return 200, self.service_accounts[email]
        if email not in self.service_accounts:
            return self._status_error(404, "NOT_FOUND", f"Unknown service account")
        if method == "GET":
            return 200, self.service_accounts[email]
        if method == "PATCH":
            if "iam.serviceAccounts.update" in self.deny:
                return self._denied("iam.serviceAccounts.update", res)
            for f in (body.get("updateMask") or "").split(","):
                if f:
                    self.service_accounts[email][f] = body["serviceAccount"][f]
            return 200, self.service_accounts[email]
        if method == "DELETE":
            if "iam.serviceAccounts.delete" in self.deny:
                return self._denied("iam.serviceAccounts.delete", res)
            del self.service_accounts[email]
            self.sa_keys.pop(email, None)
            self.sa_policies.pop(email, None)
            for b in self.buckets.values():  # what IAM does to the bindings of a deleted one
                for bd in b["policy"]["bindings"]:
                    bd["members"] = [f"deleted:{m}?uid=1" if m == f"serviceAccount:{email}"
                                     else m for m in bd["members"]]
            return 200, {}
        return self._status_error(405, "METHOD_NOT_ALLOWED", method)

    def _policy(self, method, bucket, query, body):
        if bucket not in self.buckets:
            return 404, {"error": {"code": 404, "message": "The specified bucket does not "
                                   "exist.", "errors": [{"message": "The specified bucket "
                                   "does not exist.", "domain": "global", "reason": "notFound"}]}}
        b = self.buckets[bucket]
        if method == "GET":
            if "storage.buckets.getIamPolicy" in self.deny:
                return self._denied("storage.buckets.getIamPolicy", bucket, storage=True)
            asked = int(query.get("optionsRequestedPolicyVersion", 1))
            if asked < 3 and any("condition" in x for x in b["policy"]["bindings"]):
                return self._status_error(400, "INVALID_ARGUMENT",
                                          "Cannot get legacy ACL for a bucket that has "
                                          "conditional role bindings")
            answer = json.loads(json.dumps(b["policy"]))
            if self.races.get(bucket):  # someone else writes the policy right after
                self.races[bucket] -= 1
                self._etag += 1
                b["policy"]["etag"] = f"CA{self._etag}="
            return 200, answer
        if method == "PUT":
            if "storage.buckets.setIamPolicy" in self.deny:
                return self._denied("storage.buckets.setIamPolicy", bucket, storage=True)
            if body.get("etag") and body["etag"] != b["policy"]["etag"]:
                return self._status_error(412, "FAILED_PRECONDITION", "Precondition Failed")
            conditional = any("condition" in x for x in body.get("bindings", []))
            if conditional and body.get("version") != 3:
                return self._status_error(400, "INVALID_ARGUMENT", "IAM policy with "
                                          "conditions requires version 3")
            if conditional and not b["ubla"]:
                return self._status_error(400, "INVALID_ARGUMENT", "IAM conditions require "
                                          "uniform bucket-level access")
            for x in body.get("bindings", []):
                if x.get("role") not in ROLE_PERMISSIONS or not x.get("members"):
                    return self._status_error(400, "INVALID_ARGUMENT", f"bad binding {x}")
                if "condition" in x:
                    _cel_to_python(x["condition"]["expression"])
            self._etag += 1
            b["policy"] = dict(body, kind="storage#policy",
                               resourceId=f"projects/_/buckets/{bucket}",
                               etag=f"CA{self._etag}=")
            return 200, b["policy"]
        return self._status_error(405, "METHOD_NOT_ALLOWED", method)

    def allowed(self, member: str, bucket: str, permission: str, obj: str | None = None,
                list_prefix: str = "") -> bool:
        """Whether ``member`` may do ``permission`` on ``bucket``'s object ``obj`` (or, for
        ``storage.objects.list``, list the bucket with ``list_prefix``)."""
        name = f"projects/_/buckets/{bucket}" + (f"/objects/{obj}" if obj else "")
        for x in self.buckets.get(bucket, {}).get("policy", {}).get("bindings", []):
            if member not in x["members"] or permission not in ROLE_PERMISSIONS[x["role"]]:
                continue
            cond = x.get("condition")
            if cond is None or eval(_cel_to_python(cond["expression"]),  # noqa: S307
                                    {"__builtins__": {}}, {"name": name, "lp": list_prefix}):
                return True
        return False


def storage_request(method: str, path: str, query: dict, body: bytes | None):
    """(bucket, permission, object or None, list prefix or None) of a Cloud Storage JSON API
    request as google-cloud-storage sends it (cloud.google.com/storage/docs/json_api: objects
    get, list, insert (multipart or resumable: the name in the query or the body's metadata
    part), delete, and bucket calls), or None for a path this does not know (refused)."""
    import json as _json
    from urllib.parse import unquote
    m = re.fullmatch(r"/upload/storage/v1/b/([^/]+)/o", path)
    if m and method == "POST":
        name = query.get("name")
        if not name and body:
            found = re.search(rb'\{[^{}]*"name"[^{}]*\}', body)
            name = _json.loads(found[0])["name"] if found else None
        return (m[1], "storage.objects.create", name, None) if name else None
    m = re.fullmatch(r"/(?:download/)?storage/v1/b/([^/]+)/o/(.+)", path)
    if m:
        perm = {"GET": "storage.objects.get", "DELETE": "storage.objects.delete",
                "PATCH": "storage.objects.update", "PUT": "storage.objects.update"}.get(method)
        return (m[1], perm, unquote(m[2]), None) if perm else None
    m = re.fullmatch(r"/storage/v1/b/([^/]+)/o", path)
    if m and method == "GET":
        return m[1], "storage.objects.list", None, query.get("prefix", "")
    m = re.fullmatch(r"/storage/v1/b/([^/]+)(/iam)?", path)
    if m:
        perm = {("DELETE", None): "storage.buckets.delete",
                ("PATCH", None): "storage.buckets.update",
                ("GET", None): "storage.buckets.get",
                ("PUT", "/iam"): "storage.buckets.setIamPolicy",
                ("GET", "/iam"): "storage.buckets.getIamPolicy"}.get((method, m[2]))
        return (m[1], perm, None, None) if perm else None
    return None
