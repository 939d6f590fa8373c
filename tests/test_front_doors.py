"""Both front doors come from one declaration per verb, and agree.

The `tpufab` Typer app and the invoke collection (tpufab.tasks) are generated from the same
`@verb` declarations; these tests read what each front door really exposes (click's commands,
invoke's parser arguments) and compare them, so a verb or flag present in one and missing,
renamed or defaulted differently in the other fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def typer_doors() -> dict[str, dict[str, object]]:
    """`sim up` -> {"--port": default, ..., "<name>": "argument"} from the real click app."""
    import typer

    from tpufab.cli import build_app

    app = build_app()

    out: dict[str, dict[str, object]] = {}

    def walk(command, path: tuple[str, ...]) -> None:
        if hasattr(command, "commands"):   # a group (typer vendors its own click)
            for name, sub in command.commands.items():
                walk(sub, (*path, name))
            return
        flags: dict[str, object] = {}
        for param in command.params:
            if param.name == "help":
                continue
            if param.param_type_name == "argument":
                if param.nargs == -1:           # trailing words: invoke takes them after --
                    continue
                if param.required:
                    flags[f"<{param.name}>"] = "argument"
                else:                           # invoke: an argument that may be left out
                    flags[f"--{param.name}"] = param.default   # is a flag
                continue
            long = sorted(o for o in param.opts if o.startswith("--"))
            default = param.default
            if isinstance(default, tuple | list):
                default = list(default) or None
            for flag in long:
                flags[flag] = None if default is False else default
            flags.update({o: "short" for o in param.opts if not o.startswith("--")})
        out[" ".join(path)] = flags

    walk(typer.main.get_command(app), ())
    return out


def invoke_doors() -> dict[str, dict[str, object]]:
    from tpufab.tasks import ns

    out: dict[str, dict[str, object]] = {}
    for path in ns.task_names:
        task = ns[path]
        flags: dict[str, object] = {}
        for arg in task.get_arguments():
            if arg.names == ("debug",):
                continue
            if arg.positional:
                flags[f"<{arg.name}>"] = "argument"
                continue
            default = arg.default
            if isinstance(default, list):
                default = default or None
            for name in arg.names:
                if len(name) == 1:
                    flags[f"-{name}"] = "short"
                else:
                    flags[f"--{name}"] = None if default is False else default
        out[path.replace(".", " ")] = flags
    return out


def test_both_front_doors_have_the_same_verbs_flags_and_defaults():
    typer_side, invoke_side = typer_doors(), invoke_doors()
    assert sorted(typer_side) == sorted(invoke_side)
    for verb in typer_side:
        t, i = typer_side[verb], invoke_side[verb]
        assert sorted(t) == sorted(i), verb
        for flag in t:
            if t[flag] in ("argument", "short"):
                continue
            # invoke passes numbers as given on its command line; compare values, not types
            assert str(t[flag]) == str(i[flag]), (verb, flag, t[flag], i[flag])


def test_every_verb_the_project_documents_is_a_front_door():
    doors = typer_doors()
    for verb in ("init", "use", "create", "delete", "list", "describe", "types", "exec",
                 "setup", "ssh", "deploy", "mount", "umount", "run", "logs", "runs", "kill",
                 "status", "babysit", "known-hosts forget", "sim up", "sim down", "sim status",
                 "sim preempt", "sim unreachable", "sim fail-create", "sim burst",
                 "sim zombie", "sim bucket"):
        assert verb in doors, verb
    assert "--raw" in doors["run"] and "--json" in doors["status"]
    assert "<command>" not in doors["ssh"]   # trailing words, in both doors (invoke: after --)


def test_verb_modules_are_called_by_name_not_by_string():
    """No `getattr(verbs, name)` dispatch and no module __getattr__ in the front doors or the
    verb modules; no library module imports a verb module."""
    for path in [REPO / "tpufab" / "cli.py", REPO / "tpufab" / "tasks.py",
                 *(REPO / "tpufab" / "verbs").glob("*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                assert node.name != "__getattr__", path
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr":
                assert not (isinstance(node.args[0], ast.Name) and "verb" in node.args[0].id), path
    for path in (REPO / "tpufab").rglob("*.py"):
        if "verbs" in path.parts or path.name in ("cli.py", "tasks.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("tpufab.verbs"), path
                if node.module == "tpufab":
                    assert "verbs" not in {a.name for a in node.names}, path


@pytest.mark.parametrize("verb", ["create", "run", "kill"])
def test_help_names_each_flag_once_in_both_doors(verb):
    from tpufab.verbs import all_verbs

    declared = next(v for v in all_verbs() if v.path == verb)
    flags = [f for p in declared.params() if not p.positional for f in p.flags]
    assert len(flags) == len(set(flags)), flags
