"""The shape of the house (docs/architecture.md): every worker verb is a thin door to one
method of tpufab.Pod whose flags it takes from that method's signature, verb modules import
only the Pod API and the front-door helpers, and no module of tpufab imports itself back
through another. Nothing here is a list kept by hand: the worker verbs are the declarations
that name a Pod method, their reports the return types of those methods."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest
from house import cycles, import_graph, pod_return_types

from tpufab.pod.api import Pod
from tpufab.reports import Report
from tpufab.verbs import all_verbs

PACKAGE = Path(__file__).resolve().parents[1] / "tpufab"

# What a verb module may import: the Pod API and the front-door helpers, and by name the few
# pure helpers below the Pod that a verb prints with or checks a name with.
VERB_IMPORTS = ("tpufab.pod", "tpufab.verbs", "tpufab.views", "tpufab.term", "tpufab.config",
                "tpufab.errors", "tpufab.reports", "tpufab.nodeset", "tpufab.durations",
                "tpufab.topology", "tpufab.current", "tpufab.__version__")
VERB_HELPERS = {"tpufab.cloud.names": {"validate_name", "default_name"}}
VERB_IMPORTS_OF = {"sim.py": ("tpufab.sim", "tpufab.steps.host.killing",
                              "tpufab.steps.host.mount")}  # the simulated pod's own verbs


def worker_verbs():
    """The verbs that work on a pod's workers: those declared with their Pod method."""
    return [v for v in all_verbs() if v.pod_method]


def test_every_worker_verb_names_a_pod_method_and_takes_its_flags():
    verbs = worker_verbs()
    assert len(verbs) >= 25, [v.path for v in verbs]
    for v in verbs:
        method = inspect.signature(getattr(Pod, v.pod_method))
        flags = {p.name for p in v.params()} - {"name", "zone", "project", "no_os_login",
                                                 "jump"} - set(v.view)
        assert flags <= set(method.parameters), (v.path, flags - set(method.parameters))


def test_every_pod_method_returns_a_declared_type_never_any():
    returns = pod_return_types()
    untyped = [name for name, hint in returns.items()
               if hint is inspect.Signature.empty or hint is typing.Any]
    assert not untyped, f"Pod methods without a real return type: {untyped}"


def test_a_verb_is_callable_with_its_flags_as_the_front_doors_call_it():
    """The declared verb takes every flag as a keyword (positional flags in order too), the
    connection flags included, as invoke tasks and tests call it."""
    [status] = [v for v in all_verbs() if v.path == "status"]
    signature = inspect.signature(status.fn)
    assert list(signature.parameters)[-5:] == ["name", "zone", "project", "no_os_login", "jump"]
    assert signature.parameters["timeout"].default is None
    [run] = [v for v in all_verbs() if v.path == "run"]
    assert list(inspect.signature(run.fn).parameters)[:2] == ["recipe", "extra"]


def _imports(path: Path) -> list[str]:
    """Every absolute import of tpufab in a module, those inside functions included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module == "tpufab":
                out += [f"tpufab.{a.name}" for a in node.names]
            else:
                out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return [m for m in out if m == "tpufab" or m.startswith("tpufab.")]


def _imported_names(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) of every `from tpufab... import name` in a module (name None for a
    plain `import`), those inside functions included."""
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
    return [(m, n) for m, n in out if m == "tpufab" or m.startswith("tpufab.")]


def test_verb_modules_import_only_the_pod_api_and_front_door_helpers():
    wrong = {}
    for path in sorted((PACKAGE / "verbs").glob("*.py")):
        allowed = VERB_IMPORTS + VERB_IMPORTS_OF.get(path.name, ())
        bad = [f"{m}.{n}" if n else m for m, n in _imported_names(path)
               if not any(m == a or m.startswith(a + ".") or f"{m}.{n}" == a for a in allowed)
               and n not in VERB_HELPERS.get(m, ())]
        if bad:
            wrong[path.name] = sorted(set(bad))
    assert not wrong, f"verb modules reaching past the Pod API: {wrong}"


def test_no_library_module_imports_a_verb_module():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "verbs" or rel.name in ("cli.py", "tasks.py"):
            continue
        if any(m.startswith("tpufab.verbs") for m in _imports(path)):
            offenders.append(str(rel))
    assert not offenders


def test_no_import_cycles_counting_imports_inside_functions():
    assert not cycles(import_graph(type_checking=False))


def test_no_top_level_folder_holds_more_than_twelve_modules():
    for folder in [PACKAGE, *[p for p in PACKAGE.iterdir() if p.is_dir()]]:
        if folder.name in ("sim", "remote", "templates", "__pycache__"):
            continue  # the simulated pod and the worker side are products of their own
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 12, f"{folder.name}/ holds {len(modules)} modules"


