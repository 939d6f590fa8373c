"""Compute Engine calls on a general-purpose VM (no TPU, so of no control plane: the
supervisor's, docs/supervisor.md "The VM"), with the Compute Engine client bundle the plane
uses (compute_parts) and tpufab's retries and error sentences (calls)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tpufab.config import Settings
from tpufab.errors import ApiError, ConfigError, NotFound, TpufabError


class InstanceCalls:
    """The few calls on one general-purpose VM that tpufab makes (the supervisor's), through
    the official client, retried and worded as every API call of tpufab's (planes.calls)."""

    def __init__(self, settings: Settings):
        from tpufab.cloud.planes.calls import RetryPolicy
        from tpufab.cloud.planes.compute_parts import compute_endpoint

        if not settings.project or not settings.zone:
            raise ConfigError("The supervisor VM needs a project and a zone: pass --project "
                              "and --zone (or set project and zone in tpufab.yaml).")
        self.settings = settings
        self.project, self.zone = settings.project, settings.zone
        self.endpoint = compute_endpoint(settings)
        self.retry = RetryPolicy.from_settings(settings)
        self._clients: Any = None

    @property
    def c(self) -> Any:
        if self._clients is None:
            from tpufab.cloud.planes.compute_parts import make_clients

            self._clients = make_clients(self.endpoint)
        return self._clients

    def call(self, verb: str, name: str, fn: Callable[..., Any], **kw: Any) -> Any:
        from tpufab.cloud.planes.calls import (
            Action,
            RetriesExhausted,
            call_with_retries,
            credentials_error,
            exhausted_sentence,
            translate,
        )

        action = Action(verb=verb, target=f"the supervisor VM {name!r}",
                        permission=f"compute.instances.{verb}", name=name, kind="VM",
                        zone=self.zone, project=self.project)
        try:
            return call_with_retries(lambda: fn(**kw, timeout=float(self.settings.api_timeout)),
                                     self.retry)
        except RetriesExhausted as err:
            raise exhausted_sentence(err, self.endpoint) from err.__cause__
        except TpufabError:
            raise
        except Exception as exc:
            from google.api_core import exceptions as gexc

            if isinstance(exc, gexc.NotFound):
                raise NotFound(f"There is no supervisor VM {name!r} in {self.zone} (project "
                               f"{self.project}).") from exc
            raise credentials_error(exc) or translate(exc, action, self.endpoint) from exc

    def read(self, name: str) -> dict[str, Any] | None:
        """The instance as the REST API gives it (no client library imported: a second less
        of CPU than ``get``), or None; retried and worded as every call."""
        from tpufab.cloud.planes.compute_parts import RestReader

        reader = RestReader(self.endpoint, self.project)
        return self.call("get", name, lambda timeout: reader.get(
            f"zones/{self.zone}/instances/{name}", timeout=timeout))

    def get(self, name: str) -> Any | None:
        try:
            return self.call("get", name, self.c.instances.get, project=self.project,
                             zone=self.zone, instance=name)
        except NotFound:
            return None

    def wait(self, op: Any, verb: str, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.2
        while True:
            found = self.call(verb, name, self.c.zone_ops.get, project=self.project,
                              zone=self.zone, operation=op.name)
            if str(found.status) in ("DONE", "Status.DONE") or getattr(found.status, "name",
                                                                       "") == "DONE":
                if found.error and found.error.errors:
                    first = found.error.errors[0]
                    raise ApiError(f"Compute Engine could not {verb} the supervisor VM "
                                   f"{name!r} in {self.zone}: {first.message} ({first.code}).")
                return
            if time.monotonic() > deadline:
                raise ApiError(f"Compute Engine did not {verb} the supervisor VM {name!r} "
                               f"within {timeout:g} s; see `gcloud compute operations describe "
                               f"{op.name} --zone {self.zone}`.")
            time.sleep(delay)
            delay = min(delay * 1.5, 2.0)

    def insert(self, body: dict[str, Any], timeout: float) -> None:
        v1 = self.c.v1
        op = self.call("create", body["name"], self.c.instances.insert, project=self.project,
                       zone=self.zone, instance_resource=v1.Instance(body))
        self.wait(op, "create", body["name"], timeout)

    def delete(self, name: str, timeout: float) -> None:
        op = self.call("delete", name, self.c.instances.delete, project=self.project,
                       zone=self.zone, instance=name)
        self.wait(op, "delete", name, timeout)

    def start(self, name: str, timeout: float) -> None:
        op = self.call("start", name, self.c.instances.start, project=self.project,
                       zone=self.zone, instance=name)
        self.wait(op, "start", name, timeout)

    def reset(self, name: str, timeout: float) -> None:
        op = self.call("reset", name, self.c.instances.reset, project=self.project,
                       zone=self.zone, instance=name)
        self.wait(op, "reset", name, timeout)

    def set_attribute(self, inst: Any, key: str, value: str, timeout: float) -> None:
        v1 = self.c.v1
        items = [v1.Items(key=i.key, value=i.value) for i in inst.metadata.items
                 if i.key != key] + [v1.Items(key=key, value=value)]
        op = self.call("setMetadata", inst.name, self.c.instances.set_metadata,
                       project=self.project, zone=self.zone, instance=inst.name,
                       metadata_resource=v1.Metadata(fingerprint=inst.metadata.fingerprint,
                                                     items=items))
        self.wait(op, "setMetadata", inst.name, timeout)
