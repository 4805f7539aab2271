"""The managed identity, storage account listing and role assignment parts of the Resource
Manager stand-in (:class:`azurefake.ArmFake` serves them), with ARM's paths and shapes:

* ``.../resourceGroups/G/providers/Microsoft.ManagedIdentity/userAssignedIdentities[/N]``:
  PUT (answers at once with ``properties.principalId`` / ``clientId``), GET, list; kept with
  the group's resources, so deleting the group deletes it;
* ``/subscriptions/S/providers/Microsoft.Authorization/permissions``: the caller's actions
  (``*`` but ``deny``);
* ``/subscriptions/S/providers/Microsoft.Storage/storageAccounts``: the accounts added with
  :meth:`IdentityFake.add_account`;
* ``{scope}/providers/Microsoft.Authorization/roleAssignments/{uuid}``: PUT (the role must be
  a known built-in one and the principal must exist; a ``condition`` needs
  ``conditionVersion`` 2.0; the same name again: 409 ``RoleAssignmentExists``), DELETE; and
  ``/subscriptions/S/providers/Microsoft.Authorization/roleAssignments?$filter=principalId eq
  'P'``.

Faults: ``deny`` holds the actions the caller lacks (``Microsoft.Authorization/
roleAssignments/write``, ``Microsoft.ManagedIdentity/userAssignedIdentities/write``): 403
``AuthorizationFailed`` with ARM's text. :meth:`IdentityFake.allowed` evaluates the
assignments as Azure Storage would for one principal, data action and blob (ABAC conditions
included: ``ActionMatches``, ``SubOperationMatches``, ``@Resource[...:path]`` and
``@Request[...:prefix]`` with ``StringStartsWith``).
"""

from __future__ import annotations

import re

BLOB = "Microsoft.Storage/storageAccounts/blobServices/containers/blobs"
#: built-in role id → its data actions (blob roles) or None (a control-plane role)
ROLES = {
    "2a2b9908-6ea1-4ae2-8e65-a410df84e7d1": {f"{BLOB}/read"},           # Blob Data Reader
    "ba92f5b4-2d11-453d-a403-e96b0029c9fe": {f"{BLOB}/{a}" for a in (   # Blob Data Contributor
        "read", "write", "add/action", "delete", "move/action")},
    "9980e02c-c2be-4d73-94e8-173b1dc7cf3c": set(),                       # VM Contributor
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

    def add_account(self, name: str, group: str = "data-rg") -> str:
        """A storage account (in another group than any cluster's); returns its id."""
        self.accounts[name] = (f"/subscriptions/{self.sub}/resourceGroups/{group}/providers/"
                               f"Microsoft.Storage/storageAccounts/{name}")
        return self.accounts[name]

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
        m = re.fullmatch(r"(.*)/providers/microsoft\.authorization/roleassignments/([^/]+)", low)
        if m:
            return self._assignment(method, p, p[:len(m[1])], body)
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
        if role not in ROLES:
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
            if act not in ROLES[pr["roleDefinitionId"].rsplit("/", 1)[1]]:
                continue
            cond = pr.get("condition")
            if not cond or eval(abac_to_python(cond), {"__builtins__": {}}, {  # noqa: S307
                    "action": act, "subop": subop,
                    "path": "" if list_prefix is not None else path,
                    "prefix": list_prefix or ""}):
                return True
        return False
