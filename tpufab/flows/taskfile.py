"""Task files for `tpufab launch` (pure): tpufab's own schema and SkyPilot task YAMLs.

Both become one ``Task``. tpufab's schema (top-level keys):

    name, type, zone, spot, runtime_version, envs, setup, run, workdir, mounts, files

SkyPilot's (as its TPU docs write them): ``name``, ``workdir``, ``num_nodes`` (1),
``resources: {accelerators: tpu-v6e-8, accelerator_args: {runtime_version, tpu_vm},
use_spot, zone, cloud/infra: gcp, labels}``, ``envs``, ``secrets``, ``file_mounts``, ``setup``,
``run``. A file is SkyPilot's when it has ``resources``, ``file_mounts``, ``num_nodes``
or ``secrets``. Unknown keys and known-but-unsupported values are refused with one sentence.

A task file comes from other people, so it is read as untrusted data: at most
``MAX_TASK_BYTES`` of UTF-8 text, parsed by a YAML loader that refuses a key given twice in
one mapping, nesting deeper than ``MAX_YAML_DEPTH`` and a document that, with its aliases
(``*name``) expanded, holds more than ``MAX_YAML_VALUES`` values or ``MAX_YAML_TEXT``
characters (the "billion laughs" of nested aliases), and every field's type is checked
before it is used (one sentence naming the field, the type it takes and what it was given).
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
                 "infra", "labels", "image_id")
ACCELERATOR_ARGS = ("runtime_version", "tpu_vm", "tpu_name")
MOUNT_KEYS = ("name", "source", "store", "mode", "persistent")
TPUFAB_MOUNT_KEYS = ("bucket", "driver", "options")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_TASK_BYTES = 1 << 20       # a task file is a page of YAML, not a data set
MAX_YAML_VALUES = 100_000      # values (nodes) once aliases are expanded
MAX_YAML_TEXT = 8 << 20        # characters of scalars once aliases are expanded
MAX_YAML_DEPTH = 64            # nested sequences / mappings


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
    region: str | None = None                     # SkyPilot's infra: gcp/REGION, region:
    spot: bool | None = None
    runtime_version: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    envs: Mapping[str, str | None] = field(default_factory=dict)   # None: must be given
    secret_envs: tuple[str, ...] = ()             # SkyPilot `secrets:` names
    inline_secrets: tuple[str, ...] = ()          # secrets whose value the file itself holds
    setup: str | None = None
    run: str | None = None
    workdir: str | None = None
    mounts: tuple[Mount, ...] = ()
    files: tuple[FileCopy, ...] = ()
    image: str | None = None                      # SkyPilot's resources.image_id: docker:IMAGE


def given(value: Any) -> str:
    """What a task file gave, in a few words (never the whole of a long value)."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (true/false)"
    if isinstance(value, int | float):
        return f"{value!r} (a number)"
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:37] + "...")
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__}"


def _refuse_unknown(data: Mapping, allowed: Iterable[str], where: str, path: str) -> None:
    allowed = list(allowed)
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1) \
                if isinstance(key, str) else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: unknown key {given(key)} in {where}{hint}; {where} "
                              f"takes {', '.join(allowed)}.")


def _text(value: Any, key: str, path: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"{path}: {key} must be text, not {given(value)}.")
    return str(value)


def _required_text(value: Any, key: str, path: str) -> str:
    if value is None:
        raise ConfigError(f"{path}: {key} must be text, not {given(value)}.")
    return _text(value, key, path) or ""


def _mapping(value: Any, key: str, path: str, what: str = "a mapping") -> Mapping:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: {key} must be {what}, not {given(value)}.")
    return value


def _script(value: Any, key: str, path: str) -> str | None:
    if isinstance(value, list):
        lines = [_text(v, f"{key}[{n}]", path) for n, v in enumerate(value)]
        if None in lines:
            raise ConfigError(f"{path}: {key}[{lines.index(None)}] must be text (a line of the "
                              "script), not nothing (null).")
        return "\n".join(lines)
    if isinstance(value, Mapping):
        raise ConfigError(f"{path}: {key} must be text (a script) or a list of lines, not "
                          f"{given(value)}.")
    return _text(value, key, path)


