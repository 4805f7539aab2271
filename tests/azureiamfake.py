"""The managed identity, storage account listing and role assignment parts of the Resource
Manager stand-in (:class:`azurefake.ArmFake` serves them), with ARM's paths and shapes:

* ``.../resourceGroups/G/providers/Microsoft.ManagedIdentity/userAssignedIdentities[/N]``:
  PUT (answers at once with ``properties.principalId`` / ``clientId``), GET, list; kept with
  the group's resources, so deleting the group deletes it;
* ``/subscriptions/S/providers/Microsoft.Authorization/permissions``: the caller's actions
  (``*`` but ``deny``);
* ``/subscriptions/S/providers/Microsoft.Storage/storageAccounts``: the accounts added with
  :meth:`IdentityFake.add_account`;
* ``/subscriptions/S/providers/Microsoft.Authorization/roleDefinitions/{uuid}``: custom
  roles, PUT (a role name unique in the tenant, assignable scopes under the subscription) and
  GET (kept in ``role_defs``);
* ``{scope}/providers/Microsoft.Authorization/roleAssignments/{uuid}``: PUT (the role must be
  a known built-in one or a custom one defined here, and the principal must exist; a
  ``condition`` needs ``conditionVersion`` 2.0; the same name again: 409
  ``RoleAssignmentExists``), DELETE; and ``/subscriptions/S/providers/Microsoft.Authorization/
  roleAssignments?$filter=principalId eq 'P'``;
* ``.../userAssignedIdentities/N/federatedIdentityCredentials``: the list kept in ``fics``.

Principals: a request whose bearer token is in ``principal_tokens`` (token → principal id: a
node's token, as IMDS hands it out) may do exactly what that principal's role assignments
allow (:meth:`IdentityFake.may`: the scope holds the resource, the role's actions match, ``*``
wildcards) and nothing else; any other request is the caller's, who may do everything but
``deny``. :func:`blob_request` names the data or container action of a Blob Storage REST
request, for a proxy that enforces the assignments in front of Azurite.

Faults: ``deny`` holds the actions the caller lacks (``Microsoft.Authorization/
roleAssignments/write``, ``Microsoft.ManagedIdentity/userAssignedIdentities/write``): 403
``AuthorizationFailed`` with ARM's text. :meth:`IdentityFake.allowed` evaluates the
assignments as Azure Storage would for one principal, data action and blob (ABAC conditions
included: ``ActionMatches``, ``SubOperationMatches``, ``@Resource[...:path]`` and
``@Request[...:prefix]`` with ``StringStartsWith``).
"""

from __future__ import annotations

import json
import re

BLOB = "Microsoft.Storage/storageAccounts/blobServices/containers/blobs"
CONTAINERS = "Microsoft.Storage/storageAccounts/blobServices/containers"
#: built-in role id → (its control-plane actions, its data actions) (a part of each, from
#: learn.microsoft.com/azure/role-based-access-control/built-in-roles)
ROLES = {
    "2a2b9908-6ea1-4ae2-8e65-a410df84e7d1": (                            # Blob Data Reader
        {f"{CONTAINERS}/read"}, {f"{BLOB}/read"}),
    "ba92f5b4-2d11-453d-a403-e96b0029c9fe": (                            # Blob Data Contributor
        {f"{CONTAINERS}/{a}" for a in ("read", "write", "delete")},
        {f"{BLOB}/{a}" for a in ("read", "write", "add/action", "delete", "move/action")}),
    "9980e02c-c2be-4d73-94e8-173b1dc7cf3c": (                            # VM Contributor
        {"Microsoft.Compute/virtualMachines/*", "Microsoft.Network/networkInterfaces/*",
         "Microsoft.Storage/storageAccounts/listKeys/action"}, set()),
}
MSI = "microsoft.managedidentity/userassignedidentities"


