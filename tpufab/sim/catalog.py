"""The emulator's read-only catalog: locations, accelerator types, runtime versions, and the
project's number. No state: pure answers."""

from __future__ import annotations

import zlib
from typing import Any

from tpufab.sim._model import (
    LOCATIONS,
    RUNTIME_VERSIONS,
    accelerator_type_resource,
    accelerator_types,
    not_found,
    page,
    split_name,
)


def project_number(project: str) -> str:
    """A stable made-up project number (the compute project's id, the metadata server's
    numeric-project-id)."""
    return str(zlib.crc32(project.encode()) * 1000 + 7)


def list_locations(project: str, query: dict[str, str]) -> dict[str, Any]:
    items, token = page([location(project, z) for z in LOCATIONS], query)
    out: dict[str, Any] = {"locations": items}
    if token:
        out["nextPageToken"] = token
    return out


def location(project: str, zone: str) -> dict[str, Any]:
    return {"name": f"projects/{project}/locations/{zone}", "locationId": zone}


def list_accelerator_types(parent: str, query: dict[str, str]) -> dict[str, Any]:
    all_types = [accelerator_type_resource(parent, t) for t in accelerator_types()]
    items, token = page(all_types, query)
    out: dict[str, Any] = {"acceleratorTypes": items}
    if token:
        out["nextPageToken"] = token
    return out


def accelerator_type(name: str) -> dict[str, Any]:
    project, zone, _, type_name = split_name(name)
    if type_name not in accelerator_types():
        raise not_found(name)
    return accelerator_type_resource(f"projects/{project}/locations/{zone}", type_name)


def list_runtime_versions(parent: str, query: dict[str, str]) -> dict[str, Any]:
    versions = [{"name": f"{parent}/runtimeVersions/{v}", "version": v}
                for v in RUNTIME_VERSIONS]
    items, token = page(versions, query)
    out: dict[str, Any] = {"runtimeVersions": items}
    if token:
        out["nextPageToken"] = token
    return out


def runtime_version(name: str) -> dict[str, Any]:
    version = split_name(name)[3]
    if version not in RUNTIME_VERSIONS:
        raise not_found(name)
    return {"name": name, "version": version}
