"""Worker-side scripts: the one seam. Ship by content hash, run, read the last JSON line.

Every worker-side program (deploy_worker.py, mount_worker.py, facts_worker.py, run_worker.py,
kill_worker.py, zombie_worker.py, the setup runner and the user's setup script) goes through here:
``run_script`` runs a shipped script and ``read_answer`` reads what it answered.

Files a command needs on the workers are shipped only where they are missing.

A file lives on a worker at ``~/.cache/tpufab/remote/<sha256[:16]>/<name>`` (the layout
deploy uses, so both share that cache). A command that needs files is *verified*: a small
loader (``remote/verify.py``, sent on the command line, so nothing on the worker's disk runs
unchecked)
reads each of them and checks its whole sha256; where one is missing or differs (any process
of the login user can write that cache) it exits 97 without output and does nothing else;
``run_with_files`` then ships the files to those workers only and runs the command there
again. Otherwise it runs the very bytes it hashed: a Python script is compiled from them in
the loader's process, a shell script is handed to ``sh -c`` as those bytes, and the other
files it needs are handed over as sealed in-memory copies (``/dev/fd/N``) where Python has
``os.memfd_create``. So the usual case, everything already there and intact, still costs one
round trip (and a hash of a few KB on the worker).

Commands are built from quoted pieces (``tpufab.quoting``); the worker user's login shell
runs them, as ``ssh host CMD`` would, from the home directory (relative paths below).

A bundled Python script that imports the worker-side library (``from tpufab.remote.workerlib
import ...``, one line) is shipped with the library's body in place of that line (``bundle``),
so it still runs alone (``python3 -I -S FILE``, or from stdin) and its hash covers both.
"""

from __future__ import annotations

import functools
import hashlib
import re
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path

from tpufab.quoting import Command, Piece, Raw, Secret, command
from tpufab.remote.workerlib import ANSWER as ANSWER  # the answer codec, one for both sides
from tpufab.remote.workerlib import ANSWER_TAG as ANSWER_TAG
from tpufab.remote.workerlib import parse_answer as parse_answer
from tpufab.remote.workerlib import read_answer as read_answer
from tpufab.remote.workerlib import read_answers as read_answers
from tpufab.ssh.results import GroupResult

CACHE_DIR = ".cache/tpufab/remote"
MISSING = 97   # the guard's exit status


@dataclass(frozen=True)
class RemoteFile:
    """Bytes to keep on every worker under a path that names their content."""

    name: str
    data: bytes = field(repr=False)
    mode: int = 0o644

    @classmethod
    def bundled(cls, name: str) -> RemoteFile:
        """A worker-side file shipped with tpufab (``tpufab/remote/NAME``), as it is shipped:
        a Python script with the worker-side library inlined (``bundle``)."""
        return _bundled(name)

    @classmethod
    def from_path(cls, path: str | Path, *, mode: int = 0o755) -> RemoteFile:
        path = Path(path)
        return cls(path.name, path.read_bytes(), mode)

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def path(self) -> str:
        """Relative to the worker user's home."""
        return f"{CACHE_DIR}/{self.sha256[:16]}/{self.name}"


_BUNDLED: dict[str, RemoteFile] = {}
# One bundle at a time: ast.parse in two threads at once can fail in CPython ("AST constructor
# recursion depth mismatch"), and every connection thread bundles the fan-out agent first.
_BUNDLING = threading.Lock()


def _bundled(name: str) -> RemoteFile:
    found = _BUNDLED.get(name)
    if found is not None:
        return found
    with _BUNDLING:
        found = _BUNDLED.get(name)
        if found is not None:
            return found
        folder = resources.files("tpufab.remote")
        data = folder.joinpath(name).read_bytes()
        if name.endswith(".py"):
            library = folder.joinpath(LIBRARY).read_bytes()
            for attempt in range(3):
                try:
                    data = bundle(name, data, library)
                    break
                except SystemError:
                    # CPython < 3.12 keeps the AST converter's recursion depth in one place
                    # for the whole interpreter: a parse running into another thread's
                    # (or a finalizer's) fails with "AST constructor recursion depth
                    # mismatch" (gh-106905). Bundling is pure: parse again.
                    if attempt == 2:
                        raise
        found = _BUNDLED[name] = RemoteFile(name, data, 0o644)
        return found


# -- the worker-side library, inlined (pure) ----------------------------------------------------

