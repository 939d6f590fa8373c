"""OS Login: when a node's workers accept only keys registered to your Google identity.

With ``enable-oslogin=TRUE`` in the node's metadata (or, where the node does not say, in the
project's), the guest environment ignores `ssh-keys` metadata and asks the OS Login API for
the keys of the user logging in, under the POSIX name of that user's login profile. tpufab
then registers its own public key with the OS Login API (the official google-cloud-os-login
client, imported lazily) for ``os_login_ttl`` seconds, renews it when a quarter of that is
left, and logs in as the profile's POSIX user (or ``ssh_user`` where that is set).

Where the setting comes from (``os_login``): ``auto`` reads the node's metadata, then the
project's through the Compute API (``projects.get``, the request gcloud makes; if that is
refused, OS Login counts as off and a refused login says what to try); ``true`` and ``false``
decide without looking (``--no-os-login`` is ``false``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tpufab.errors import ApiError, ConfigError

if TYPE_CHECKING:
    from rich.console import Console

    from tpufab.cloud.nodes import Node
    from tpufab.config import Settings

ENABLE_KEY = "enable-oslogin"
GOOGLE_OS_LOGIN = "https://oslogin.googleapis.com"
GOOGLE_COMPUTE = "https://compute.googleapis.com/compute/v1"
TOKENINFO = "https://oauth2.googleapis.com/tokeninfo"
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
RENEW_WHEN_LEFT = 0.25  # re-register once less than this share of os_login_ttl is left
ROLES = "roles/compute.osAdminLogin (or roles/compute.osLogin, which gives no sudo)"


def metadata_flag(value: str | None) -> bool | None:
    """A metadata value as the guest agent reads it (Go's ParseBool): None if unset or garbled."""
    if value is None:
        return None
    text = value.strip()
    if text in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if text in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    return None


def enabled(node_metadata: dict[str, str], project_metadata: dict[str, str] | None) -> bool:
    """The node's enable-oslogin, else the project's (what the guest and gcloud decide)."""
    own = metadata_flag(node_metadata.get(ENABLE_KEY))
    if own is not None:
        return own
    return bool(metadata_flag((project_metadata or {}).get(ENABLE_KEY)))


def endpoint(settings: Settings, explicit: str | None, path: str, google: str) -> str:
    """An explicit endpoint; else beside api_endpoint when that is set (an emulator serves
    every API on one address, as the simulated pod does); else Google's."""
    if explicit:
        return explicit.rstrip("/")
    if settings.api_endpoint:
        return settings.api_endpoint.rstrip("/") + path
    return google


def ttl_text(seconds: float) -> str:
    """86400 -> "24 h", 1800 -> "30 min", 45 -> "45 s"."""
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


@dataclass(frozen=True)
class Login:
    """How to log in to one node's workers where OS Login decides: as ``user`` (None: with
    metadata keys all the same, --no-os-login), and what to say if the login is refused."""

    user: str | None
    hint: str
    account: str = ""  # whose OS Login profile (where tpufab registered its key)


@dataclass(frozen=True)
class Registration:
    """tpufab's key in a login profile: the POSIX user to log in as, and until when."""

    user: str
    expires: float      # epoch seconds; 0 = never
    imported: bool      # True if this call (re-)registered the key


def choose_user(posix_accounts: list[Any]) -> str | None:
    """The primary POSIX account's name, else the first (as gcloud picks it)."""
    chosen = None
    for account in posix_accounts:
        chosen = chosen or account.username
        if account.primary:
            return account.username
    return chosen


def key_blob(public_key: str) -> str:
    parts = public_key.split()
    return parts[1] if len(parts) > 1 else public_key


def needs_import(profile: Any, public_key: str, ttl: float, now: float) -> bool:
    """No POSIX account yet, the key not in the profile, or less than a quarter of ``ttl``
    left on it."""
    if not profile.posix_accounts:
        return True
    blob = key_blob(public_key)
    for key in profile.ssh_public_keys.values():
        if key_blob(key.key) == blob:
            expires = key.expiration_time_usec / 1e6
            return bool(expires) and expires - now < ttl * RENEW_WHEN_LEFT
    return True


class OsLoginApi:
    """The Cloud OS Login API for one account and project. ``client`` is a test seam."""

    def __init__(self, settings: Settings, *, client: Any = None):
        self.settings = settings
        self.endpoint = endpoint(settings, settings.os_login_endpoint, "", GOOGLE_OS_LOGIN)
        self._client = client

    @property
    def client(self) -> Any:
        if self._client is None:
            from google.api_core.client_options import ClientOptions
            from google.cloud import oslogin_v1

            options = ClientOptions(api_endpoint=self.endpoint)
            self._client = oslogin_v1.OsLoginServiceClient(
                transport="rest", credentials=credentials(self.endpoint),
                client_options=options)
        return self._client

    def register(self, account: str, project: str, public_key: str, ttl: float,
                 now: float | None = None) -> Registration:
        """tpufab's key in ``account``'s login profile for ``project``, for ``ttl`` seconds."""
        from google.cloud.oslogin_v1 import common

        now = time.time() if now is None else now
        name = f"users/{account}"
        profile = self._call("read the login profile of", account, project,
                             self.client.get_login_profile,
                             request={"name": name, "project_id": project})
        imported = needs_import(profile, public_key, ttl, now)
        if imported:
            key = common.SshPublicKey(key=public_key.strip(),
                                      expiration_time_usec=int((now + ttl) * 1e6))
            profile = self._call("register tpufab's SSH key for", account, project,
                                 self.client.import_ssh_public_key,
                                 request={"parent": name, "ssh_public_key": key,
                                          "project_id": project}).login_profile
        user = choose_user(list(profile.posix_accounts))
        if not user:
            raise ApiError(f"The OS Login profile of {account} has no POSIX account for project "
                           f"{project}, so there is no user name to log in as; ask a project "
                           f"admin for {ROLES}.")
        expires = next((k.expiration_time_usec / 1e6 for k in profile.ssh_public_keys.values()
                        if key_blob(k.key) == key_blob(public_key)), 0.0)
        return Registration(user=user, expires=expires, imported=imported)

    def _call(self, what: str, account: str, project: str, fn: Any, **kwargs: Any) -> Any:
        from google.api_core import exceptions as gexc

        try:
            return fn(**kwargs, timeout=self.settings.api_timeout)
        except (gexc.PermissionDenied, gexc.Forbidden) as exc:
            raise ApiError(
                f"The OS Login API would not let tpufab {what} {account} in project {project} "
                f"({_message(exc)}): ask a project admin to grant {account} {ROLES}, "
                "and enable the OS Login API (oslogin.googleapis.com).") from exc
        except (gexc.Unauthenticated, gexc.Unauthorized) as exc:
            raise ApiError(f"The OS Login API did not accept your credentials ({_message(exc)}); "
                           "run `gcloud auth application-default login`.") from exc
        except gexc.GoogleAPICallError as exc:
            raise ApiError(f"The OS Login API at {self.endpoint} failed to {what} {account} "
                           f"({_message(exc)}).") from exc
        except Exception as exc:
            from tpufab.cloud.planes.calls import credentials_error, is_connection_error

            translated = credentials_error(exc)
            if translated is not None:
                raise translated from exc
            if is_connection_error(exc):
                raise ApiError(f"Cannot reach the OS Login API at {self.endpoint} ({exc}); "
                               "check os_login_endpoint (TPUFAB_OS_LOGIN_ENDPOINT), or turn OS "
                               "Login off with --no-os-login if the node accepts metadata "
                               "keys.") from exc
            raise


def _message(exc: BaseException) -> str:
    from tpufab.cloud.planes.calls import api_message

    return api_message(exc).rstrip(". ")


def credentials(url: str) -> Any:
    """Anonymous for a plain-http endpoint (an emulator), else Application Default
    Credentials."""
    if url.startswith("http://"):
        from google.auth.credentials import AnonymousCredentials

        return AnonymousCredentials()
    import google.auth

    creds, _ = google.auth.default(scopes=[CLOUD_PLATFORM_SCOPE])
    return creds


def account_of(settings: Settings) -> str:
    """Whose profile: ``os_login_account``, else the account your credentials belong to."""
    if settings.os_login_account:
        return settings.os_login_account
    api = endpoint(settings, settings.os_login_endpoint, "", GOOGLE_OS_LOGIN)
    found = None
    if not api.startswith("http://"):
        try:
            found = account_from_credentials(credentials(api))
        except Exception:  # noqa: BLE001 - no credentials: the sentence below says what to do
            found = None
    if not found:
        raise ConfigError("OS Login needs your Google account's email and tpufab could not "
                          "read it from your credentials; set os_login_account "
                          "(TPUFAB_OS_LOGIN_ACCOUNT) to it.")
    return found


def account_from_credentials(creds: Any, *, get: Any = None) -> str | None:
    """A service account's email; for user credentials, the email tokeninfo tells (ADC from
    `gcloud auth application-default login` carries the userinfo.email scope). ``get`` is a
    test seam: (url, params) -> JSON."""
    email = getattr(creds, "service_account_email", None)
    if email and email != "default":
        return email
    import google.auth.transport.requests

    if not creds.valid:
        creds.refresh(google.auth.transport.requests.Request())
    email = getattr(creds, "service_account_email", None)
    if email and email != "default":
        return email
    if get is None:
        import requests

        def get(url: str, params: dict) -> Any:
            return requests.get(url, params=params, timeout=30).json()

    return get(TOKENINFO, {"access_token": creds.token}).get("email") or None


def project_metadata(settings: Settings) -> dict[str, str] | None:
    """The project's commonInstanceMetadata (Compute API projects.get), None if unknown."""
    import requests

    url = endpoint(settings, settings.compute_endpoint, "/compute/v1", GOOGLE_COMPUTE)
    url = f"{url}/projects/{settings.project}"
    try:
        if url.startswith("http://"):
            response = requests.get(url, timeout=settings.api_timeout)
        else:
            from google.auth.transport.requests import AuthorizedSession

            response = AuthorizedSession(credentials(url)).get(url, timeout=settings.api_timeout)
        if response.status_code != 200:
            return None
        items = response.json().get("commonInstanceMetadata", {}).get("items") or []
        return {str(i.get("key")): str(i.get("value", "")) for i in items}
    except Exception:  # noqa: BLE001 - unknown: OS Login counts as off, said on a refused login
        return None


def logins(settings: Settings, nodes: list[Node], console: Console, *,
           api: OsLoginApi | None = None, project_md: Any = project_metadata
           ) -> dict[str, Login]:
    """{node name: Login} for the nodes where OS Login is on (with tpufab's key registered),
    or is on but turned off by os_login: false; says once (when it registers the key) who
    tpufab logs in as."""
    cache: list[dict[str, str] | None] = []

    def project() -> dict[str, str] | None:
        if not cache:
            cache.append(project_md(settings))
        return cache[0]

    def on(node: Node) -> bool:
        if metadata_flag(node.metadata.get(ENABLE_KEY)) is not None:
            return enabled(node.metadata, None)
        return enabled(node.metadata, project())

    if settings.os_login == "false":
        forced = {}
        for node in nodes:
            if on(node):
                console.print(f"[yellow]OS Login is on for {node.name} ({ENABLE_KEY}=TRUE), but "
                              "os_login is false (--no-os-login): its workers will refuse the "
                              "key in ssh-keys metadata unless its image ignores OS Login."
                              "[/yellow]")
                forced[node.name] = Login(None, f"OS Login is on for {node.name}: drop "
                                                "--no-os-login (os_login: false)")
        return forced
    chosen = [n for n in nodes if settings.os_login == "true" or on(n)]
    if not chosen:
        return {}
    from tpufab.ssh import keys as sshkeys

    account = account_of(settings)
    api = api or OsLoginApi(settings)
    public = sshkeys.ensure_key(settings.ssh_key_path)
    registration = api.register(account, settings.require("project"), public,
                                settings.os_login_ttl)
    user = registration.user
    if settings.source_of("ssh_user") != "default":
        user = settings.ssh_user  # ssh_user overrides the profile's name
    if registration.imported:
        what = f"node {chosen[0].name}" if len(chosen) == 1 else f"{len(chosen)} nodes"
        console.print(f"OS Login is on for {what}: logging in as {user} with tpufab's key "
                      f"registered for {ttl_text(settings.os_login_ttl)}.", markup=False)
    hint = (f"OS Login refused {user}: does {account} hold roles/compute.osAdminLogin or "
            "roles/compute.osLogin in this project?")
    return {n.name: Login(user, hint, account) for n in chosen}
