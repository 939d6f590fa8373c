"""The simulated pod's base image: small, Python and the workers' JAX, built once per machine.

Docker Hub is not reachable here, so the image is made from what this machine has: layer 1 is
the files of a few installed Debian packages and everything they depend on (bash, coreutils,
python3, procps: ``dpkg``'s own file lists, docs and manuals left out), with an os-release of
its own (``ID=tpufab-sim``) so a job can tell the image from the worker it runs on; layer 2 is
the shared site of ``scripts/sim-wheels.sh`` (JAX, jaxlib, numpy, scipy, requests) in
``/usr/local/lib/python3.X/dist-packages``. Both are written as an OCI image layout (gzip
level 1 layers, a config, a manifest) with no container storage involved, kept under
``<share>/image/`` with a stamp (the site's stamp and the package list), and pushed with
``skopeo copy`` to the simulated registry (tpufab.sim.registry). ``derive`` makes an image
``FROM`` it: the same layers and one more (a few files), for tests and users' images.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from tpufab.errors import SimError

# libstdc++6: jaxlib's C++ (numpy and scipy carry their own libraries in their wheels)
ROOTS = ("base-files", "bash", "coreutils", "dash", "python3", "grep", "sed", "findutils",
         "procps", "debianutils", "libstdc++6")
SKIP_PREFIXES = ("/usr/share/doc/", "/usr/share/man/", "/usr/share/info/", "/usr/share/locale/",
                 "/usr/share/lintian/", "/usr/share/bug/")
MERGED = ("bin", "sbin", "lib", "lib64")   # usrmerge: /bin -> usr/bin ...
OS_RELEASE = ('PRETTY_NAME="tpufab simulated base image (Debian 12 packages)"\n'
              'NAME="tpufab-sim"\nID=tpufab-sim\nID_LIKE=debian\nVERSION_ID="1"\n')
REPOSITORY = "tpufab/base"
MEDIA = {"manifest": "application/vnd.oci.image.manifest.v1+json",
         "config": "application/vnd.oci.image.config.v1+json",
         "layer": "application/vnd.oci.image.layer.v1.tar"}


def _closure(roots: Iterable[str]) -> list[str]:
    """The installed packages ``roots`` need (Depends and Pre-Depends, alternatives: the
    first installed one), roots included."""
    out = subprocess.run(["dpkg-query", "-W", "-f",
                          "${Package}\t${Status}\t${Pre-Depends}, ${Depends}\n"],
                         capture_output=True, text=True, check=True).stdout
    deps: dict[str, list[list[str]]] = {}
    for line in out.splitlines():
        name, status, rest = (line.split("\t") + ["", ""])[:3]
        if "installed" not in status.split():
            continue
        alternatives = []
        for clause in rest.split(","):
            names = [part.strip().split(" ")[0].split(":")[0] for part in clause.split("|")]
            names = [n for n in names if n]
            if names:
                alternatives.append(names)
        deps[name] = alternatives
    seen: set[str] = set()
    todo = [r for r in roots if r in deps]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for names in deps.get(name, []):
            found = next((n for n in names if n in deps), None)
            if found and found not in seen:
                todo.append(found)
    return sorted(seen)


def _package_files(packages: Iterable[str]) -> list[str]:
    info = Path("/var/lib/dpkg/info")
    paths: set[str] = set()
    for name in packages:
        for candidate in (info / f"{name}.list", info / f"{name}:amd64.list",
                          info / f"{name}:arm64.list"):
            if candidate.exists():
                paths.update(p for p in candidate.read_text().splitlines() if p and p != "/.")
                break
    return sorted(p for p in paths if not p.startswith(SKIP_PREFIXES))


def _merged(path: str) -> str:
    first, _, rest = path.lstrip("/").partition("/")
    return f"usr/{first}/{rest}".rstrip("/") if first in MERGED else path.lstrip("/")


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0
    tar.addfile(info, io.BytesIO(data))


def _add_dir(tar: tarfile.TarFile, name: str, mode: int = 0o755) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, 0
    tar.addfile(info)


def _system_layer(packages: list[str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in MERGED:
            link = tarfile.TarInfo(name)
            link.type, link.linkname, link.mtime = tarfile.SYMTYPE, f"usr/{name}", 0
            tar.addfile(link)
        for name, mode in (("tmp", 0o1777), ("root", 0o700), ("proc", 0o555), ("sys", 0o555),
                           ("dev", 0o755), ("run", 0o755), ("home", 0o755), ("var", 0o755),
                           ("var/tmp", 0o1777), ("etc", 0o755), ("usr", 0o755),
                           ("usr/lib", 0o755)):
            _add_dir(tar, name, mode)
        done: set[str] = {*MERGED, "tmp", "root", "proc", "sys", "dev", "run", "home", "var",
                          "var/tmp", "etc", "usr", "usr/lib"}
        chosen: dict[str, str] = {}
        for path in _package_files(packages):
            if path.strip("/") in MERGED or not os.path.lexists(path):
                continue          # /bin itself is the link above
            if path.startswith("/usr/") or _merged(path) not in chosen:
                chosen[_merged(path)] = path
        for name in sorted(chosen):
            path = chosen[name]
            if name in done or name in OWN_FILES:
                continue
            parts = name.split("/")[:-1]
            for i in range(1, len(parts) + 1):   # a folder before what it holds
                folder = "/".join(parts[:i])
                if folder not in done:
                    done.add(folder)
                    _add_dir(tar, folder)
            done.add(name)
            info = tar.gettarinfo(path, arcname=name)
            info.mtime, info.uname, info.gname = 0, "", ""
            if info.isreg():
                with open(path, "rb") as fh:
                    tar.addfile(info, fh)
            elif info.isdir() or info.issym():
                tar.addfile(info)
        etc = {**OWN_FILES}
        for name, text in etc.items():
            _add_bytes(tar, name, text.encode())
    return buf.getvalue()


OWN_FILES = {"etc/passwd": "root:x:0:0:root:/root:/bin/bash\n"
             "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
             "etc/group": "root:x:0:\nnogroup:x:65534:\n",
             "etc/hostname": "tpufab-sim-image\n",
             "usr/lib/os-release": OS_RELEASE, "etc/tpufab-image": "tpufab simulated base\n"}


def _site_layer(site: Path, pyver: str) -> bytes:
    buf = io.BytesIO()
    base = f"usr/local/lib/python{pyver}/dist-packages"
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for part in ("usr/local", "usr/local/lib", f"usr/local/lib/python{pyver}", base):
            _add_dir(tar, part)
        for entry in sorted(site.iterdir()):
            if entry.name.startswith(".") or entry.name == "bin":
                continue
            tar.add(str(entry), arcname=f"{base}/{entry.name}",
                    filter=lambda i: (setattr(i, "mtime", 0) or i))
    return buf.getvalue()


def tiny(target: Path, files: Mapping[str, bytes]) -> Path:
    """An image of one small layer (no OS: for pulls alone, e.g. bench/image_pull.py)."""
    shutil.rmtree(target, ignore_errors=True)
    layout = Layout(target)
    layout.write([layout.add_layer(files_layer(files))], ["PATH=/usr/bin:/bin"])
    return target


def files_layer(files: Mapping[str, bytes]) -> bytes:
    """A layer of a few files (``{"/etc/x": b"..."}``), their folders made."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs: set[str] = set()
        for path, data in sorted(files.items()):
            name = path.lstrip("/")
            parts = name.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    _add_dir(tar, d)
            _add_bytes(tar, name, data, 0o755 if path.endswith(".sh") else 0o644)
    return buf.getvalue()


