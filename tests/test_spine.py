"""The shape of the house (docs/architecture.md): every worker verb is a thin door to one
method of tpufab.Pod with the same parameters, verb modules import only the Pod API and the
front-door helpers, and no module of tpufab imports itself back through another."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from tpufab.pod.api import Pod
from tpufab.verbs import all_verbs

PACKAGE = Path(__file__).resolve().parents[1] / "tpufab"

# The verbs that work on a pod's workers: each calls exactly one Pod method.
WORKER_VERBS = {"exec", "setup", "ssh", "put", "get", "forward", "profile", "deploy", "mount",
                "umount", "run", "logs", "runs", "kill", "status", "check", "babysit",
                "autostop", "top"}
WORKER_VERBS |= {"stacks"}   # issue 27
# Flags every verb turns into Settings (the Pod's own, given when it is made).
CONNECTION = {"name", "zone", "project", "no_os_login", "jump"}
# A verb flag and its Pod parameter where the API keeps Fabric's plural.
ALIASES = {"worker": "workers"}

# What a verb module may import: the Pod API and the front-door helpers.
VERB_IMPORTS = ("tpufab.pod", "tpufab.verbs", "tpufab.views", "tpufab.term", "tpufab.config",
                "tpufab.errors", "tpufab.reports", "tpufab.nodeset", "tpufab.durations", "tpufab.topology",
                "tpufab.current", "tpufab.__version__")
VERB_IMPORTS_OF = {"sim.py": ("tpufab.sim",)}  # the simulated pod's own verbs drive it


def worker_verbs():
    return [v for v in all_verbs() if v.group is None and v.name in WORKER_VERBS]


def test_every_worker_verb_is_declared_with_its_pod_method():
    verbs = worker_verbs()
    assert {v.name for v in verbs} == WORKER_VERBS
    missing = [v.name for v in verbs if not v.pod_method or not hasattr(Pod, v.pod_method)]
    assert not missing, f"worker verbs without a Pod method: {missing}"


@pytest.mark.parametrize("verb", worker_verbs(), ids=lambda v: v.name)
def test_a_worker_verb_and_its_pod_method_take_the_same_parameters(verb):
    method = inspect.signature(getattr(Pod, verb.pod_method or "?"))
    verb_params = inspect.signature(verb.fn).parameters
    wanted = {ALIASES.get(n, n): p for n, p in verb_params.items()
              if n not in CONNECTION and n not in verb.view}
    missing = sorted(set(wanted) - set(method.parameters))
    assert not missing, f"Pod.{verb.pod_method} lacks {missing} of `tpufab {verb.name}`"
    differ = {n: (p.default, method.parameters[n].default) for n, p in wanted.items()
              if p.default is not inspect.Parameter.empty
              and method.parameters[n].default is not inspect.Parameter.empty
              and p.default != method.parameters[n].default}
    assert not differ, f"defaults differ between `tpufab {verb.name}` and Pod: {differ}"


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


def test_verb_modules_import_only_the_pod_api_and_front_door_helpers():
    wrong = {}
    for path in sorted((PACKAGE / "verbs").glob("*.py")):
        allowed = VERB_IMPORTS + VERB_IMPORTS_OF.get(path.name, ())
        bad = [m for m in _imports(path)
               if not any(m == a or m.startswith(a + ".") for a in allowed)]
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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycles_counting_imports_inside_functions():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or None

    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
                for n in ast.walk(node)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # `from tpufab.x import y`: y's module if it is one, else tpufab.x
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                target = resolve(name) if name.startswith("tpufab") else None
                if target and target != mod:
                    deps.add(target)
        graph[mod] = deps

    # Tarjan's strongly connected components: any of more than one module is a cycle.
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


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
    from tpufab.ssh.fanout import FanoutError, GroupResult

    assert tpufab.PodResult is GroupResult and tpufab.PodError is FanoutError


# One report, one renderer (issue 22, point 2): a worker verb's per-worker outcome is a
# tpufab.reports.Report (the step's class adds only its fields), printed, human or --json,
# by tpufab.views.report and nowhere else.
REPORTS = {"setup": "tpufab.steps.host.setup:SetupReport",
           "put": "tpufab.ssh.transfer:TransferReport",
           "get": "tpufab.ssh.transfer:TransferReport",
           "profile": "tpufab.steps.host.profiling:Captured",
           "deploy": "tpufab.steps.code.deploy:DeployReport",
           "mount": "tpufab.steps.host.mount:MountReport",
           "umount": "tpufab.steps.host.mount:MountReport",
           "kill": "tpufab.steps.host.killing:KillResult",
           "autostop": "tpufab.steps.host.autostop:AutostopReport",
           "runs": "tpufab.steps.runs.history:RunsReport",
           "status": "tpufab.steps.health.status:PodStatus",
           "check": "tpufab.steps.health.check:CheckReport",
           "top": "tpufab.steps.health.top:TopFrame",
           "stacks": "tpufab.steps.health.stacks:StacksReport"}
# Worker verbs whose output is not a report of the step: the workers' own output (exec, run,
# logs, babysit's followed run), a shell, live forwards.
NO_REPORT = {"exec", "ssh", "forward", "run", "logs", "babysit"}
# Not on the one report yet: they still render themselves (.lines() / .to_json()). This set
# only shrinks.
REMAINING: set[str] = set()
# Where classes still render themselves: REMAINING's reports and babysit's attempt record
# (its state file, not a report).
RENDER_THEMSELVES = {"flows/babysit/records.py"}
# Records of the control plane and of accelerator shapes: no workers in them.
NOT_WORKER_REPORTS = {"cloud/nodes.py", "cloud/lifecycle.py", "topology.py"}
RENDERING = ("lines", "to_json", "table", "render", "summary")
PRINTING = {"print", "say", "print_table", "print_json", "print_gathered", "print_stacks"}


def _report_class(spec: str) -> type:
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def test_every_worker_verb_says_how_it_reports():
    assert set(REPORTS) | NO_REPORT | REMAINING == WORKER_VERBS
    assert not (set(REPORTS) & (NO_REPORT | REMAINING)) and not NO_REPORT & REMAINING


@pytest.mark.parametrize("verb", sorted(REPORTS))
def test_a_worker_verbs_report_is_the_one_type_and_renders_nothing_itself(verb):
    from tpufab.reports import Report

    cls = _report_class(REPORTS[verb])
    assert issubclass(cls, Report), f"`tpufab {verb}` reports a {cls.__name__}, not a Report"
    own = [name for klass in cls.__mro__ if klass not in Report.__mro__
           for name, value in vars(klass).items() if name in RENDERING and callable(value)]
    assert not own, f"{cls.__name__} renders itself ({own}): tpufab.views.report does"


@pytest.mark.parametrize("verb", sorted(REPORTS))
def test_a_report_with_a_layout_of_its_own_names_a_view_the_renderer_has(verb):
    """One way to a step's own layout: its report's ``view``, a key of display.report.VIEWS
    (whose function lives in a module of tpufab/display); no view: the generic table."""
    from tpufab.views.report import VIEWS

    cls = _report_class(REPORTS[verb])
    assert cls.view == "" or cls.view in VIEWS, f"{cls.__name__}.view {cls.view!r} is not shown"
    assert all(fn.__module__.startswith("tpufab.views.") for fn in VIEWS.values())


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
    [declared] = [v for v in all_verbs() if v.group is None and v.name == verb]
    source = inspect.getsource(declared.fn)
    assert "show(" in source, f"`tpufab {verb}` does not print its report with display.report.show"
    printing = _printing_calls(declared.fn)
    assert not printing, f"`tpufab {verb}` prints outside the one renderer: {printing}"


def test_only_the_renderer_and_the_named_leftovers_render_reports():
    """No library class renders itself (``def lines(self)``, ``to_json``, ``table``) but the
    ones not migrated yet (REMAINING's modules) and records that name no workers."""
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