def abac_to_python(cond: str) -> str:
    """An ABAC condition (the grammar's subset named in the module docstring) as a Python
    expression over ``action``, ``subop``, ``path`` and ``prefix``."""
    s = re.sub(r"ActionMatches\{'([^']*)'\}", r"(action == '\1')", cond)
    s = re.sub(r"SubOperationMatches\{'([^']*)'\}", r"(subop == '\1')", s)
    s = re.sub(rf"@Resource\[{re.escape(BLOB)}:path\] StringStartsWith '([^']*)'",
               r"path.startswith('\1')", s)
    s = re.sub(rf"@Request\[{re.escape(BLOB)}:prefix\] StringStartsWith '([^']*)'",
               r"prefix.startswith('\1')", s)
    s = s.replace(" AND NOT ", " and not ").replace(" AND ", " and ").replace(" OR ", " or ")
    s = s.replace("!(", " not (")
    if any(t in s for t in ("@", "{", "!", "StringStartsWith", "Matches")):
        raise ValueError(f"unsupported condition {cond!r}")
    return s


class IdentityFake:
    """Mixed into :class:`azurefake.ArmFake`."""

    def _identity_init(self) -> None:
        self.accounts: dict[str, str] = {}        # name → id
        self.assignments: dict[str, dict] = {}    # lower id → assignment
        self.deny: set[str] = set()
        self.role_defs: dict[str, dict] = {}      # guid → properties of a custom role
        self.fics: dict[str, list] = {}           # lower identity id → federated credentials
        self.principal_tokens: dict[str, str] = {}  # bearer token → principal id

    def add_account(self, name: str, group: str = "data-rg") -> str:
        """A storage account (in another group than any cluster's); returns its id."""
        self.accounts[name] = (f"/subscriptions/{self.sub}/resourceGroups/{group}/providers/"
                               f"Microsoft.Storage/storageAccounts/{name}")
        return self.accounts[name]

    def role(self, guid: str) -> tuple[set, set] | None:
        """(actions, data actions) of a built-in or custom role, None for an unknown one."""
        if guid in ROLES:
            return ROLES[guid]
        d = self.role_defs.get(guid)
        if d is None:
            return None
        perms = d.get("permissions") or [{}]
        return (set().union(*(p.get("actions") or [] for p in perms)),
                set().union(*(p.get("dataActions") or [] for p in perms)))

    def may(self, principal: str, action: str, resource: str) -> bool:
        """Whether ``principal`` holds the control-plane ``action`` on ``resource`` (an ARM
        id): an assignment whose scope holds the resource and whose role's actions match."""
        import fnmatch
        target = resource.lower()
        for a in self.assignments.values():
            pr = a["properties"]
            scope = pr["scope"].lower()
            if pr["principalId"] != principal or not (target == scope or
                                                      target.startswith(scope + "/")):
                continue
            actions = (self.role(pr["roleDefinitionId"].rsplit("/", 1)[1]) or (set(),))[0]
            if any(fnmatch.fnmatchcase(action.lower(), x.lower()) for x in actions):
                return True
        return False

    def principals(self) -> set[str]:
        out = set()
        for r in self.res.values():
            pid = (r.get("identity") or {}).get("principalId") or \
                (r.get("properties") or {}).get("principalId")
            if pid:
                out.add(pid)
        return out

    def _forbidden(self, action: str, scope: str):
        from azurefake import ArmError
        raise ArmError(403, "AuthorizationFailed",
                       f"The client 'caller@example.com' with object id 'caller-oid' does not "
                       f"have authorization to perform action '{action}' over scope "
                       f"'{scope}' or the scope is invalid. If access was recently granted, "
                       "please refresh your credentials.")

    def identity_handle(self, method: str, p: str, q: dict, body):
        """The answer (code, body, headers) to an identity, account or role assignment call,
        or None for another path."""
        from azurefake import ArmError
        low = p.lower()
        sub = f"/subscriptions/{self.sub}".lower()
        if low == f"{sub}/providers/microsoft.storage/storageaccounts":
            return 200, {"value": [{"id": i, "name": n, "type":
                                    "Microsoft.Storage/storageAccounts", "location": "eastus"}
                                   for n, i in self.accounts.items()]}, {}
        if low == f"{sub}/providers/microsoft.authorization/permissions":
            return 200, {"value": [{"actions": ["*"], "notActions": sorted(self.deny),
                                    "dataActions": [], "notDataActions": []}]}, {}
        if low == f"{sub}/providers/microsoft.authorization/roleassignments":
            m = re.fullmatch(r"principalId eq '([^']*)'", (q.get("$filter") or "").strip())
            if not m:
                raise ArmError(400, "InvalidFilter", "unsupported $filter")
            return 200, {"value": [a for a in self.assignments.values()
                                   if a["properties"]["principalId"] == m[1]]}, {}
        m = re.fullmatch(rf"{re.escape(sub)}/providers/microsoft\.authorization/"
                         r"roledefinitions/([^/]+)", low)
        if m:
            return self._definition(method, p.rsplit("/", 1)[1], body)
        m = re.fullmatch(r"(.*)/providers/microsoft\.authorization/roleassignments/([^/]+)", low)
        if m:
            return self._assignment(method, p, p[:len(m[1])], body)
        m = re.fullmatch(rf"{re.escape(sub)}/resourcegroups/[^/]+/providers/{MSI}/[^/]+/"
                         r"federatedidentitycredentials", low)
        if m:
            return 200, {"value": list(self.fics.get(low.rsplit("/", 1)[0], []))}, {}
        m = re.fullmatch(rf"{re.escape(sub)}/resourcegroups/([^/]+)/providers/{MSI}(?:/([^/]+))?",
                         low)
        if m:
            group = m[1]
            if group not in self.groups:
                raise ArmError(404, "ResourceGroupNotFound",
                               f"Resource group '{group}' could not be found.")
            if m[2] is None:
                return 200, {"value": [r for r in self.resources_in(group)
                                       if r["type"].lower() == MSI]}, {}
            rid = p
            if method == "GET":
                if low not in self.res:
                    raise ArmError(404, "ResourceNotFound", f"{rid} was not found.")
                return 200, self.res[low], {}
            if method == "DELETE":
                self.fics.pop(low, None)
                return (200 if self.res.pop(low, None) else 204), None, {}
            if method == "PUT":
                if "Microsoft.ManagedIdentity/userAssignedIdentities/write" in self.deny:
                    self._forbidden("Microsoft.ManagedIdentity/userAssignedIdentities/write",
                                    rid)
                old = self.res.get(low)
                n = next(self._ids)
                props = old["properties"] if old else {
                    "tenantId": "tenant-1", "principalId": f"msi-principal-{n}",
                    "clientId": f"msi-client-{n}"}
                self.res[low] = {"id": rid, "name": p.rsplit("/", 1)[1],
                                 "type": "Microsoft.ManagedIdentity/userAssignedIdentities",
                                 "location": body.get("location"), "tags": body.get("tags")
                                 or {}, "properties": props}
                return (200 if old else 201), self.res[low], {}
        return None

    def _definition(self, method, guid, body):
        from azurefake import ArmError
        if method == "GET":
            if guid not in self.role_defs:
                raise ArmError(404, "RoleDefinitionDoesNotExist",
                               f"The specified role definition with ID '{guid}' does not "
                               "exist.")
            return 200, {"id": f"/subscriptions/{self.sub}/providers/Microsoft.Authorization/"
                         f"roleDefinitions/{guid}", "name": guid,
                         "type": "Microsoft.Authorization/roleDefinitions",
                         "properties": self.role_defs[guid]}, {}
        if method != "PUT":
            raise ArmError(405, "MethodNotAllowed", method)
        if "Microsoft.Authorization/roleDefinitions/write" in self.deny:
            self._forbidden("Microsoft.Authorization/roleDefinitions/write",
                            f"/subscriptions/{self.sub}")
        props = body["properties"]
        if any(d["roleName"] == props["roleName"] for g, d in self.role_defs.items()
               if g != guid):
            raise ArmError(409, "RoleDefinitionWithSameNameExists",
                           "A custom role with the same name already exists in this directory.")
        if not props.get("assignableScopes") or not all(
                sc.lower().startswith(f"/subscriptions/{self.sub}".lower())
                for sc in props["assignableScopes"]):
            raise ArmError(400, "InvalidAssignableScopes", "bad assignableScopes")
        self.role_defs[guid] = json.loads(json.dumps(props))
        return 201, {"name": guid, "properties": props}, {}

    def _assignment(self, method, path, scope, body):
        from azurefake import ArmError
        if method == "DELETE":
            a = self.assignments.pop(path.lower(), None)
            return (200, a, {}) if a else (204, None, {})
        if method != "PUT":
            raise ArmError(405, "MethodNotAllowed", method)
        if "Microsoft.Authorization/roleAssignments/write" in self.deny:
            self._forbidden("Microsoft.Authorization/roleAssignments/write", scope)
        self.role_assignments.append(body)
        props = dict(body["properties"])
        role = props["roleDefinitionId"].rsplit("/", 1)[1]
        if self.role(role) is None:
            raise ArmError(400, "RoleDefinitionDoesNotExist",
                           f"The specified role definition with ID '{role}' does not exist.")
        if props["principalId"] not in self.principals():
            raise ArmError(400, "PrincipalNotFound",
                           f"Principal {props['principalId']} does not exist in the directory.")
        if props.get("condition"):
            if props.get("conditionVersion") != "2.0":
                raise ArmError(400, "InvalidRoleAssignmentCondition", "conditionVersion")
            abac_to_python(props["condition"])
        if path.lower() in self.assignments:
            raise ArmError(409, "RoleAssignmentExists", "The role assignment already exists.")
        props["scope"] = scope
        self.assignments[path.lower()] = {
            "id": path, "name": path.rsplit("/", 1)[1],
            "type": "Microsoft.Authorization/roleAssignments", "properties": props}
        return 201, self.assignments[path.lower()], {}

    def allowed(self, principal: str, account: str, container: str, action: str,
                path: str = "", list_prefix: str | None = None) -> bool:
        """Whether ``principal`` may do the blob data ``action`` (``read``, ``write``,
        ``delete``, ...) on blob ``path`` of ``account/container``, or list it with
        ``list_prefix`` (``action`` ``read`` and ``list_prefix`` given)."""
        target = (f"{self.accounts[account]}/blobServices/default/containers/"
                  f"{container}").lower()
        act = f"{BLOB}/{action}"
        subop = "Blob.List" if list_prefix is not None else ""
        for a in self.assignments.values():
            pr = a["properties"]
            scope = pr["scope"].lower()
            if pr["principalId"] != principal or not (target == scope or
                                                      target.startswith(scope + "/")):
                continue
            if act not in (self.role(pr["roleDefinitionId"].rsplit("/", 1)[1]) or
                           (set(), set()))[1]:
                continue
            cond = pr.get("condition")
            if not cond or eval(abac_to_python(cond), {"__builtins__": {}}, {  # noqa: S307
                    "action": act, "subop": subop,
                    "path": "" if list_prefix is not None else path,
                    "prefix": list_prefix or ""}):
                return True
        return False