class Layout:
    """An OCI image layout on disk (``oci:DIR`` to skopeo), one image in it."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def blob(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        target = self.path / "blobs" / "sha256" / digest
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.rename(target)
        return f"sha256:{digest}"

    def write(self, layers: list[tuple[str, int, str]], env: list[str]) -> str:
        """``layers``: (digest, size, diff_id) each; the manifest's digest."""
        config = {"architecture": "amd64", "os": "linux",
                  "config": {"Env": env, "Cmd": ["/bin/bash"], "WorkingDir": "/",
                             "Labels": {"org.opencontainers.image.title": REPOSITORY}},
                  "rootfs": {"type": "layers", "diff_ids": [d for _, _, d in layers]},
                  "history": [{"created_by": "tpufab.sim.image"} for _ in layers]}
        raw_config = json.dumps(config, sort_keys=True).encode()
        manifest = {"schemaVersion": 2, "mediaType": MEDIA["manifest"],
                    "config": {"mediaType": MEDIA["config"], "digest": self.blob(raw_config),
                               "size": len(raw_config)},
                    "layers": [{"mediaType": MEDIA["layer"], "digest": d, "size": s}
                               for d, s, _ in layers]}
        raw = json.dumps(manifest, sort_keys=True).encode()
        digest = self.blob(raw)
        (self.path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        (self.path / "index.json").write_text(json.dumps({
            "schemaVersion": 2, "manifests": [{"mediaType": MEDIA["manifest"], "digest": digest,
                                               "size": len(raw)}]}))
        (self.path / "layers.json").write_text(json.dumps({"layers": layers, "env": env}))
        return digest

    def layers(self) -> tuple[list[tuple[str, int, str]], list[str]]:
        data = json.loads((self.path / "layers.json").read_text())
        return [tuple(x) for x in data["layers"]], data["env"]

    def add_layer(self, tar_bytes: bytes) -> tuple[str, int, str]:
        diff_id = "sha256:" + hashlib.sha256(tar_bytes).hexdigest()
        return self.blob(tar_bytes), len(tar_bytes), diff_id


def _python_version() -> str:
    out = subprocess.run(["/usr/bin/python3", "-c",
                          "import sys; print('%d.%d' % sys.version_info[:2])"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def build_base(share: Path, *, jax: bool = True) -> Path:
    """The base image's layout under ``share/image/base`` (built if its stamp differs): needs
    the shared site (``share/site``, scripts/sim-wheels.sh). ``jax=False``: the slim one
    (``share/image/slim``: the OS and Python alone, ~50 MB instead of ~650 MB)."""
    site = share / "site"
    site_stamp = None
    if jax:
        try:
            site_stamp = (site / ".tpufab-spec").read_text().strip()
        except OSError:
            raise SimError(f"No shared site in {site}: build it first with "
                           f"scripts/sim-wheels.sh --sim-dir {share.parent}.") from None
    packages = _closure(ROOTS)
    stamp = json.dumps({"site": site_stamp, "packages": packages, "v": 1}, sort_keys=True)
    target = share / "image" / ("base" if jax else "slim")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)     # one build at a time; a second finds it done
        if not (target / ".tpufab-spec").exists() or \
                (target / ".tpufab-spec").read_text() != stamp:
            _build(share, site if jax else None, packages, stamp, target)
    return target


def _build(share: Path, site: Path | None, packages: list[str], stamp: str,
           target: Path) -> None:
    tmp = share / "image" / f".{target.name}.new"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    layout = Layout(tmp)
    layers = [layout.add_layer(_system_layer(packages))]
    if site is not None:
        layers.append(layout.add_layer(_site_layer(site, _python_version())))
    layout.write(layers, ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                          "LANG=C.UTF-8"])
    (tmp / ".tpufab-spec").write_text(stamp)
    os.chmod(tmp, 0o755)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def derive(base: Path, target: Path, files: Mapping[str, bytes]) -> Path:
    """An image FROM ``base``: its layers (hard links to its blobs) plus one of ``files``."""
    shutil.rmtree(target, ignore_errors=True)
    (target / "blobs" / "sha256").mkdir(parents=True)
    for blob in (base / "blobs" / "sha256").iterdir():
        try:
            os.link(blob, target / "blobs" / "sha256" / blob.name)
        except OSError:
            shutil.copy2(blob, target / "blobs" / "sha256" / blob.name)
    layers, env = Layout(base).layers()
    layout = Layout(target)
    layout.write([*layers, layout.add_layer(files_layer(files))], env)
    return target


def push(layout: Path, reference: str, *, authfile: Path) -> str:
    """``skopeo copy`` the layout to ``reference`` (``HOST:PORT/PATH:TAG``, plain HTTP); the
    manifest digest the registry now holds for it."""
    if shutil.which("skopeo") is None:
        raise SimError("skopeo is missing: apt-get install skopeo (scripts/bootstrap.sh does).")
    digest_file = layout / ".pushed-digest"
    copy = subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false",
                           "--dest-compress-format", "zstd", "--dest-compress-level", "1",
                           "--dest-authfile", str(authfile), "--digestfile", str(digest_file),
                           f"oci:{layout}", f"docker://{reference}"], capture_output=True,
                          text=True, timeout=600)
    if copy.returncode != 0:
        raise SimError(f"Could not push {reference}: {copy.stderr.strip()[-400:]}")
    return digest_file.read_text().strip()


