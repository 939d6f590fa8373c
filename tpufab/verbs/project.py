"""Verbs about this project: init (tpufab in your own repository) and use (its current pod)."""

from __future__ import annotations

from pathlib import Path

from tpufab.errors import ConfigError
from tpufab.verbs.common import print_json, say, settings_from_flags
from tpufab.verbs.declare import Opt, verb

PLACE = 1   # where this family's verbs show in `tpufab --help`

FRAMEWORKS = {"jax": "jax_hello.sh", "torch": "torch_xla_hello.sh"}


def _template(relative: str) -> bytes:
    from importlib.resources import files

    return files("tpufab").joinpath("templates", relative).read_bytes()


@verb(options={"framework": "jax or torch: what scripts/setup.sh installs and "
                            "recipes/hello.sh runs.",
               "dir": "The project folder (default: here)."})
def init(*, framework: str = "jax", dir: str = ".") -> None:
    """Make this folder a tpufab project: tasks.py, tpufab.yaml, scripts/setup.sh and
    recipes/hello.sh (a file that exists is kept, never overwritten)."""
    if framework not in FRAMEWORKS:
        raise ConfigError(f"--framework takes jax or torch, not {framework!r}.")
    root = Path(dir)
    if not root.is_dir():
        raise ConfigError(f"{dir} is not a folder; create it first or pass --dir PATH.")
    setup = _template("scripts/setup.sh")
    if framework != "jax":
        setup = setup.replace(b"framework=${TPUFAB_FRAMEWORK:-jax}",
                              f"framework=${{TPUFAB_FRAMEWORK:-{framework}}}".encode())
    files = {"tasks.py": (_template("tasks.py"), 0o644),
             "tpufab.yaml": (_template("tpufab.yaml"), 0o644),
             "scripts/setup.sh": (setup, 0o755),
             "recipes/hello.sh": (_template(f"recipes/{FRAMEWORKS[framework]}"), 0o755)}
    wrote, kept = [], []
    for relative, (content, mode) in files.items():
        path = root / relative
        if path.exists():
            kept.append(relative)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(mode)
        wrote.append(relative)
    ignore = root / ".gitignore"
    lines = ignore.read_text().splitlines() if ignore.exists() else []
    if ".tpufab/" not in lines:
        ignore.write_text("".join(f"{line}\n" for line in [*lines, ".tpufab/"]))
        wrote.append(".gitignore (.tpufab/)")
    if wrote:
        say(f"Wrote {', '.join(wrote)}.")
    if kept:
        say(f"Kept {', '.join(kept)} as they are (already there).")
    say("Next: `invoke create --type v4-8` (or tpufab create), `invoke setup`, commit, then "
        "`invoke run recipes/hello.sh`.")


@verb(options={"pod": Opt("The node, queued resource or Compute Engine multislice to make "
                          "current; without it, show the current pod.", argument=True),
               "check": "Check with the cloud that it exists (--no-check to skip)."})
def use(*, pod: str | None = None, zone: str | None = None, project: str | None = None,
        check: bool = True) -> None:
    """Choose this project's current pod: the node verbs use when no --name is given."""
    from tpufab import current
    from tpufab.cloud.names import validate_name
    from tpufab.pod.pods import describe

    if pod is None:
        found = current.read()
        if found is None:
            say("This project has no current pod; `tpufab create --type TYPE` makes one, "
                "`tpufab use NAME` chooses one.")
        else:
            say(f"{found.name}: {found.reason()}.")
        return
    name = validate_name(pod)
    settings = settings_from_flags(name=name, zone=zone, project=project)
    where = ""
    if check:
        # one sentence if there is no such node
        item = describe(name, zone=settings.zone, project=settings.project)
        plane = getattr(item, "plane_title", None)   # the control plane that holds it
        where = f" ({plane})" if plane else ""
        slices = getattr(item, "slices", None)   # a multislice a plane groups itself
        if slices:
            where = (f" ({plane} multislice of {len(slices)} slices: "
                     f"{', '.join(n.name for n in slices)})")
    path = current.remember(name, zone=settings.zone, project=settings.project, set_by="use")
    say(f"{name}{where} is now this project's current pod ({path}).")


# The libraries whose versions change what tpufab does (a bug report names them).
LIBRARIES = ("paramiko", "invoke", "typer", "rich", "tenacity", "pyyaml", "google-cloud-tpu",
             "google-cloud-os-login", "google-api-core", "google-auth", "grpcio")


def versions() -> dict[str, str | None]:
    """tpufab's version, Python's, and the installed version of each library (None: absent).
    Read from package metadata: nothing is imported."""
    import platform
    from importlib import metadata

    from tpufab import __version__

    found: dict[str, str | None] = {
        "tpufab": __version__,
        "python": f"{platform.python_version()} ({platform.python_implementation()}, "
                  f"{platform.system()} {platform.machine()})"}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


@verb()
def version(*, as_json: bool = False) -> None:
    """tpufab's version, Python's and those of the libraries it runs on (for bug reports)."""
    found = versions()
    if as_json:
        print_json(found)
        return
    width = max(len(k) for k in found)
    for key, value in found.items():
        say(f"{key:<{width}}  {value or '-'}")
