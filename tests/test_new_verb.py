"""Adding a worker verb is what docs/architecture.md's "Add a verb" says, and nothing more: the
four product files of `tpufab snapshot` written into a copy of the tree, and both front doors,
the Pod, the report and the one renderer take it, with no list to add it to."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The files a new worker verb touches (docs/architecture.md, "Add a verb"): four product
# files, its tests and its docs.
FILES = ("tpufab/steps/host/snapshot.py", "tpufab/remote/snapshot_worker.py",
         "tpufab/pod/api.py", "tpufab/verbs/workers.py", "tests/test_snapshot.py",
         "docs/snapshot.md")

STEP = '''"""snapshot: each worker's cache to a bucket, one row per worker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tpufab.reports import Column, Report, answer_row
from tpufab.ssh.remote_files import run_script


@dataclass
class SnapshotRow:
    worker: int
    ok: bool = False
    error: str | None = None
    message: str | None = None
    files: int = 0


@dataclass(kw_only=True)
class SnapshotReport(Report):
    bucket: str


def snapshot_args(bucket: str) -> list[str]:
    return ["--bucket", bucket]


def snapshot(fanout, workers: Sequence[int], bucket: str, *, timeout: float) -> SnapshotReport:
    outcomes = run_script(fanout, "snapshot_worker.py", snapshot_args(bucket), workers,
                          timeout=timeout)
    rows = [answer_row(SnapshotRow, w, outcomes[w]) for w in workers]
    return SnapshotReport(step="snapshot", bucket=bucket, rows=rows,
                          columns=(Column("FILES", lambda r: str(r.files)),),
                          summary=f"Saved {len(rows)} caches to {bucket}.")
'''
WORKER = '''"""Save this worker's cache to a bucket (stdlib only)."""

from tpufab.remote.workerlib import answer

answer("answer", {"ok": True, "files": 0})
'''
METHOD = '''
    def snapshot(self, bucket: str, *, workers: str | Iterable[int] = "all",
                 timeout: float | None = None) -> SnapshotReport:
        """`tpufab snapshot`: each worker's cache to ``bucket``."""
        from tpufab.steps.host import snapshot

        return snapshot.snapshot(self.hosts.fanout, self.select(workers), bucket,
                                 timeout=self._timeout("snapshot", timeout))
'''
VERB = '''

@verb(pod_method="snapshot", options={"bucket": "gs://BUCKET/PREFIX to save to."})
def snapshot(call: Call, *, as_json: bool = False) -> None:
    """Save each worker's cache to a bucket, one row per worker.

    ``timeout``: seconds each step on the workers may take."""
    from tpufab.views.report import show

    show(call(), as_json=as_json)
'''
CHECK = r'''
import io, json, sys, typing
from rich.console import Console
import typer.main
from tpufab.cli import build_app
from tpufab.pod.api import Pod
from tpufab.reports import Column
from tpufab.steps.host.snapshot import SnapshotReport, SnapshotRow
from tpufab.tasks import ns
from tpufab.verbs import all_verbs
from tpufab.views.report import show

[verb] = [v for v in all_verbs() if v.path == "snapshot"]
typer_flags = sorted(o for p in typer.main.get_command(build_app()).commands["snapshot"].params
                     for o in p.opts)
invoke_flags = sorted(n for a in ns["snapshot"].get_arguments() for n in a.names)
out = io.StringIO()
show(SnapshotReport(step="snapshot", bucket="gs://b", rows=[SnapshotRow(0, ok=True, files=3),
                                                            SnapshotRow(1, ok=True, files=3)],
                    columns=(Column("FILES", lambda r: str(r.files)),), summary="Saved."),
     console=Console(file=out))
print(json.dumps({"typer": typer_flags, "invoke": invoke_flags,
                  "params": [p.name for p in verb.params()],
                  "returns": typing.get_type_hints(Pod.snapshot, {**vars(sys.modules["tpufab.pod.api"]),
                                                   "SnapshotReport": SnapshotReport})["return"].__name__,
                  "shown": out.getvalue()}))
'''


def _copy_with_a_new_verb(root: Path) -> None:
    shutil.copytree(REPO / "tpufab", root / "tpufab",
                    ignore=shutil.ignore_patterns("__pycache__", "sim"))
    shutil.copytree(REPO / "tpufab" / "sim", root / "tpufab" / "sim",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / FILES[0]).write_text(STEP)
    (root / FILES[1]).write_text(WORKER)
    api = root / FILES[2]
    text = api.read_text()
    pod = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "Pod")
    lines = text.splitlines(keepends=True)
    lines.insert(pod.end_lineno, METHOD)
    text = "".join(lines).replace(
        "if TYPE_CHECKING:\n",
        "if TYPE_CHECKING:\n    from tpufab.steps.host.snapshot import SnapshotReport\n", 1)
    api.write_text(text)
    verbs = root / FILES[3]
    verbs.write_text(verbs.read_text() + VERB)


def test_a_new_worker_verb_is_four_product_files_and_no_list(tmp_path):
    _copy_with_a_new_verb(tmp_path)
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(tmp_path),
                                                       "PATH": "/usr/bin:/bin",
                                                       "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["returns"] == "SnapshotReport"
    # both front doors, with the Pod method's flags and the injected connection flags
    for flag in ("bucket", "--worker", "--timeout", "--json", "--name", "--zone",
                 "--project", "--no-os-login", "--jump"):
        assert flag in seen["typer"], flag
    assert {"bucket", "worker", "timeout", "json", "name", "jump"} <= set(seen["invoke"])
    assert seen["params"][0] == "bucket"
    assert "w[0-1]" in seen["shown"] and "Saved." in seen["shown"]


def test_the_files_it_takes_are_the_ones_the_architecture_names():
    text = (REPO / "docs" / "architecture.md").read_text()
    recipe = text[text.index("## Add a verb"):text.index("## Done means")]
    for path in FILES[:5]:
        assert f"`{path}`" in recipe, path
    assert len(FILES) <= 6
