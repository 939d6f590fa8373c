"""The simulated pod's Cloud OS Login: the API (v1, as the official client and gcloud call it),
project metadata (`enable-oslogin`), simulated IAM roles, and what each worker's metadata
server answers under ``oslogin/`` (what the guest's google_authorized_keys asks).

A handler of the emulator: its state lives in the emulator's state file under ``osLogin``::

    {"projects": {P: {"metadata": {"enable-oslogin": "TRUE"}}},
     "roles": {P: {email: "admin" | "login" | "none"}},       # default: admin (an owner)
     "users": {email: {"keys": {fingerprint: SshPublicKey}, "accounts": {P: PosixAccount}}},
     "nextUid": 1000000001}

REST surface (``/v1/users/...``): ``GET {user}/loginProfile``, ``POST {user}:importSshPublicKey``
(``?projectId=P`` creates the POSIX account for P, and needs the login role there, else 403),
``GET|PATCH|DELETE {user}/sshPublicKeys/{fingerprint}``, ``DELETE {user}/projects/{P}``.
Without credentials (or with a worker's token) any user may be named, as with the TPU API.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import time
import zlib
from typing import Any
from urllib.parse import unquote

from tpufab.cloud.oslogin import ENABLE_KEY, metadata_flag
from tpufab.sim._model import ApiFailure
from tpufab.sim.store import SimStore

DEFAULT_ACCOUNT = "alice@example.com"  # who "you" are on the simulated pod (TPUFAB_OS_LOGIN_ACCOUNT)
ROLES = ("admin", "login", "none")  # roles/compute.osAdminLogin, roles/compute.osLogin, neither
ROLE_NAMES = {"admin": "roles/compute.osAdminLogin", "login": "roles/compute.osLogin"}
FIRST_UID = 1_000_000_001
EMAIL = re.compile(r"[^@/\s]+@[^@/\s]+")
TYPE = "type.googleapis.com/google.cloud.oslogin.v1."
BLOCK_PROJECT_KEYS = "block-project-ssh-keys"  # instance metadata: ignore the project's keys


def posix_username(email: str) -> str:
    """The POSIX name Google derives from an account: alice@example.com -> alice_example_com;
    a service account -> sa_<its numeric id>. At most 32 characters."""
    local, _, domain = email.lower().partition("@")
    if domain.endswith(".gserviceaccount.com"):
        return f"sa_{zlib.crc32(email.encode()) * 100003 + 11}"[:32]
    return re.sub(r"[^a-z0-9]", "_", f"{local}_{domain}")[:32]


def fingerprint(key: str) -> str:
    """The OS Login fingerprint of an OpenSSH public key: sha256 of its blob, in hex."""
    parts = key.split()
    if len(parts) < 2:
        raise ApiFailure("INVALID_ARGUMENT", "Invalid SSH public key: expected `TYPE BASE64 "
                         "[comment]`.")
    try:
        blob = base64.b64decode(parts[1], validate=True)
    except (binascii.Error, ValueError):
        raise ApiFailure("INVALID_ARGUMENT", "Invalid SSH public key: its key data is not "
                         "base64.") from None
    return hashlib.sha256(blob).hexdigest()


class OsLoginService:
    """The emulator's OS Login handler, over the shared store (its table ``osLogin``)."""

    def __init__(self, store: SimStore):
        self.store = store

    @property
    def _state(self) -> dict[str, Any]:
        return self.store.table("osLogin", lambda: {"projects": {}, "roles": {}, "users": {},
                                                 "nextUid": FIRST_UID})

    # ------------------------------------------------------------ project metadata and roles

    def project_metadata(self, project: str) -> dict[str, str]:
        with self.store.lock:
            return dict(self._state["projects"].get(project, {}).get("metadata", {}))

    def project_fingerprint(self, project: str) -> str:
        """The fingerprint of the project's metadata (Compute Engine's
        ``commonInstanceMetadata.fingerprint``): a new one at every change."""
        with self.store.lock:
            return self._state["projects"].get(project, {}).get("fingerprint") or \
                base64.b64encode(hashlib.sha256(project.encode()).digest()[:8]).decode()

    def set_project_metadata(self, project: str, items: dict[str, str]) -> None:
        """Replace the project's metadata (Compute Engine's setCommonInstanceMetadata); its
        running nodes take its ``ssh-keys`` and ``enable-oslogin`` at once."""
        with self.store.lock:
            entry = self._state["projects"].setdefault(project, {})
            entry["metadata"] = dict(items)
            entry["fingerprint"] = base64.b64encode(hashlib.sha256(
                json.dumps([project, items, time.time()]).encode()).digest()[:8]).decode()
            self.store.save()
        self.apply_all(project)

    def enabled_for(self, record: dict[str, Any]) -> bool:
        """Node metadata enable-oslogin, else the project's (as the guest agent decides)."""
        node_value = metadata_flag((record["node"].get("metadata") or {}).get(ENABLE_KEY))
        if node_value is not None:
            return node_value
        project = record["node"]["name"].split("/")[1]
        return bool(metadata_flag(self.project_metadata(project).get(ENABLE_KEY)))

    def role(self, project: str, email: str) -> str:
        with self.store.lock:
            return self._state["roles"].get(project, {}).get(email, "admin")

    def admin(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        """/sim/v1/osLogin: GET the settings of ``?project``; PATCH ``{project, enabled,
        account, role}`` (enabled: project metadata enable-oslogin TRUE/FALSE, null removes it;
        role of account: admin, login or none)."""
        project = str(body.get("project") or "")
        if not project:
            raise ApiFailure("INVALID_ARGUMENT", "project is required.")
        if method in ("PATCH", "POST"):
            with self.store.lock:
                if "enabled" in body:
                    metadata = self._state["projects"].setdefault(project, {}).setdefault(
                        "metadata", {})
                    if body["enabled"] is None:
                        metadata.pop(ENABLE_KEY, None)
                    else:
                        metadata[ENABLE_KEY] = "TRUE" if body["enabled"] else "FALSE"
                if body.get("role") is not None:
                    if body["role"] not in ROLES:
                        raise ApiFailure("INVALID_ARGUMENT", "role must be admin, login or "
                                         "none.")
                    account = self._email(str(body.get("account") or DEFAULT_ACCOUNT))
                    self._state["roles"].setdefault(project, {})[account] = body["role"]
                self.store.save()
            self.apply_all(project)
        with self.store.lock:
            return {"project": project,
                    "metadata": dict(self._state["projects"].get(project, {})
                                     .get("metadata", {})),
                    "roles": dict(self._state["roles"].get(project, {}))}

    # ------------------------------------------------------------ the workers' side

    def login_keys(self, record: dict[str, Any]) -> str:
        """The `ssh-keys` the guest agent honours: none while OS Login is on; else the
        node's, and the project's unless the node says ``block-project-ssh-keys``."""
        if self.enabled_for(record):
            return ""
        metadata = record["node"].get("metadata") or {}
        keys = metadata.get("ssh-keys", "")
        if metadata_flag(metadata.get(BLOCK_PROJECT_KEYS)):
            return keys
        project = record["node"]["name"].split("/")[1]
        shared = self.project_metadata(project).get("ssh-keys", "")
        return "\n".join(k for k in (keys, shared) if k)

    # An internal-IP node's bastion is a VM of its own in the node's project: the TPU node's
    # metadata is not its metadata, so the project's enable-oslogin alone decides for it.

    @staticmethod
    def bastion_record(record: dict[str, Any]) -> dict[str, Any]:
        """What OS Login sees of a node's bastion: the project's VM with no metadata of its
        own (so the project's enable-oslogin decides)."""
        return {"node": {"name": record["node"]["name"], "metadata": {}}}

    def bastion_keys(self, record: dict[str, Any]) -> str:
        """The `ssh-keys` the bastion honours: none with the project's OS Login on; else the
        node's metadata keys (the sim's stand-in for your key on the bastion)."""
        if self.enabled_for(self.bastion_record(record)):
            return ""
        return (record["node"].get("metadata") or {}).get("ssh-keys", "")

    def accounts(self, project: str) -> list[dict[str, Any]]:
        """Every POSIX account of the project (what the guest's NSS module lists)."""
        with self.store.lock:
            return [dict(u["accounts"][project]) for u in self._state["users"].values()
                    if project in u.get("accounts", {})]

    def apply(self, record: dict[str, Any]) -> None:
        """Tell the node's workers whether OS Login is on, and its users (caller holds no lock
        it needs: the pool takes its own)."""
        project = record["node"]["name"].split("/")[1]
        on = self.enabled_for(record)
        self.store.workers.set_os_login(record["node"]["id"],
                                        self.accounts(project) if on else None)
        if self.store.network is not None:
            on = self.enabled_for(self.bastion_record(record))
            self.store.network.set_os_login(record["node"], self.accounts(project) if on else None)

    def apply_all(self, project: str | None = None) -> None:
        """After a project-wide change: every running node of ``project`` (or of all)."""
        with self.store.lock:
            records = [json.loads(json.dumps(r)) for r in self.store.nodes.values()
                       if r["node"]["state"] == "READY" and
                       (project is None or r["node"]["name"].split("/")[1] == project)]
        for record in records:
            node_id = record["node"]["id"]
            with self.store.node_lock(node_id):
                self.apply(record)
                self.store.workers.sync_keys(node_id, self.login_keys(record))
                if self.store.network is not None:
                    self.store.network.sync_keys(record["node"], self.bastion_keys(record))

    def metadata_answer(self, record: dict[str, Any], parts: list[str],
                        query: dict[str, str]) -> tuple[int, Any]:
        """``computeMetadata/v1/oslogin/...`` of a worker: users?username=U and
        authorize?email=E&policy=login|adminLogin, as the guest's OS Login tools ask."""
        if not self.enabled_for(record):
            return 404, "OS Login is not enabled for this instance.\n"
        project = record["node"]["name"].split("/")[1]
        if parts == ["users"] and "username" in query:
            with self.store.lock:
                for email, user in self._state["users"].items():
                    account = user.get("accounts", {}).get(project)
                    if account and account["username"] == query["username"]:
                        return 200, {"loginProfiles": [self._profile(email, project)]}
            return 404, "Not found\n"
        if parts == ["authorize"] and "email" in query:
            role = self.role(project, query["email"])
            wanted = {"login": ("login", "admin"), "adminLogin": ("admin",)}.get(
                query.get("policy", ""), ())
            return 200, {"success": role in wanted}
        return 404, "Not found\n"

    # ------------------------------------------------------------ the API

    def handle(self, method: str, rest: str, query: dict[str, str],
               body: dict[str, Any]) -> dict[str, Any]:
        """One request under /v1/users/ (``rest`` is what follows ``users/``)."""
        head, _, verb = rest.partition(":")
        parts = head.split("/")
        email = self._email(unquote(parts[0]))
        if verb == "importSshPublicKey" and len(parts) == 1 and method == "POST":
            return self._import(email, query.get("projectId") or query.get("project_id"), body)
        if parts[1:] == ["loginProfile"] and method == "GET" and not verb:
            with self.store.lock:
                return self._profile(email, query.get("projectId") or query.get("project_id"))
        if len(parts) == 3 and parts[1] == "sshPublicKeys" and not verb:
            return self._key(method, email, parts[2], query, body)
        if len(parts) == 3 and parts[1] == "projects" and method == "DELETE" and not verb:
            with self.store.lock:
                user = self._state["users"].get(email, {})
                if user.get("accounts", {}).pop(parts[2], None) is None:
                    raise ApiFailure("NOT_FOUND", f"No POSIX account for {email} in project "
                                     f"{parts[2]}.")
                self.store.save()
            self.apply_all(parts[2])
            return {}
        raise ApiFailure("NOT_FOUND", f"Method {method} /v1/users/{rest} is not part of the "
                         "Cloud OS Login API (or not emulated).")

    @staticmethod
    def _email(text: str) -> str:
        if not EMAIL.fullmatch(text):
            raise ApiFailure("INVALID_ARGUMENT", f"Invalid user name {text!r}: expected users/"
                             "EMAIL.")
        return text

    def _user(self, email: str) -> dict[str, Any]:
        return self._state["users"].setdefault(email, {"keys": {}, "accounts": {}})

    def _profile(self, email: str, project: str | None) -> dict[str, Any]:
        """LoginProfile (caller holds the lock): expired keys are dropped, as Google does."""
        user = self._user(email)
        now_usec = int(time.time() * 1e6)
        for fp in [fp for fp, k in user["keys"].items()
                   if int(k.get("expirationTimeUsec") or 0) and
                   int(k["expirationTimeUsec"]) < now_usec]:
            del user["keys"][fp]
        accounts = [dict(a) for p, a in user["accounts"].items() if project in (None, p)]
        return {"name": email, "posixAccounts": accounts,
                "sshPublicKeys": {fp: dict(k) for fp, k in user["keys"].items()}}

    def _import(self, email: str, project: str | None, body: dict[str, Any]) -> dict[str, Any]:
        key = str(body.get("key") or "").strip()
        fp = fingerprint(key)
        if project and self.role(project, email) == "none":
            raise ApiFailure("PERMISSION_DENIED", f"The caller does not have permission: "
                             f"{email} needs roles/compute.osLogin or roles/compute.osAdminLogin "
                             f"on project {project} to log in to its VMs.")
        created = False
        with self.store.lock:
            user = self._user(email)
            expiry = body.get("expirationTimeUsec") or body.get("expiration_time_usec")
            record = {"key": key, "fingerprint": fp, "name": f"users/{email}/sshPublicKeys/{fp}"}
            if expiry:
                record["expirationTimeUsec"] = str(int(expiry))
            user["keys"][fp] = record
            if project and project not in user["accounts"]:
                username = posix_username(email)
                uid = self._state["nextUid"]
                self._state["nextUid"] = uid + 1
                user["accounts"][project] = {
                    "primary": True, "username": username, "uid": str(uid), "gid": str(uid),
                    "homeDirectory": f"/home/{username}", "shell": "/bin/bash",
                    "gecos": email, "systemId": "", "accountId": project,
                    "operatingSystemType": "LINUX", "name": f"users/{email}/projects/{project}"}
                created = True
            profile = self._profile(email, project)
            self.store.save()
        if created:
            self.apply_all(project)  # the guest's NSS sees the new user at once
        return {"loginProfile": profile}

    def _key(self, method: str, email: str, fp: str, query: dict[str, str],
             body: dict[str, Any]) -> dict[str, Any]:
        with self.store.lock:
            user = self._user(email)
            self._profile(email, None)  # drops expired keys
            found = user["keys"].get(fp)
            if found is None:
                raise ApiFailure("NOT_FOUND", f"Resource 'users/{email}/sshPublicKeys/{fp}' "
                                 "was not found")
            if method == "GET":
                return dict(found)
            if method == "DELETE":
                del user["keys"][fp]
                self.store.save()
                return {}
            if method == "PATCH":
                mask = (query.get("updateMask") or query.get("update_mask") or
                        "key,expirationTimeUsec")
                for field in [f.strip() for f in mask.split(",") if f.strip()]:
                    if field in ("expirationTimeUsec", "expiration_time_usec"):
                        value = body.get("expirationTimeUsec") or body.get(
                            "expiration_time_usec")
                        if value:
                            found["expirationTimeUsec"] = str(int(value))
                        else:
                            found.pop("expirationTimeUsec", None)
                self.store.save()
                return dict(found)
        raise ApiFailure("NOT_FOUND", f"Method {method} on an SSH public key is not part of "
                         "the Cloud OS Login API.")