LIBRARY = "workerlib.py"
LIBRARY_MODULE = "tpufab.remote.workerlib"


# A line that may import from tpufab (or relatively): only a script with one is parsed, so
# the scripts that import nothing (the fan-out agent, read by every process) cost no parse.
_MAY_IMPORT_TPUFAB = re.compile(
    rb"^[^#\n]*\b(?:from[ \t]+(?:tpufab\b|\.)|import\b[^#\n]*\btpufab\b)", re.M)


class BundleError(ValueError):
    """A worker script that cannot stand alone once bundled (a bug in tpufab, not in its use)."""


def bundle(name: str, source: bytes, library: bytes) -> bytes:
    """``source`` (worker script ``name``) made to stand alone: its one top-level statement
    ``from tpufab.remote.workerlib import a, b`` (on one line, or wrapped in parentheses)
    replaced by the parts of ``library`` that define those names and what they use. A
    script without that statement is returned as it is.

    Raises BundleError where the result would not run as the script does locally: any other
    import of tpufab, the statement aliased, repeated or sharing a line, a name the library
    lacks, or a top-level name both define (the library's code would see the script's).
    """
    if not _MAY_IMPORT_TPUFAB.search(source):
        return source
    import ast

    tree = ast.parse(source, filename=name)
    marker = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = ["." * node.level + (node.module or "")]
        else:
            continue
        if not any(m == "tpufab" or m.startswith(("tpufab.", ".")) for m in modules):
            continue
        if modules != [LIBRARY_MODULE] or node not in tree.body or marker is not None or \
                any(alias.asname for alias in node.names) or _shares_a_line(tree, node):
            raise BundleError(
                f"{name} line {node.lineno}: a worker script imports from tpufab only in one "
                f"top-level statement of its own, `from {LIBRARY_MODULE} import a, b` (no "
                f"alias); it cannot stand alone on a worker otherwise")
        marker = node
    if marker is None:
        return source
    lib = ast.parse(library, filename=LIBRARY)
    provided = _top_level_names(lib)
    missing = sorted(alias.name for alias in marker.names if alias.name not in provided)
    if missing:
        raise BundleError(f"{name} imports {', '.join(missing)} from {LIBRARY_MODULE}, "
                          f"which does not define them")
    clash = sorted(n for n, bound in _top_level_names(tree, skip=marker).items()
                   if n in provided and not (bound == provided[n] and bound.startswith("import")))
    if clash:
        raise BundleError(f"{name} defines {', '.join(clash)} at top level, as {LIBRARY} does: "
                          f"rename one (inlined, the library would use the script's)")
    lines = source.splitlines(keepends=True)
    return b"".join([*lines[:marker.lineno - 1],
                     f"# -- from {LIBRARY} (tpufab/remote), inlined by tpufab.ssh.remote_files.bundle\n"
                     .encode(), *_needed(lib, library, [a.name for a in marker.names]),
                     f"\n# -- end of {LIBRARY}\n".encode(), *lines[marker.end_lineno:]])


def _needed(lib, library: bytes, names: list[str]) -> list[bytes]:
    """The lines of the library's top-level statements that bind ``names`` and, in turn,
    every library name those use, in the library's order (so a script carries only what
    it uses, and its hash changes only when that does)."""
    import ast

    binders: dict[str, int] = {}
    for index, node in enumerate(lib.body):
        if not isinstance(node, (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign,
                                 ast.FunctionDef, ast.ClassDef)) and \
                not (index == 0 and isinstance(node, ast.Expr)):     # the docstring
            raise BundleError(f"{LIBRARY} line {node.lineno}: only imports, assignments, "
                              f"functions and classes at top level (bundle keeps by name)")
        for name in _top_level_names(ast.Module(body=[node], type_ignores=[])):
            binders[name] = index
    keep: set[int] = set()
    todo = list(names)
    while todo:
        index = binders.get(todo.pop())
        if index is None or index in keep:
            continue
        keep.add(index)
        todo += [n.id for n in ast.walk(lib.body[index]) if isinstance(n, ast.Name)]
    source = library.splitlines(keepends=True)
    out: list[bytes] = []
    previous = None
    for index in sorted(keep):
        node = lib.body[index]
        first = min([node.lineno, *[d.lineno for d in getattr(node, "decorator_list", ())]])
        if previous is not None:      # PEP 8's blank lines, as in the library itself
            blank = isinstance(node, (ast.FunctionDef, ast.ClassDef)) * 2 or \
                int(type(node) is not type(previous))
            out.append(b"\n" * blank)
        out += source[first - 1:node.end_lineno]
        previous = node
    return out