def _bool(value: Any, key: str, path: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ConfigError(f"{path}: {key} must be true or false, not {given(value)}.")


def _envs(value: Any, key: str, path: str) -> dict[str, str | None]:
    value = _mapping(value, key, path, "a mapping of NAME: value")
    out: dict[str, str | None] = {}
    for name, v in value.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise ConfigError(f"{path}: {key} has {given(name)}, which is not a variable name.")
        if v is None or v == "":
            out[name] = None
        elif isinstance(v, bool):
            out[name] = "true" if v else "false"
        else:
            out[name] = _text(v, f"{key}.{name}", path)
            if "\0" in (out[name] or ""):
                raise ConfigError(f"{path}: {key}.{name} holds a NUL byte, which no "
                                  "environment variable can carry; remove it.")
    return out


def inline_secrets(envs: Mapping[str, str | None], secrets: Iterable[str]) -> tuple[str, ...]:
    """The secrets a task file gives a value of its own: every ``secrets:`` entry, and an env
    whose name is a secret's (``HF_TOKEN``, ``DB_PASS``; tpufab.quoting.is_secret_name), with
    a value in the file."""
    from tpufab.quoting import is_secret_name

    secrets = set(secrets)
    return tuple(sorted(name for name, value in envs.items() if value is not None
                        and (name in secrets or is_secret_name(name))))


def _gs(source: str, at: str, path: str) -> str:
    if not source.startswith("gs://"):
        raise ConfigError(f"{path}: the mount at {at} reads {source!r}; tpufab mounts Cloud "
                          "Storage buckets only (gs://BUCKET[/PREFIX]).")
    return source


def _tpufab_mounts(value: Any, path: str) -> tuple[Mount, ...]:
    value = _mapping(value, "mounts", path, "a mapping of mount point: bucket (e.g. "
                     "`/mnt/data: gs://my-bucket`)")
    out = []
    for at, spec in value.items():
        at = _required_text(at, "a mount point in mounts", path)
        if isinstance(spec, str):
            source = spec if spec.startswith("gs://") else f"gs://{spec}"
            out.append(Mount(at, _gs(source, at, path)))
            continue
        if not isinstance(spec, Mapping) or "bucket" not in spec:
            raise ConfigError(f"{path}: mounts.{at} must be gs://BUCKET or a mapping with "
                              f"bucket (and optionally driver, options), not {given(spec)}.")
        _refuse_unknown(spec, TPUFAB_MOUNT_KEYS, f"mounts.{at}", path)
        bucket = _required_text(spec["bucket"], f"mounts.{at}.bucket", path)
        source = bucket if bucket.startswith("gs://") else f"gs://{bucket}"
        options = spec.get("options") or []
        if isinstance(options, str):
            import shlex

            try:
                options = shlex.split(options)
            except ValueError as err:
                raise ConfigError(f"{path}: mounts.{at}.options cannot be split like a shell "
                                  f"would ({err}); fix its quotes.") from None
        elif isinstance(options, list):
            options = [_required_text(o, f"mounts.{at}.options[{n}]", path)
                       for n, o in enumerate(options)]
        else:
            raise ConfigError(f"{path}: mounts.{at}.options must be text or a list of text, "
                              f"not {given(options)}.")
        out.append(Mount(at, _gs(source, at, path),
                         _text(spec.get("driver"), f"mounts.{at}.driver", path), tuple(options)))
    return tuple(out)


def _files(value: Any, key: str, path: str) -> tuple[FileCopy, ...]:
    value = _mapping(value, key, path, "a mapping of a path on the workers to a local path")
    return tuple(FileCopy(_required_text(remote, f"a path on the workers in {key}", path),
                          _required_text(local, f"{key}.{remote}", path))
                 for remote, local in value.items())


def parse_tpufab(data: Mapping, path: str = "task.yaml") -> Task:
    _refuse_unknown(data, TPUFAB_KEYS, "a tpufab task file", path)
    return Task(
        source="tpufab", path=path, name=_text(data.get("name"), "name", path),
        type=_text(data.get("type"), "type", path), zone=_text(data.get("zone"), "zone", path),
        spot=_bool(data.get("spot"), "spot", path),
        runtime_version=_text(data.get("runtime_version"), "runtime_version", path),
        envs=_envs(data.get("envs"), "envs", path),
        inline_secrets=inline_secrets(_envs(data.get("envs"), "envs", path), ()),
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
        value = (f"{_required_text(name, 'resources.accelerators', path)}:"
                 f"{_required_text(count, f'resources.accelerators.{name}', path)}")
    if isinstance(value, list):
        raise ConfigError(f"{path}: resources.accelerators lists several choices; tpufab launches "
                          "one TPU type: name one, e.g. tpu-v6e-8.")
    text = (_text(value, "resources.accelerators", path) or "").strip()
    name, _, count = text.partition(":")
    if not name.lower().startswith("tpu-") and not _tpufab_type(name):
        raise ConfigError(f"{path}: resources.accelerators is {text!r}; tpufab launches Cloud "
                          "TPUs only (tpu-v4-32, tpu-v6e-8, ...).")
    if count and count.strip() != "1":
        raise ConfigError(f"{path}: resources.accelerators asks for {count.strip()} x {name}; a "
                          f"TPU slice is one accelerator: ask for a bigger type (e.g. "
                          f"{name.rsplit('-', 1)[0]}-N) instead.")
    return name


def _tpufab_type(name: str) -> bool:
    """tpufab's own spelling of a type (``tpu7x-16``, ``v6e-8``), taken as SkyPilot's is."""
    from tpufab.topology import parse_accelerator_type

    try:
        parse_accelerator_type(name)
    except (ConfigError, ValueError):
        return False
    return True


def _skypilot_mounts(value: Any, path: str) -> tuple[tuple[Mount, ...], tuple[FileCopy, ...]]:
    value = _mapping(value, "file_mounts", path, "a mapping of a path on the workers to a "
                     "source")
    mounts, files = [], []
    for at, spec in value.items():
        at = _required_text(at, "a path on the workers in file_mounts", path)
        if isinstance(spec, str):
            if re.match(r"^[a-z0-9]+://", spec):
                raise ConfigError(f"{path}: file_mounts.{at} copies {spec}; tpufab does not copy "
                                  "from buckets: mount it instead ({name: BUCKET, store: gcs, "
                                  "mode: MOUNT}).")
            files.append(FileCopy(at, spec))
            continue
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{path}: file_mounts.{at} must be a local path or a storage "
                              f"mapping (name, store, mode), not {given(spec)}.")
        _refuse_unknown(spec, MOUNT_KEYS, f"file_mounts.{at}", path)
        mode = _required_text(spec.get("mode", "MOUNT"), f"file_mounts.{at}.mode", path).upper()
        _bool(spec.get("persistent"), f"file_mounts.{at}.persistent", path)
        if mode != "MOUNT":
            raise ConfigError(f"{path}: file_mounts.{at} uses mode: {mode}; tpufab supports "
                              "mode: MOUNT for buckets (a FUSE mount on every worker).")
        store = _text(spec.get("store"), f"file_mounts.{at}.store", path)
        source = _text(spec.get("source"), f"file_mounts.{at}.source", path)
        bucket = _text(spec.get("name"), f"file_mounts.{at}.name", path)
        if isinstance(source, str) and source.startswith("gs://"):
            url = source
        elif source is not None:
            raise ConfigError(f"{path}: file_mounts.{at} has source: {source}; tpufab mounts "
                              "existing buckets only (name: BUCKET, store: gcs, or "
                              "source: gs://BUCKET), it does not upload local directories.")
        elif bucket:
            if store is not None and store.lower() != "gcs":
                raise ConfigError(f"{path}: file_mounts.{at} uses store: {store}; tpufab "
                                  "mounts Cloud Storage only (store: gcs).")
            url = f"gs://{bucket}"
        else:
            raise ConfigError(f"{path}: file_mounts.{at} names no bucket; give name: BUCKET "
                              "and store: gcs.")
        mounts.append(Mount(at, _gs(url, at, path)))
    return tuple(mounts), tuple(files)


def _skypilot_place(resources: Mapping, path: str) -> tuple[str | None, str | None]:
    """(zone, region) from ``infra: gcp[/REGION[/ZONE]]``, ``region`` and ``zone``, checked
    against each other: never dropped, and two that disagree are refused in one sentence."""
    infra = _text(resources.get("infra"), "resources.infra", path)
    zone = _text(resources.get("zone"), "resources.zone", path)
    region = _text(resources.get("region"), "resources.region", path)
    if infra is not None:
        parts = infra.strip().split("/")
        if parts[0].lower() != "gcp" or len(parts) > 3 or not all(parts):
            raise ConfigError(f"{path}: resources.infra is {given(infra)}; Cloud TPUs are on "
                              "gcp: write gcp, gcp/REGION or gcp/REGION/ZONE (such as "
                              "gcp/us-east5/us-east5-b).")
        infra_region = parts[1] if len(parts) > 1 and parts[1] != "*" else None
        infra_zone = parts[2] if len(parts) > 2 and parts[2] != "*" else None
        for mine, theirs, what in ((infra_region, region, "region"),
                                   (infra_zone, zone, "zone")):
            if mine and theirs and mine != theirs:
                raise ConfigError(f"{path}: resources.infra names {what} {mine} and "
                                  f"resources.{what} {theirs}; give one of them.")
        region, zone = region or infra_region, zone or infra_zone
    if zone and region and zone_region(zone) != region:
        raise ConfigError(f"{path}: zone {zone} is not in region {region}; name a zone of "
                          f"{region} (such as {region}-b), or drop the region.")
    return zone, region


def zone_region(zone: str) -> str:
    """``us-east5-b`` -> ``us-east5``."""
    return zone.rsplit("-", 1)[0]


def parse_skypilot(data: Mapping, path: str = "task.yaml") -> Task:
    _refuse_unknown(data, SKYPILOT_KEYS, "a SkyPilot task", path)
    nodes = data.get("num_nodes", 1)
    if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int)):
        raise ConfigError(f"{path}: num_nodes must be a whole number (1), not {given(nodes)}.")
    if nodes not in (1, None):
        raise ConfigError(f"{path}: num_nodes is {nodes}; a TPU pod is one node to SkyPilot and "
                          "to tpufab (its hosts all run the task): pick a bigger TPU type "
                          "instead.")
    resources = data.get("resources") or {}
    if isinstance(resources, list):
        raise ConfigError(f"{path}: resources lists several choices; tpufab launches one "
                          "TPU type: give one resources mapping.")
    resources = _mapping(resources, "resources", path)
    _refuse_unknown(resources, RESOURCE_KEYS, "resources", path)
    cloud = _text(resources.get("cloud"), "resources.cloud", path)
    if cloud is not None and cloud.lower() != "gcp":
        raise ConfigError(f"{path}: resources.cloud is {given(cloud)}; Cloud TPUs are on gcp.")
    zone, region = _skypilot_place(resources, path)
    args = _mapping(resources.get("accelerator_args") or {}, "resources.accelerator_args", path)
    _refuse_unknown(args, ACCELERATOR_ARGS, "resources.accelerator_args", path)
    tpu_vm = args.get("tpu_vm")
    if not isinstance(tpu_vm, str):         # SkyPilot's own files write True/False
        _bool(tpu_vm, "resources.accelerator_args.tpu_vm", path)
    _text(args.get("tpu_name"), "resources.accelerator_args.tpu_name", path)
    if tpu_vm is False:
        raise ConfigError(f"{path}: accelerator_args.tpu_vm is False, which asks for the legacy "
                          "TPU Node architecture; tpufab launch supports TPU VMs only: remove "
                          "tpu_vm or set it to True.")
    accelerator = resources.get("accelerators")
    labels = _mapping(resources.get("labels") or {}, "resources.labels", path)
    labels = {_required_text(k, "a label name in resources.labels", path):
              _required_text(v, f"resources.labels.{k}", path) for k, v in labels.items()}
    secrets = _envs(data.get("secrets"), "secrets", path)
    envs = {**_envs(data.get("envs"), "envs", path), **secrets}
    mounts, files = _skypilot_mounts(data.get("file_mounts"), path)
    return Task(
        source="skypilot", path=path, name=_text(data.get("name"), "name", path),
        type=skypilot_accelerator(accelerator, path) if accelerator is not None else None,
        zone=zone, region=region,
        spot=_bool(resources.get("use_spot"), "resources.use_spot", path),
        runtime_version=_text(args.get("runtime_version"),
                              "resources.accelerator_args.runtime_version", path),
        labels=labels,
        envs=envs, secret_envs=tuple(secrets),
        inline_secrets=inline_secrets(envs, secrets),
        setup=_script(data.get("setup"), "setup", path), run=_script(data.get("run"), "run", path),
        workdir=_text(data.get("workdir"), "workdir", path), mounts=mounts, files=files,
        image=_image_id(resources.get("image_id"), path))


