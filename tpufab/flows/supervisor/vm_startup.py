#!/usr/bin/python3
"""The supervisor VM's startup script (metadata ``startup-script``: root, at every boot).
Stdlib only: it runs on the image's python3 before tpufab is there (docs/supervisor.md).

What it reads: the instance attribute ``tpufab-supervisor`` (JSON: bucket, name, the wheel
objects, the service's module, the environment it runs with, the install id). What it does:

1. downloads the laptop's tpufab wheel from the bucket (with the VM's own token);
2. makes a venv of its own (/opt/tpufab-supervisor/venv; ``apt-get install python3-venv``
   first where the image lacks it) and installs the wheel with its dependencies from the
   package index this VM's pip is set up for (with uv, installed into the venv by pip; pip
   alone if that fails), unless that exact wheel is installed already;
3. makes the service's own user (``tpufab-supervisor``, no login, no sudo), writes the
   systemd unit (Restart=always) and starts it (restarts it after an upgrade);
4. writes what happened to the object ``record`` names
   (``gs://BUCKET/tpufab/supervisor/NAME-install.json``: version, install id, the unit's
   state), which ``supervisor up`` waits for.

Before any of it, it asks testIamPermissions (Cloud Resource Manager, Cloud Storage) with
its own token which of the permissions the service needs its service account lacks; any
missing stops it there, and the record names them.
"""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

METADATA = "http://metadata.google.internal/computeMetadata/v1/"
HOME = "/opt/tpufab-supervisor"
VENV = HOME + "/venv"
STATE = "/var/lib/tpufab-supervisor"
USER = "tpufab-supervisor"
UNIT = "tpufab-supervisor.service"
UNIT_FILE = "/etc/systemd/system/" + UNIT
ENV_FILE = "/etc/tpufab-supervisor.env"
STORAGE = "https://storage.googleapis.com"


def say(text):
    print(f"tpufab-supervisor: {text}", flush=True)