def publish(registry: Mapping, share: Path, *, project: str, tag: str = "latest",
            name: str = "base", files: Mapping[str, bytes] | None = None,
            jax: bool = True) -> tuple[str, str]:
    """Build the base image if needed (under ``share``, beside its site), and push it (or,
    with ``files``, an image FROM it with those files added) to the running pod's registry
    (``registry``: SimAdmin.registry()'s answer) as ``PROJECT/tpufab/NAME:TAG``; returns
    (the reference as workers pull it, ``us-docker.pkg.dev/...:TAG``, its digest).
    ``jax=False``: the slim base (no shared site needed)."""
    base = build_base(Path(share), jax=jax)
    layout = base if files is None else derive(base, Path(share) / "image" / f".{name}-{tag}",
                                               files)
    return push_layout(registry, layout, project=project, name=name, tag=tag)


def push_layout(registry: Mapping, layout: Path, *, project: str, name: str,
                tag: str) -> tuple[str, str]:
    """Push an OCI layout to the pod's registry as ``PROJECT/tpufab/NAME:TAG``: (the
    reference as workers pull it, its digest)."""
    token = Path(registry["pushTokenFile"]).read_text().strip()
    auth = Path(registry["pushTokenFile"]).with_name("push-auth.json")
    auth.touch(mode=0o600)
    os.chmod(auth, 0o600)
    address = registry["address"]
    encoded = base64.b64encode(f"oauth2accesstoken:{token}".encode()).decode()
    auth.write_text(json.dumps({"auths": {address: {"auth": encoded}}}))
    path = f"{project}/tpufab/{name}:{tag}"
    digest = push(layout, f"{address}/{path}", authfile=auth)
    return f"us-docker.pkg.dev/{path}", digest