def _image_id(value: Any, path: str) -> str | None:
    """SkyPilot's ``image_id: docker:IMAGE``: the image every host runs the task in."""
    from tpufab.steps.host.images import check_image

    text = _text(value, "resources.image_id", path)
    if text is None:
        return None
    if not text.startswith("docker:"):
        raise ConfigError(f"{path}: resources.image_id is {given(text)}; on a TPU VM tpufab runs "
                          "the task in a container image: give image_id: docker:IMAGE (the VM's "
                          "own image is its runtime version, accelerator_args.runtime_version).")
    try:
        return check_image(text)
    except ConfigError as err:
        raise ConfigError(f"{path}: resources.image_id: {err}") from None


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


class _Refused(Exception):
    """A task file's YAML goes past a limit: the sentence after the file's name."""


def _children(node: Any) -> list:
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _duplicate_keys(node: Any) -> None:
    import yaml

    seen: dict[str, int] = {}
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        line = key.start_mark.line + 1
        if key.value in seen:
            raise _Refused(f"gives the key {given(key.value)} twice (lines {seen[key.value]} and "
                           f"{line}); keep one.")
        seen[key.value] = line


def check_yaml_tree(root: Any) -> None:
    """Refuse a composed YAML document that refers to itself, repeats a key in a mapping,
    or with its aliases expanded holds more than MAX_YAML_VALUES values or MAX_YAML_TEXT
    characters. Each distinct node is visited once (aliases share nodes), so the check
    itself costs the size of the file, not of the expansion."""
    import yaml

    sizes: dict[int, tuple[int, int]] = {}     # id(node) -> (values, characters) expanded
    in_progress: set[int] = set()              # the current node's ancestors
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            in_progress.discard(key)
            values, chars = 1, len(node.value) if isinstance(node, yaml.ScalarNode) else 0
            for child in _children(node):
                v, c = sizes[id(child)]
                values, chars = values + v, chars + c
            if values > MAX_YAML_VALUES or chars > MAX_YAML_TEXT:
                raise _Refused(f"expands, through its aliases (*name), to more than "
                               f"{MAX_YAML_VALUES} values or {MAX_YAML_TEXT >> 20} MiB of text "
                               f"(at line {node.start_mark.line + 1}); a task file is far "
                               "smaller: write the values out or drop the nested aliases.")
            sizes[key] = (values, chars)
            continue
        if key in sizes:
            continue
        if key in in_progress:
            raise _Refused(f"refers to itself (an alias inside its own anchor, line "
                           f"{node.start_mark.line + 1}); a task is a tree of values.")
        in_progress.add(key)
        if isinstance(node, yaml.MappingNode):
            _duplicate_keys(node)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)


