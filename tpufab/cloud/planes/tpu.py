"""The Cloud TPU API v2 through the official client (`google-cloud-tpu`), under the one retry
policy, every failure one sentence (tpufab/cloud/planes/calls.py): TPU VM nodes and queued
resources.

`google.cloud.tpu_v2` is imported only when a TpuApi makes its first call, so the CLI starts
fast. A plain `http://` endpoint (the simulated pod, any emulator) gets the REST transport and
anonymous credentials; anything else uses Application Default Credentials. Make one with
`tpufab.cloud.planes.control_plane(settings)`, not directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tpufab.cloud.bodies import config_text
from tpufab.cloud.nodes import Node, QueuedResourceInfo, UpcomingMaintenance
from tpufab.cloud.planes.base import ControlPlane
from tpufab.cloud.planes.calls import (
    DEFAULT_ENDPOINT,
    Action,
    RetriesExhausted,
    RetryPolicy,
    call_with_retries,
    credentials_error,
    exhausted_sentence,
    is_timeout,
    translate,
    unreachable_hint,
)
from tpufab.config import Settings
from tpufab.errors import ApiError, TpufabError

if TYPE_CHECKING:
    from rich.console import Console

    from tpufab.topology import Topology

T = TypeVar("T")


class TpuApi(ControlPlane):
    """The Cloud TPU API v2 for one project and zone. ``client`` and ``sleep`` are test seams."""

    name = "tpu"
    title = "TPU API"
    full_title = "Cloud TPU API"
    node_kind = "Cloud TPU API node"
    reservations_queue = True   # a reservation is consumed through a queued resource

    def __init__(self, settings: Settings, *, client: Any = None, retry: RetryPolicy | None = None,
                 on_retry: Callable[[BaseException, int, float], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        super().__init__(settings, on_retry=on_retry)
        self.endpoint = (settings.api_endpoint or DEFAULT_ENDPOINT).rstrip("/")
        self.retry = retry or RetryPolicy.from_settings(settings)
        self._sleep = sleep
        self._client = client
        self._injected = client is not None   # a test's fake client: nothing to ask v2alpha1
        self._alpha_session: Any = None

    # -- plumbing

    @property
    def parent(self) -> str:
        return f"projects/{self.project}/locations/{self.zone}"

    def node_path(self, name: str) -> str:
        return f"{self.parent}/nodes/{name}"

    def queued_resource_path(self, name: str) -> str:
        return f"{self.parent}/queuedResources/{name}"

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = self._make_client()
        return self._client

    def _alpha_get(self, path: str, *, retry: Any = None, timeout: float | None = None) -> dict:
        """GET ``/v2alpha1/<path>`` as JSON (google-cloud-tpu's v2alpha1 client has no REST
        transport; upcomingMaintenance is only in that version's Node). HTTP errors leave as
        google.api_core exceptions, so ``_call`` retries and translates them as any call."""
        from google.api_core import exceptions as gexc

        if self._alpha_session is None:
            if self.endpoint.startswith("http://"):
                import requests

                self._alpha_session = requests.Session()
            else:
                import google.auth
                from google.auth.transport.requests import AuthorizedSession

                credentials, _ = google.auth.default(
                    scopes=["https://www.googleapis.com/auth/cloud-platform"])
                self._alpha_session = AuthorizedSession(credentials)
        base = self.endpoint if "://" in self.endpoint else f"https://{self.endpoint}"
        answer = self._alpha_session.get(f"{base}/v2alpha1/{path}", timeout=timeout)
        if answer.status_code >= 400:
            raise gexc.from_http_response(answer)
        return answer.json()

    def _make_client(self) -> Any:
        from google.api_core.client_options import ClientOptions
        from google.cloud import tpu_v2

        options = ClientOptions(api_endpoint=self.endpoint)
        try:
            if self.endpoint.startswith("http://"):
                from google.auth.credentials import AnonymousCredentials

                return tpu_v2.TpuClient(transport="rest", credentials=AnonymousCredentials(),
                                        client_options=options)
            return tpu_v2.TpuClient(transport="rest", client_options=options)
        except Exception as exc:
            translated = credentials_error(exc)
            if translated is not None:
                raise translated from exc
            raise

    def _action(self, verb: str, kind: str = "node", name: str | None = None,
                accelerator_type: str | None = None) -> Action:
        plural = {"node": "nodes", "queued resource": "queuedResources"}[kind]
        permission = f"tpu.{plural}.{verb}"
        target = f"{'TPU ' if kind == 'node' else ''}{kind} {name!r}" if name else (
            f"TPU {plural}" if kind == "node" else "queued resources")
        return Action(verb=verb, target=target, permission=permission, name=name, kind=kind,
                      accelerator_type=accelerator_type, zone=self.zone, project=self.project)

    def _call(self, action: Action, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """One API call under the retry policy; every failure leaves as one sentence.

        Waiting for answers that never come is bounded by ``api_timeout`` for the whole call,
        retries included (each attempt waits at most what is left of it): an endpoint that
        accepts and never answers costs api_timeout, then one sentence."""
        budget = [float(self.settings.api_timeout)]

        def attempt() -> T:
            from google.api_core import exceptions as gexc

            started = time.monotonic()
            try:
                return fn(**kwargs, retry=None, timeout=budget[0])
            except Exception as exc:
                if not (is_timeout(exc) or isinstance(exc, gexc.DeadlineExceeded)):
                    raise
                budget[0] -= time.monotonic() - started
                if budget[0] < 0.5:
                    raise ApiError(
                        f"The TPU API at {self.endpoint} did not answer within "
                        f"{self.settings.api_timeout:g}s (it accepts connections but sends "
                        f"nothing back); {unreachable_hint(self.endpoint)}, or raise "
                        "TPUFAB_API_TIMEOUT (api_timeout).") from exc
                raise

        try:
            return call_with_retries(attempt, self.retry, on_retry=self.on_retry,
                                     sleep=self._sleep)
        except RetriesExhausted as err:
            raise exhausted_sentence(err, self.endpoint) from err.__cause__
        except TpufabError:
            raise
        except Exception as exc:
            translated = credentials_error(exc) or translate(exc, action, self.endpoint)
            raise translated from exc

    @classmethod
    def not_offered(cls, topology: Topology) -> str:
        return (f"{topology.name} is offered only through Compute Engine (TPU7x and later are "
                "not in the Cloud TPU API); drop --on tpu (TPUFAB_CONTROL_PLANE=tpu) to create "
                f"it there as VMs of machine type {topology.machine_type}.")

    def create_pod(self, settings: Settings, *, queued: bool, num_slices: int, async_: bool,
                   console: Console, reservation: str | None,
                   topology: str | None) -> list[Node]:
        """A node, or a queued resource (several slices, a reservation), waited for."""
        from tpufab.cloud.create import create_nodes

        return create_nodes(self, settings, queued=queued, num_slices=num_slices,
                            async_=async_, console=console, reservation=reservation,
                            topology=topology)

    # -- nodes

    def get_node(self, name: str) -> Node:
        proto = self._call(self._action("get", name=name), self.client.get_node,
                           name=self.node_path(name))
        return self.stamp(Node.from_proto(proto))

    def upcoming_maintenance(self, name: str) -> UpcomingMaintenance | None:
        """The node's ``upcomingMaintenance`` (read through API v2alpha1, the version that has
        it), or None when none is announced."""
        if self._injected:
            return None
        found = self._call(self._action("get", name=name), self._alpha_get,
                           path=self.node_path(name))
        return UpcomingMaintenance.from_json(found.get("upcomingMaintenance"))

    def list_nodes(self) -> list[Node]:
        def fetch(**kw: Any) -> list:
            return list(self.client.list_nodes(parent=self.parent, **kw))

        return [self.stamp(Node.from_proto(p))
                for p in self._call(self._action("list"), fetch)]

    def create_node(self, name: str, body: dict) -> str:
        """Start creating node ``name``; returns the long-running operation's name."""
        from google.cloud import tpu_v2

        shape = body.get("accelerator_type") or config_text(body.get("accelerator_config"))
        op = self._call(self._action("create", name=name, accelerator_type=shape),
                        self.client.create_node, parent=self.parent, node_id=name,
                        node=tpu_v2.Node(body))
        return op.operation.name

    def delete_node(self, name: str) -> str:
        op = self._call(self._action("delete", name=name), self.client.delete_node,
                        name=self.node_path(name))
        return op.operation.name

    def update_metadata(self, name: str, metadata: dict[str, str]) -> str:
        """Replace node ``name``'s metadata (PATCH updateMask=metadata, as gcloud does)."""
        from google.cloud import tpu_v2
        from google.protobuf import field_mask_pb2

        node = tpu_v2.Node(name=self.node_path(name), metadata=metadata)
        op = self._call(self._action("update", name=name), self.client.update_node,
                        node=node, update_mask=field_mask_pb2.FieldMask(paths=["metadata"]))
        return op.operation.name

    def host_keys(self, name: str, workers: list[int] | None = None) -> dict[int, dict[str, str]]:
        """Each worker's SSH host keys from guest attributes: {worker: {"ssh-ed25519": "ssh-ed25519 AAAA..."}}."""
        kwargs: dict[str, Any] = {"name": self.node_path(name), "query_path": ""}
        if workers is not None:
            kwargs["worker_ids"] = [str(w) for w in workers]
        response = self._call(self._action("get", name=name), self.client.get_guest_attributes,
                              request=kwargs)
        indexes = workers if workers is not None else list(range(len(response.guest_attributes)))
        keys: dict[int, dict[str, str]] = {}
        for index, attrs in zip(indexes, response.guest_attributes, strict=False):
            found = {}
            for item in attrs.query_value.items if attrs.query_value else []:
                if item.key.startswith(("ssh-", "ecdsa-")):
                    value = item.value.strip()
                    found[item.key] = value if value.startswith(item.key) else f"{item.key} {value}"
            keys[index] = found
        return keys

    # -- queued resources

    def create_queued_resource(self, name: str, body: dict) -> str:
        from google.cloud import tpu_v2

        spec = body.get("tpu", {}).get("node_spec", [{}])[0]
        op = self._call(
            self._action("create", "queued resource", name,
                         spec.get("node", {}).get("accelerator_type")
                         or config_text(spec.get("node", {}).get("accelerator_config"))),
            self.client.create_queued_resource, parent=self.parent, queued_resource_id=name,
            queued_resource=tpu_v2.QueuedResource(body))
        return op.operation.name

    def get_queued_resource(self, name: str) -> QueuedResourceInfo:
        proto = self._call(self._action("get", "queued resource", name),
                           self.client.get_queued_resource, name=self.queued_resource_path(name))
        return QueuedResourceInfo.from_proto(proto)

    def list_queued_resources(self) -> list[QueuedResourceInfo]:
        def fetch(**kw: Any) -> list:
            return list(self.client.list_queued_resources(parent=self.parent, **kw))

        protos = self._call(self._action("list", "queued resource"), fetch)
        return [QueuedResourceInfo.from_proto(p) for p in protos]

    def delete_queued_resource(self, name: str, *, force: bool = True) -> str:
        """Delete a queued resource; ``force`` also deletes the nodes it created (as gcloud does)."""
        op = self._call(self._action("delete", "queued resource", name),
                        self.client.delete_queued_resource,
                        request={"name": self.queued_resource_path(name), "force": force})
        return op.operation.name

    # -- operations and catalogue

    def operation_done(self, op_name: str, verb: str = "create", *,
                       kind: str = "node", name: str | None = None,
                       accelerator_type: str | None = None) -> bool:
        """Whether a long-running operation finished; if it failed, its error as a sentence."""
        from google.api_core import exceptions as gexc

        action = self._action(verb, kind, name, accelerator_type)
        op = self._call(action, self.client.get_operation, request={"name": op_name})
        if op.done and op.HasField("error") and op.error.code:
            raise translate(gexc.from_grpc_status(op.error.code, op.error.message),
                            action, self.endpoint)
        return bool(op.done)

    def list_operations(self) -> list[dict[str, Any]]:
        from google.cloud import tpu_v2

        def fetch(**kw: Any) -> list:
            found, token = [], ""
            for _ in range(50):   # pages: bounded
                response = self.client.list_operations(
                    request={"name": self.parent, "page_token": token}, **kw)
                found += list(response.operations)
                token = response.next_page_token
                if not token:
                    break
            return found

        out = []
        for op in self._call(Action("list", "operations", "tpu.operations.list",
                                    zone=self.zone, project=self.project), fetch):
            meta = tpu_v2.OperationMetadata.deserialize(op.metadata.value) \
                if op.metadata.type_url.endswith("OperationMetadata") else None
            node = tpu_v2.Node.deserialize(op.response.value) \
                if op.HasField("response") and op.response.type_url.endswith(".Node") else None
            created = meta.create_time.timestamp() if meta and meta.create_time else 0.0
            out.append({"name": op.name, "verb": meta.verb if meta else "",
                        "target": meta.target if meta else "", "created": created,
                        "done": bool(op.done), "node": node})
        return sorted(out, key=lambda o: -o["created"])

    def zones(self) -> list[str]:
        """Every zone of the project where the TPU API answers."""
        def fetch(**kw: Any) -> list:
            response = self.client.list_locations(request={"name": f"projects/{self.project}"},
                                                  **kw)
            return list(response.locations)

        locations = self._call(Action("list", "locations", "tpu.locations.list",
                                      zone=self.zone, project=self.project), fetch)
        return sorted({loc.location_id or loc.name.rsplit("/", 1)[-1] for loc in locations})

    def accelerator_types(self) -> list[str]:
        def fetch(**kw: Any) -> list:
            return list(self.client.list_accelerator_types(parent=self.parent, **kw))

        types = self._call(Action("list", "accelerator types", "tpu.acceleratorTypes.list",
                                  zone=self.zone, project=self.project), fetch)
        return sorted({t.type_ for t in types})
