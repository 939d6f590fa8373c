"""tpufab's verbs as an invoke collection, generated from the verb declarations (tpufab.verbs).

In your project's tasks.py:

    from tpufab.tasks import *  # noqa: F403  invoke create, setup, run, kill, status ...

and your own `@task`s beside them (they may use tpufab's as `pre=[setup]`). `ns` is the same
collection for those who prefer `namespace = ns`. Settings come from invoke's config stack as
well: a `tpufab:` section in invoke.yaml (or ~/.invoke.yaml, or -f FILE) works like tpufab.yaml.
"""

from __future__ import annotations

import sys
from typing import Any

from invoke import Collection, Task
from invoke.exceptions import Exit
from invoke.parser import Argument

from tpufab.verbs import all_verbs
from tpufab.verbs.declare import Param, Verb, call_values


def _remainder() -> list[str]:
    """The words after `--` on invoke's command line (a verb's trailing arguments)."""
    argv = sys.argv
    return argv[argv.index("--") + 1:] if "--" in argv else []


class VerbTask(Task):
    """An invoke task whose arguments are a declared verb's parameters."""

    def __init__(self, declared: Verb):
        self.declared = declared
        self.declared_params = declared.params()
        super().__init__(self._call, name=declared.name, help={},
                         positional=[p.name for p in self.declared_params
                                     if p.positional and p.required],
                         iterable=[p.name for p in self.declared_params if p.kind is list])
        self.__doc__ = declared.help

    def _call(self, c, **values: Any) -> None:
        from tpufab import config
        from tpufab.term.console import run

        debug = values.pop("debug", False)
        values = {p.name: values[_key(p)] for p in self.declared_params if _key(p) in values}
        for p in self.declared_params:
            if p.rest:
                values[p.name] = _remainder() or None
        section = c.config.get("tpufab") if c is not None else None
        with config.invoke_layer(dict(section) if section else None):
            code = run(self.declared.fn, **call_values(self.declared_params, values),
                       debug=debug)
        if code:
            raise Exit(code=code)

    def get_arguments(self, ignore_unknown_help: bool | None = None) -> list[Argument]:
        args = [_argument(p) for p in self.declared_params if not p.rest]
        args.append(Argument(names=("debug",), kind=bool, default=False,
                             help="Show tracebacks."))
        return args


def _key(p: Param) -> str:
    """The keyword invoke hands a parameter's value over as (its flag, with underscores)."""
    return p.flag.lstrip("-").replace("-", "_")


def _argument(p: Param) -> Argument:
    names = [p.flag.lstrip("-"), *(a.lstrip("-") for a in p.aliases)]
    if p.short:
        names.append(p.short.lstrip("-"))
    kind = p.kind if p.kind in (bool, list) else str
    default = p.default
    if p.kind is list:
        default = list(p.default or [])
    attr = _key(p) if "-" in names[0] else None  # as invoke itself names dashed flags
    # invoke's positional arguments are all required: one that may be left out is a flag there
    return Argument(names=tuple(names), attr_name=attr, kind=kind, default=default,
                    help=p.help, positional=p.positional and p.required)


def _build() -> tuple[Collection, dict[str, Task]]:
    ns = Collection()
    groups: dict[str, Collection] = {}
    top: dict[str, Task] = {}
    for v in all_verbs():
        t = VerbTask(v)
        if v.group:
            if v.group not in groups:
                groups[v.group] = Collection(v.group)
                ns.add_collection(groups[v.group])
            groups[v.group].add_task(t, default=v.default)
        else:
            ns.add_task(t)
            top[v.fn.__name__] = t
    return ns, top


ns, _top = _build()
globals().update(_top)
__all__ = ["ns", *_top]