def _loader(text: str) -> Any:
    """PyYAML's safe loader, with the limits above (refused while composing, before any
    value is built)."""
    import yaml

    class TaskLoader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            self.depth += 1
            try:
                if self.depth > MAX_YAML_DEPTH:
                    raise _Refused(f"nests values more than {MAX_YAML_DEPTH} deep (at line "
                                   f"{self.peek_event().start_mark.line + 1}); a task is "
                                   "a few levels of keys.")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def compose_document(self):
            node = super().compose_document()
            check_yaml_tree(node)
            return node

    return TaskLoader(text)


def parse_yaml(text: str) -> Any:
    """A task file's text as data, or _Refused / yaml.YAMLError."""
    loader = _loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load_task(path: str | Path) -> Task:
    """Read and parse a task file; one sentence when it cannot be read, is not text, is
    too big, is not YAML, goes past the loader's limits or has a field of the wrong type."""
    import yaml

    path = Path(path)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_TASK_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"No task file at {path}; pass the path of a task YAML.") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory; pass the path of a task YAML.") from None
    except OSError as err:
        raise ConfigError(f"Cannot read the task file {path} ({err.strerror}).") from None
    if len(data) > MAX_TASK_BYTES:
        raise ConfigError(f"{path} is larger than {MAX_TASK_BYTES >> 20} MiB; a task file is a "
                          "page of YAML: pass the path of a task YAML.")
    try:
        text = data.decode("utf-8")
        if "\0" in text:
            raise UnicodeDecodeError("utf-8", data, text.index("\0"), 0, "NUL")
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text (a binary file?); a task file is YAML: "
                          "pass the path of a task YAML.") from None
    try:
        loaded = parse_yaml(text)
    except _Refused as err:
        raise ConfigError(f"{path} {err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path} is not valid YAML{where}; fix it and launch again.") from None
    return parse_task(loaded, str(path))


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
