"""Task files for `tpufab launch` (pure): tpufab's own schema and SkyPilot task YAMLs.

Both become one ``Task``. tpufab's schema (top-level keys):

    name, type, zone, spot, runtime_version, envs, setup, run, workdir, mounts, files

SkyPilot's (as its TPU docs write them): ``name``, ``workdir``, ``num_nodes`` (1),
``resources: {accelerators: tpu-v6e-8, accelerator_args: {runtime_version, tpu_vm},
use_spot, zone, cloud/infra: gcp, labels}``, ``envs``, ``secrets``, ``file_mounts``, ``setup``,
``run``. A file is SkyPilot's when it has ``resources``, ``file_mounts``, ``num_nodes``
or ``secrets``. Unknown keys and known-but-unsupported values are refused with one sentence.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpufab.errors import ConfigError

TPUFAB_KEYS = ("name", "type", "zone", "spot", "runtime_version", "envs", "setup", "run",
               "workdir", "mounts", "files")
SKYPILOT_KEYS = ("name", "workdir", "num_nodes", "resources", "envs", "secrets", "file_mounts",
                 "setup", "run")
SKYPILOT_ONLY = ("resources", "file_mounts", "num_nodes", "secrets")
RESOURCE_KEYS = ("accelerators", "accelerator_args", "use_spot", "zone", "region", "cloud",
                 "infra", "labels")
ACCELERATOR_ARGS = ("runtime_version", "tpu_vm", "tpu_name")
MOUNT_KEYS = ("name", "source", "store", "mode", "persistent")
TPUFAB_MOUNT_KEYS = ("bucket", "driver", "options")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Mount:
    """A bucket mounted on every worker: ``gs://BUCKET[/PREFIX]`` at ``at``."""

    at: str
    source: str                          # gs://bucket[/prefix]
    driver: str | None = None            # None: the mount_driver setting
    options: tuple[str, ...] = ()


@dataclass(frozen=True)
class FileCopy:
    """A local file put on every worker at ``remote``."""

    remote: str
    local: str


@dataclass(frozen=True)
class Task:
    source: str                                   # "tpufab" or "skypilot"
    path: str = "task.yaml"
    name: str | None = None
    type: str | None = None
    zone: str | None = None
    spot: bool | None = None
    runtime_version: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    envs: Mapping[str, str | None] = field(default_factory=dict)   # None: must be given
    secret_envs: tuple[str, ...] = ()             # SkyPilot `secrets:` names
    setup: str | None = None
    run: str | None = None
    workdir: str | None = None
    mounts: tuple[Mount, ...] = ()
    files: tuple[FileCopy, ...] = ()


def _refuse_unknown(data: Mapping, allowed: Iterable[str], where: str, path: str) -> None:
    allowed = list(allowed)
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: unknown key {key!r} in {where}{hint}; {where} takes "
                              f"{', '.join(allowed)}.")


def _text(value: Any, key: str, path: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"{path}: {key} must be text, not {type(value).__name__}.")
    return str(value)


def _script(value: Any, key: str, path: str) -> str | None:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    return _text(value, key, path)