def test_no_module_outside_the_ssh_engine_sets_a_fanouts_timeouts():
    """One road for a timeout: Settings -> the Pod -> each call (a FanoutView); nothing
    outside tpufab/ssh assigns a fan-out's connect_timeout or command_timeout (Settings'
    own fields of those names are the road itself)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ("ssh", "sim", "remote"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and \
                        target.attr in ("connect_timeout", "command_timeout") and \
                        "fan" in ast.unparse(target.value).lower():
                    offenders.append(f"{rel}:{node.lineno}: {ast.unparse(target)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and \
                    len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and \
                    node.args[1].value in ("connect_timeout", "command_timeout"):
                offenders.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, f"a fan-out's timeouts set outside tpufab/ssh: {offenders}"


def test_every_worker_script_answers_through_the_codec():
    """A worker script tells the host what happened only through workerlib.answer (one
    tagged line the host reads with remote_files.read_answer): no script prints its own JSON
    shape on stdout or stderr; the two shell scripts, which cannot import workerlib, write
    the very same tag."""
    from tpufab.remote.workerlib import ANSWER_TAG

    remote = PACKAGE / "remote"
    offenders = []
    for path in sorted(remote.glob("*.py")):
        if path.name in ("workerlib.py", "__init__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func, args = ast.unparse(node.func), [ast.unparse(a) for a in node.args]
            jsonish = any("json.dump" in a for a in args)
            if (func == "print" and jsonish) or \
                    (func in ("sys.stdout.write", "sys.stderr.write") and jsonish) or \
                    (func == "json.dump" and args[1:2] in (["sys.stdout"], ["sys.stderr"])):
                offenders.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:60]}")
    for path in sorted(remote.glob("*.sh")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            writes = "print(" in line or ".write(" in line or \
                line.strip().startswith(("echo", "printf"))
            jsonish = "json.dump" in line or '{"' in line or '{\\"' in line
            if writes and jsonish and ANSWER_TAG not in line:
                offenders.append(f"{path.name}:{number}: {line.strip()[:60]}")
    assert not offenders, f"worker answers outside workerlib.answer: {offenders}"
    answering = [p.name for p in sorted(remote.glob("*.py"))
                 if "answer(" in p.read_text() and p.name != "workerlib.py"]
    assert len(answering) >= 12, answering  # deploy, mount, files, facts, launch, ...


def test_the_api_result_types_are_the_fan_outs_own():
    """One result type: the API's PodResult and PodError ARE the fan-out's GroupResult and
    FanoutError (documented names kept as aliases, docs/api.md), not wrappers."""
    import tpufab
    from tpufab.ssh.results import FanoutError, GroupResult

    assert tpufab.PodResult is GroupResult and tpufab.PodError is FanoutError


# One report, one renderer: a worker verb whose Pod method returns a tpufab.reports.Report
# (the step's class adds only its fields) prints it, human or --json, through
# tpufab.views.report and nowhere else. The others' output is the workers' own (exec, run,
# logs, babysit's followed run), a shell, live forwards, a sentence.
def _reports() -> dict[str, type]:
    returns = pod_return_types()
    return {v.path: returns[v.pod_method] for v in worker_verbs()
            if isinstance(returns[v.pod_method], type)
            and issubclass(returns[v.pod_method], Report)}


REPORTS = _reports()
# Where classes still render themselves: babysit's attempt record (its state file, not a
# report).
RENDER_THEMSELVES = {"flows/babysit/records.py"}
# Records of the control plane and of accelerator shapes: no workers in them.
NOT_WORKER_REPORTS = {"cloud/nodes.py", "cloud/lifecycle.py", "topology.py"}
RENDERING = ("lines", "to_json", "table", "render", "summary")
PRINTING = {"print", "say", "print_json", "print_gathered", "print_stacks"}


def test_most_worker_verbs_report_through_the_one_renderer():
    assert {"setup", "deploy", "status", "check", "kill", "top", "stacks", "runs"} <= set(REPORTS)


@pytest.mark.parametrize("verb", sorted(REPORTS))
def test_a_worker_verbs_report_is_the_one_type_and_renders_nothing_itself(verb):
    cls = REPORTS[verb]
    own = [name for klass in cls.__mro__ if klass not in Report.__mro__
           for name, value in vars(klass).items() if name in RENDERING and callable(value)]
    assert not own, f"{cls.__name__} renders itself ({own}): tpufab.views.report does"


@pytest.mark.parametrize("verb", sorted(REPORTS))
def test_a_report_with_a_layout_of_its_own_names_a_view_the_renderer_has(verb):
    """One way to a step's own layout: its report's ``view``, the name of a module of
    tpufab/views with a ``show`` (tpufab.views.report.view_of); no view: the generic table."""
    from tpufab.views.report import view_of

    cls = REPORTS[verb]
    if cls.view:
        assert view_of(cls.view).__module__ == f"tpufab.views.{cls.view}", cls


def _printing_calls(fn) -> list[str]:
    """Calls in ``fn``'s body that print (progress lambdas aside) and whether it calls show."""
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Lambda):
            return      # progress=lambda text: note(text, "dim"): words on the way, not the report
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) \
                else ""
            if name in PRINTING or name == "note" or name in RENDERING or name == "dumps":
                found.append(name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


@pytest.mark.parametrize("verb", sorted(REPORTS))
def test_a_worker_verb_prints_its_report_through_the_one_renderer_only(verb):
    [declared] = [v for v in all_verbs() if v.path == verb]
    source = inspect.getsource(declared.body)
    assert "show(" in source, f"`tpufab {verb}` does not print its report with views.report.show"
    printing = _printing_calls(declared.body)
    assert not printing, f"`tpufab {verb}` prints outside the one renderer: {printing}"


def test_only_the_renderer_and_the_named_leftovers_render_reports():
    """No library class renders itself (``def lines(self)``, ``to_json``, ``table``) but
    babysit's attempt record and records that name no workers."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(("sim/", "remote/")) or rel in RENDER_THEMSELVES | NOT_WORKER_REPORTS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name in RENDERING[:4] \
                            and [a.arg for a in item.args.args] == ["self"]:
                        offenders.append(f"{rel}: {node.name}.{item.name}")
    assert not offenders, offenders


def test_no_section_is_headed_by_an_issue_number():
    """A section says what it holds (`# -- kept connections, Ray`), not the issue it came
    from (`# --- issue 27: ...`): the history is git's."""
    import re

    headed = [f"{path.relative_to(PACKAGE.parent)}:{n}"
              for path in sorted(PACKAGE.rglob("*.py"))
              for n, line in enumerate(path.read_text().splitlines(), 1)
              if re.match(r"\s*#\s*-+\s*issue \d+", line)]
    assert not headed, headed