def metadata(path):
    request = urllib.request.Request(METADATA + path, headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.read().decode()


def token():
    return json.loads(metadata("instance/service-accounts/default/token"))["access_token"]


def storage_request(config, method, path, data=None, query=None, content_type=None):
    endpoint = (config.get("storage_endpoint") or STORAGE).rstrip("/")
    url = endpoint + path + ("?" + urllib.parse.urlencode(query) if query else "")
    headers = {"Content-Type": content_type} if content_type else {}
    if endpoint.startswith("https://"):  # a plain-http endpoint (an emulator) is anonymous
        headers["Authorization"] = "Bearer " + token()
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    for attempt in range(6):
        try:
            with urllib.request.urlopen(request, timeout=120) as answer:
                return answer.read()
        except urllib.error.HTTPError as err:
            if err.code < 500 and err.code != 429 or attempt == 5:
                raise
        except OSError:
            if attempt == 5:
                raise
        time.sleep(2 ** attempt)
    return b""


def missing_permissions(config):
    """{permission: role} of what this VM's service account lacks (testIamPermissions of
    Cloud Resource Manager and of Cloud Storage), before anything is installed."""
    asked = config.get("permissions") or {}
    missing = {}
    project = asked.get("project") or {}
    if project:
        url = (config.get("crm_endpoint") or "").rstrip("/") + \
            f"/v3/projects/{config['project']}:testIamPermissions"
        request = urllib.request.Request(
            url, method="POST", data=json.dumps({"permissions": sorted(project)}).encode(),
            headers={"Content-Type": "application/json", "Authorization": "Bearer " + token()})
        with urllib.request.urlopen(request, timeout=60) as answer:
            granted = set(json.loads(answer.read() or b"{}").get("permissions") or ())
        missing.update({p: r for p, r in project.items() if p not in granted})
    bucket = asked.get("bucket") or {}
    if bucket:
        answer = storage_request(config, "GET", f"/storage/v1/b/{config['bucket']}/iam/"
                                 "testPermissions", query=[("permissions", p) for p in
                                                           sorted(bucket)])
        granted = set(json.loads(answer or b"{}").get("permissions") or ())
        missing.update({p: r for p, r in bucket.items() if p not in granted})
    return missing


def download(config, name, folder):
    quoted = urllib.parse.quote(name, safe="")
    data = storage_request(config, "GET", f"/storage/v1/b/{config['bucket']}/o/{quoted}",
                           query={"alt": "media"})
    path = os.path.join(folder, name.rsplit("/", 1)[-1])
    with open(path, "wb") as f:
        f.write(data)
    return path


def report(config, record):
    storage_request(config, "POST", f"/upload/storage/v1/b/{config['bucket']}/o",
                    data=json.dumps(record).encode(), content_type="application/json",
                    query={"uploadType": "media", "name": config["record"]})


def run(argv, **kw):
    say("$ " + " ".join(argv))
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          **kw)
    for line in proc.stdout.splitlines()[-40:]:
        say("  " + line)
    if proc.returncode != 0:
        last = (proc.stdout.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{' '.join(argv[:3])} exited {proc.returncode}: {last}")
    return proc.stdout


def make_venv():
    if os.path.exists(VENV + "/bin/python"):
        return
    try:
        run(["python3", "-m", "venv", VENV])
    except RuntimeError:  # Debian and Ubuntu images: ensurepip comes with python3-venv
        run(["apt-get", "update", "-qq"])
        run(["apt-get", "install", "-y", "-qq", "python3-venv"],
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        run(["python3", "-m", "venv", "--clear", VENV])


def install(config, wheels):
    """Install the wheels unless these exact ones are installed; True when it did."""
    wanted = {"wheels": config["wheels"], "code_id": config.get("code_id")}
    marker = HOME + "/installed.json"
    try:
        with open(marker) as f:
            if json.load(f) == wanted and os.path.exists(VENV + "/bin/tpufab"):
                say("this tpufab is installed already")
                return False
    except (OSError, ValueError):
        pass
    make_venv()
    pip = [VENV + "/bin/python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    try:  # uv resolves and downloads in parallel: a quarter of pip's time for tpufab's
        if not os.path.exists(VENV + "/bin/uv"):
            run([*pip, "uv"])
        certs = "/etc/ssl/certs/ca-certificates.crt"  # the image's CAs (a proxy's included)
        env = {**os.environ, **({"SSL_CERT_FILE": certs} if os.path.exists(certs) else {})}
        again = [a for w in wheels for a in ("--reinstall-package",
                                            os.path.basename(w).split("-")[0])]
        run([VENV + "/bin/uv", "pip", "install", "--quiet", "--python", VENV + "/bin/python",
             *again, *wheels], env=env)
    except RuntimeError as err:
        say(f"uv did not install them ({err}); pip does")
        run([*pip, "--force-reinstall", "--no-deps", *wheels])
        run([*pip, *wheels])
    with open(marker, "w") as f:
        json.dump(wanted, f)
    return True


def service_user():
    if subprocess.run(["id", "-u", USER], capture_output=True).returncode != 0:
        run(["useradd", "--system", "--user-group", "--home-dir", STATE, "--shell",
             "/usr/sbin/nologin", USER])
    os.makedirs(STATE, exist_ok=True)
    run(["chown", "-R", f"{USER}:{USER}", STATE])
    os.chmod(STATE, 0o700)


def write_unit(config):
    env = {**config.get("env", {}), "HOME": STATE}
    fd = os.open(ENV_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"{k}={v}\n" for k, v in sorted(env.items())))
    subprocess.run(["chgrp", USER, ENV_FILE], check=False)
    argv = [VENV + "/bin/python", "-m", config["module"], "serve", "--bucket",
            config["bucket"], "--name", config["name"], *config.get("args", [])]
    text = "\n".join([
        "[Unit]",
        "Description=tpufab supervisor (keeps supervised jobs going; docs/supervisor.md)",
        "Wants=network-online.target",
        "After=network-online.target",
        "",
        "[Service]",
        f"User={USER}",
        f"Group={USER}",
        f"WorkingDirectory={STATE}",
        f"EnvironmentFile={ENV_FILE}",
        "ExecStart=" + " ".join(argv),
        "Restart=always",
        "RestartSec=2",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ])
    with open(UNIT_FILE, "w") as f:
        f.write(text)


def unit_state():
    proc = subprocess.run(["systemctl", "is-active", UNIT], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def main():
    config = json.loads(metadata("instance/attributes/tpufab-supervisor"))
    with open("/proc/uptime") as f:
        booted_at = time.time() - float(f.read().split()[0])
    record = {"install_id": config.get("install_id"), "version": config.get("version"),
              "code_id": config.get("code_id"), "booted_at": booted_at, "ok": False}
    seconds = record["seconds"] = {}   # how long each step took

    def step(name, started):
        seconds[name] = round(time.monotonic() - started, 2)
        return time.monotonic()

    try:
        at = time.monotonic()
        record["missing"] = missing_permissions(config)
        if record["missing"]:
            raise RuntimeError("the service account lacks " + ", ".join(sorted(
                record["missing"])))
        at = step("permissions", at)
        os.makedirs(HOME + "/wheels", exist_ok=True)
        wheels = [download(config, name, HOME + "/wheels") for name in config["wheels"]]
        at = step("download", at)
        upgraded = install(config, wheels)
        at = step("install", at)
        service_user()
        write_unit(config)
        run(["systemctl", "daemon-reload"])
        run(["systemctl", "enable", UNIT])
        run(["systemctl", "restart" if upgraded else "start", UNIT])
        at = step("unit", at)
        record["installed"] = run([VENV + "/bin/tpufab", "--version"]).strip()
        record["unit"] = unit_state()
        step("check", at)
        record["ok"] = record["unit"] == "active"
        if not record["ok"]:
            record["error"] = f"the service unit is {record['unit']} after its start"
    except Exception as err:  # noqa: BLE001 - reported where `supervisor up` reads it
        record["error"] = str(err)
        say(f"failed: {err}")
    record["at"] = time.time()
    report(config, record)
    say("done" if record["ok"] else "not done: " + record.get("error", ""))
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