def _shares_a_line(tree, node) -> bool:
    """Another top-level statement starts or ends on one of ``node``'s lines (``a; b``)."""
    return any(other is not node and other.lineno <= node.end_lineno
               and other.end_lineno >= node.lineno for other in tree.body)


def _top_level_names(tree, skip=None) -> dict[str, str]:
    """{name: what binds it} for the names a module binds at top level (but in ``skip``):
    ``import M`` binds M to module M, the same in a script and the library (no clash)."""
    import ast

    found: dict[str, str] = {}
    for node in tree.body:
        if node is skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                found[alias.asname or alias.name.split(".")[0]] = \
                    "import " + (alias.name if alias.asname else alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                found[alias.asname or alias.name] = f"from {node.module} import {alias.name}"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = f"def {node.name}"
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        found[leaf.id] = f"{leaf.id} ="
    return found


# -- commands (pure) ----------------------------------------------------------------------------


@functools.cache
def verify_loader() -> str:
    """``L=<remote/verify.py without its comments>;exec(L)``: the loader every shipped file
    is run through (on the command line: nothing on the worker's disk runs unchecked)."""
    body = resources.files("tpufab.remote").joinpath("verify.py").read_text()
    code = "\n".join(line for line in body.splitlines()
                     if line.strip() and not line.lstrip().startswith("#"))
    return f"L={code!r};exec(L)"


def verified_args(files: Sequence[RemoteFile], args: Sequence[Piece]) -> list[Piece]:
    """``-c LOADER N H1 P1 ... ARGS`` for a Python: run ``files[0]`` with ``args`` once every
    one of ``files`` is on the worker with its sha256, else exit 97 (remote/verify.py)."""
    pieces: list[Piece] = ["-c", verify_loader(), len(files)]
    for f in files:
        pieces += [f.sha256, f.path]
    return [*pieces, *args]


def verified(files: Sequence[RemoteFile], args: Sequence[Piece]) -> list[Piece]:
    """``python3 -I -S -c LOADER N H1 P1 ... ARGS`` (see ``verified_args``)."""
    return ["python3", "-I", "-S", *verified_args(files, args)]


def shell_command(script: RemoteFile, args: Sequence[Piece], *,
                  needs: Sequence[RemoteFile] = ()) -> Command:
    """Run a shipped POSIX sh script, verified (remote/verify.py): the script's own bytes through
    ``sh -c``, and each of ``needs`` named in ``args`` as a sealed in-memory copy."""
    if not script.name.endswith(".sh"):
        raise ValueError(f"{script.name}: a shell script shipped by tpufab ends with .sh")
    return command("exec", *verified([script, *[f for f in needs if f != script]], args))


def python_command(script: RemoteFile, args: Sequence[Piece], *,
                   needs: Sequence[RemoteFile] = (), as_root: bool = False,
                   from_stdin: bool = False) -> Command:
    """Run a shipped stdlib-only Python script (``python3 -I -S``) once every file is there,
    each with its sha256 (the bytes run are the bytes checked: remote/verify.py).

    ``as_root``: through ``sudo -n`` when the login user is not root and may use sudo
    without a password (as on TPU VMs); otherwise as the user, and the script says what it
    could not see. ``from_stdin``: the script's source comes on stdin instead (``python3
    -``), so nothing is needed on the worker's disk (see ``run_with_files``' ``from_memory``).
    """
    if from_stdin:
        run: list[Piece] = ["python3", "-I", "-S", "-", *args]
    else:
        run = verified([script, *[f for f in needs if f != script]], args)
    if not as_root:
        return command("exec", *run)
    return command(Raw('if [ "$(id -u)" != 0 ] && sudo -n true 2>/dev/null;'),
                   Raw("then exec sudo -n"), *run, Raw("; else exec"), *run, Raw("; fi"))


# -- what workers answer (pure) -----------------------------------------------------------------


# The one answer codec is shared with the worker side (tpufab/remote/workerlib.py): a script
# writes ``answer(kind, payload)``; the host reads with read_answer / read_answers /
# parse_answer (imported above, from there) and nowhere else.


# -- running ------------------------------------------------------------------------------------


def missing_files(outcome) -> bool:
    """The guard's answer (a file missing, or not of its sha256): exit 97 and not a byte of
    output (real commands always print)."""
    return (outcome.exit_code == MISSING and outcome.error is None
            and outcome.stdout_output.size == 0 and outcome.stderr_output.size == 0)


def ship(group, files: Sequence[RemoteFile], workers: Sequence[int]) -> GroupResult:
    """Put ``files`` on ``workers``; returns the failed puts by worker."""
    failed: dict[int, object] = {}
    for f in files:
        todo = [w for w in workers if w not in failed]
        if not todo:
            break
        put = group.put(f.data, f.path, workers=todo, mode=f.mode, check=False)
        failed.update({w: r for w, r in put.items() if not r.ok})
    return GroupResult(failed, f"put {', '.join(f.name for f in files)}")


def run_with_files(group, files: Sequence[RemoteFile], line: str, workers: Sequence[int], *,
                   env: Mapping[str, str] | None = None,
                   secrets: Mapping[str, Secret] | None = None, stdin: bytes | None = None,
                   sink=None, timeout: float | None = None,
                   from_memory: str | None = None, cancel=None) -> GroupResult:
    """Run a guarded command (see ``guard``); ship what is missing where it is, run again there.

    ``from_memory``: the same command with its one file (a Python script) read from stdin
    (``python_command(..., from_stdin=True)``), run where shipping failed because the disk
    is full: what must work on a full disk (kill, status) needs no space there.
    Returns the one command-result container (``{worker: WorkerResult}``: a GroupResult);
    a failed put stands in for a worker it failed on.
    """
    kwargs = {"env": env, "secrets": secrets, "stdin": stdin, "sink": sink, "timeout": timeout}
    if cancel is not None:       # a threading.Event that stops the command everywhere
        kwargs["cancel"] = cancel
    results = dict(group.run(line, workers=list(workers), **kwargs))
    missing = [w for w, r in results.items() if missing_files(r)]
    if missing:
        failed = ship(group, files, missing)
        full = [w for w, r in failed.items() if from_memory is not None and stdin is None
                and len(files) == 1 and "No space left" in (r.error or "")]
        results.update({w: r for w, r in failed.items() if w not in full})
        again = [w for w in missing if w not in failed]
        if again:
            results.update(group.run(line, workers=again, **kwargs))
        if full:
            results.update(group.run(from_memory, workers=full,
                                     **{**kwargs, "stdin": files[0].data}))
    return GroupResult(results, " ".join(f.name for f in files))


def run_script(group, script: RemoteFile | str, args: Sequence[Piece], workers: Sequence[int], *,
               as_root: bool = False, env: Mapping[str, str] | None = None,
               secrets: Mapping[str, Secret] | None = None, sink=None,
               timeout: float | None = None, from_memory: bool = False,
               cancel=None) -> GroupResult:
    """Run a stdlib-only worker script (bundled with tpufab when given by name) on
    ``workers`` in one round trip each, shipping it first where it is missing
    (``from_memory``: or sending it on stdin where the disk is too full to ship it).

    Returns a GroupResult (``{worker: WorkerResult}``); read each answer with
    ``read_answer(result.stdout)``.
    """
    if isinstance(script, str):
        script = RemoteFile.bundled(script)
    line = python_command(script, args, as_root=as_root)
    memory = python_command(script, args, as_root=as_root, from_stdin=True) if from_memory \
        else None
    return run_with_files(group, [script], line, workers, env=env, secrets=secrets, sink=sink,
                          timeout=timeout, from_memory=memory, cancel=cancel)


def put_each(group, contents: Mapping[int, bytes], path: str, *, mode: int = 0o600,
             threads: int = 32) -> GroupResult:
    """Write different bytes to the same path on each worker, all at once.

    One put per worker (a put carries one content for its whole selection), run from a small
    thread pool so the round trips overlap. Connections must be open already (``open``).
    Returns a GroupResult (``{worker: WorkerResult}``).
    """
    def one(worker: int):
        return worker, group.put(contents[worker], path, workers=[worker], mode=mode,
                                 check=False)[worker]

    if len(contents) == 1:
        return GroupResult(dict([one(next(iter(contents)))]), f"put {path}")
    with ThreadPoolExecutor(max_workers=min(threads, len(contents)),
                            thread_name_prefix="tpufab-put") as pool:
        return GroupResult(dict(pool.map(one, sorted(contents))), f"put {path}")