def _bool(value: Any, key: str, path: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ConfigError(f"{path}: {key} must be true or false, not {value!r}.")


def _envs(value: Any, key: str, path: str) -> dict[str, str | None]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: {key} must be a mapping of NAME: value.")
    out: dict[str, str | None] = {}
    for name, v in value.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise ConfigError(f"{path}: {key} has {name!r}, which is not a variable name.")
        if v is None or v == "":
            out[name] = None
        elif isinstance(v, bool):
            out[name] = "true" if v else "false"
        else:
            out[name] = _text(v, f"{key}.{name}", path)
    return out


def _gs(source: str, at: str, path: str) -> str:
    if not source.startswith("gs://"):
        raise ConfigError(f"{path}: the mount at {at} reads {source!r}; tpufab mounts Cloud "
                          "Storage buckets only (gs://BUCKET[/PREFIX]).")
    return source


def _tpufab_mounts(value: Any, path: str) -> tuple[Mount, ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: mounts must map a mount point to a bucket, e.g. "
                          "`/mnt/data: gs://my-bucket`.")
    out = []
    for at, spec in value.items():
        at = str(at)
        if isinstance(spec, str):
            source = spec if spec.startswith("gs://") else f"gs://{spec}"
            out.append(Mount(at, _gs(source, at, path)))
            continue
        if not isinstance(spec, Mapping) or "bucket" not in spec:
            raise ConfigError(f"{path}: mounts.{at} must be gs://BUCKET or a mapping with "
                              "bucket (and optionally driver, options).")
        _refuse_unknown(spec, TPUFAB_MOUNT_KEYS, f"mounts.{at}", path)
        bucket = str(spec["bucket"])
        source = bucket if bucket.startswith("gs://") else f"gs://{bucket}"
        options = spec.get("options") or ()
        if isinstance(options, str):
            import shlex

            options = shlex.split(options)
        out.append(Mount(at, _gs(source, at, path), _text(spec.get("driver"), "driver", path),
                         tuple(str(o) for o in options)))
    return tuple(out)


def _files(value: Any, key: str, path: str) -> tuple[FileCopy, ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: {key} must map a path on the workers to a local path.")
    return tuple(FileCopy(str(remote), str(local)) for remote, local in value.items())


def parse_tpufab(data: Mapping, path: str = "task.yaml") -> Task:
    _refuse_unknown(data, TPUFAB_KEYS, "a tpufab task file", path)
    return Task(
        source="tpufab", path=path, name=_text(data.get("name"), "name", path),
        type=_text(data.get("type"), "type", path), zone=_text(data.get("zone"), "zone", path),
        spot=_bool(data.get("spot"), "spot", path),
        runtime_version=_text(data.get("runtime_version"), "runtime_version", path),
        envs=_envs(data.get("envs"), "envs", path),
        setup=_script(data.get("setup"), "setup", path),
        run=_script(data.get("run"), "run", path),
        workdir=_text(data.get("workdir"), "workdir", path),
        mounts=_tpufab_mounts(data.get("mounts"), path),
        files=_files(data.get("files"), "files", path))


def skypilot_accelerator(value: Any, path: str) -> str:
    """``tpu-v6e-8``, ``tpu-v6e-8:1`` or ``{tpu-v6e-8: 1}`` -> ``tpu-v6e-8``."""
    if isinstance(value, Mapping):
        if len(value) != 1:
            raise ConfigError(f"{path}: resources.accelerators must name one TPU type, not "
                              f"{len(value)}.")
        (name, count), = value.items()
        value = f"{name}:{count}"
    if isinstance(value, list):
        raise ConfigError(f"{path}: resources.accelerators lists several choices; tpufab launches "
                          "one TPU type: name one, e.g. tpu-v6e-8.")
    text = str(value or "").strip()
    name, _, count = text.partition(":")
    if not name.lower().startswith("tpu-"):
        raise ConfigError(f"{path}: resources.accelerators is {text!r}; tpufab launches Cloud "
                          "TPUs only (tpu-v4-32, tpu-v6e-8, ...).")
    if count and count.strip() != "1":
        raise ConfigError(f"{path}: resources.accelerators asks for {count.strip()} x {name}; a "
                          f"TPU slice is one accelerator: ask for a bigger type (e.g. "
                          f"{name.rsplit('-', 1)[0]}-N) instead.")
    return name


def _skypilot_mounts(value: Any, path: str) -> tuple[tuple[Mount, ...], tuple[FileCopy, ...]]:
    if value is None:
        return (), ()
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: file_mounts must map a path on the workers to a source.")
    mounts, files = [], []
    for at, spec in value.items():
        at = str(at)
        if isinstance(spec, str):
            if re.match(r"^[a-z0-9]+://", spec):
                raise ConfigError(f"{path}: file_mounts.{at} copies {spec}; tpufab does not copy "
                                  "from buckets: mount it instead ({name: BUCKET, store: gcs, "
                                  "mode: MOUNT}).")
            files.append(FileCopy(at, spec))
            continue
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{path}: file_mounts.{at} must be a local path or a storage "
                              "mapping (name, store, mode).")
        _refuse_unknown(spec, MOUNT_KEYS, f"file_mounts.{at}", path)
        mode = str(spec.get("mode", "MOUNT")).upper()
        if mode != "MOUNT":
            raise ConfigError(f"{path}: file_mounts.{at} uses mode: {mode}; tpufab supports "
                              "mode: MOUNT for buckets (a FUSE mount on every worker).")
        store = spec.get("store")
        source = spec.get("source")
        bucket = spec.get("name")
        if isinstance(source, str) and source.startswith("gs://"):
            url = source
        elif source is not None:
            raise ConfigError(f"{path}: file_mounts.{at} has source: {source}; tpufab mounts "
                              "existing buckets only (name: BUCKET, store: gcs, or "
                              "source: gs://BUCKET), it does not upload local directories.")
        elif bucket:
            if store is not None and str(store).lower() != "gcs":
                raise ConfigError(f"{path}: file_mounts.{at} uses store: {store}; tpufab "
                                  "mounts Cloud Storage only (store: gcs).")
            url = f"gs://{bucket}"
        else:
            raise ConfigError(f"{path}: file_mounts.{at} names no bucket; give name: BUCKET "
                              "and store: gcs.")
        mounts.append(Mount(at, _gs(url, at, path)))
    return tuple(mounts), tuple(files)


def parse_skypilot(data: Mapping, path: str = "task.yaml") -> Task:
    _refuse_unknown(data, SKYPILOT_KEYS, "a SkyPilot task", path)
    nodes = data.get("num_nodes", 1)
    if nodes not in (1, None):
        raise ConfigError(f"{path}: num_nodes is {nodes}; a TPU pod is one node to SkyPilot and "
                          "to tpufab (its hosts all run the task): pick a bigger TPU type "
                          "instead.")
    resources = data.get("resources") or {}
    if not isinstance(resources, Mapping):
        if isinstance(resources, list):
            raise ConfigError(f"{path}: resources lists several choices; tpufab launches one "
                              "TPU type: give one resources mapping.")
        raise ConfigError(f"{path}: resources must be a mapping.")
    _refuse_unknown(resources, RESOURCE_KEYS, "resources", path)
    for key in ("cloud", "infra"):
        where = resources.get(key)
        if where is not None and not str(where).lower().startswith("gcp"):
            raise ConfigError(f"{path}: resources.{key} is {where}; Cloud TPUs are on gcp.")
    if resources.get("region") and not resources.get("zone"):
        raise ConfigError(f"{path}: resources.region is {resources['region']}; tpufab creates "
                          "TPUs in a zone: set resources.zone (or pass --zone).")
    args = resources.get("accelerator_args") or {}
    if not isinstance(args, Mapping):
        raise ConfigError(f"{path}: resources.accelerator_args must be a mapping.")
    _refuse_unknown(args, ACCELERATOR_ARGS, "resources.accelerator_args", path)
    if args.get("tpu_vm") is False:
        raise ConfigError(f"{path}: accelerator_args.tpu_vm is False, which asks for the legacy "
                          "TPU Node architecture; tpufab launch supports TPU VMs only: remove "
                          "tpu_vm or set it to True.")
    accelerator = resources.get("accelerators")
    labels = resources.get("labels") or {}
    if not isinstance(labels, Mapping):
        raise ConfigError(f"{path}: resources.labels must be a mapping.")
    secrets = _envs(data.get("secrets"), "secrets", path)
    envs = {**_envs(data.get("envs"), "envs", path), **secrets}
    mounts, files = _skypilot_mounts(data.get("file_mounts"), path)
    return Task(
        source="skypilot", path=path, name=_text(data.get("name"), "name", path),
        type=skypilot_accelerator(accelerator, path) if accelerator is not None else None,
        zone=_text(resources.get("zone"), "resources.zone", path),
        spot=_bool(resources.get("use_spot"), "resources.use_spot", path),
        runtime_version=_text(args.get("runtime_version"), "runtime_version", path),
        labels={str(k): str(v) for k, v in labels.items()},
        envs=envs, secret_envs=tuple(secrets),
        setup=_script(data.get("setup"), "setup", path), run=_script(data.get("run"), "run", path),
        workdir=_text(data.get("workdir"), "workdir", path), mounts=mounts, files=files)


def parse_task(data: Any, path: str = "task.yaml") -> Task:
    """A task from a loaded YAML document: SkyPilot's when it has SkyPilot-only keys."""
    if data is None:
        raise ConfigError(f"{path} is empty; a task needs at least `run:`.")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path} must hold a mapping (key: value), not a "
                          f"{type(data).__name__}.")
    if any(key in data for key in SKYPILOT_ONLY):
        return parse_skypilot(data, path)
    return parse_tpufab(data, path)


def load_task(path: str | Path) -> Task:
    """Read and parse a task file; one sentence when it cannot be read."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"No task file at {path}; pass the path of a task YAML.") from None
    except OSError as err:
        raise ConfigError(f"Cannot read the task file {path} ({err.strerror}).") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path} is not valid YAML{where}; fix it and launch again.") from None
    return parse_task(data, str(path))


def resolve_envs(task: Task, given: Iterable[str], local_env: Mapping[str, str]) -> list[str]:
    """``--env`` specs for the run: the task's envs, a value-less one filled from ``--env K=V``
    or the local environment (else one sentence naming it), then the ``--env`` flags."""
    given = list(given)
    flagged = {spec.partition("=")[0] for spec in given}
    specs = []
    for name, value in task.envs.items():
        if name in flagged:
            continue
        if value is None:
            if name not in local_env:
                raise ConfigError(f"{task.path}: env {name} has no value; pass --env {name}=VALUE "
                                  f"or export {name} before launching.")
            specs.append(name)
        else:
            specs.append(f"{name}={value}")
    return [*specs, *given]