def blob_request(method: str, path: str, query: dict) -> tuple | None:
    """(account, container, kind, action, blob path, list prefix or None) of a Blob Storage
    REST request in path style (``/account/container[/blob]``, as Azurite and an emulator
    endpoint take it): ``kind`` ``data`` with a blob data action (``read``, ``write``,
    ``delete``; a listing is ``read`` with its prefix), or ``control`` with a container
    action (``containers/delete``, ``containers/write`` for a container's creation or its
    access policy, ``containers/read``); None for what this does not know (refused)."""
    parts = path.lstrip("/").split("/", 2)
    if len(parts) < 2 or not parts[1]:
        return None
    account, container = parts[0], parts[1]
    blob = parts[2] if len(parts) == 3 else ""
    comp, restype = query.get("comp"), query.get("restype")
    if blob:
        action = {"GET": "read", "HEAD": "read", "DELETE": "delete", "PUT": "write"}.get(method)
        return (account, container, "data", action, blob, None) if action else None
    if restype == "container" and comp == "list" and method == "GET":
        return account, container, "data", "read", "", query.get("prefix", "")
    if restype == "container":
        action = {"DELETE": "delete", "PUT": "write", "GET": "read", "HEAD": "read"}.get(method)
        return (account, container, "control", f"{CONTAINERS}/{action}", "", None) \
            if action else None
    return None
