"""Every verb declared once: a verb function plus `@verb(...)` is the whole declaration.

The function's signature gives the flags, their types and defaults; `@verb` adds the help of
each flag (the common ones, such as --name or --worker, have theirs here) and short flags.
Both front doors are generated from the declarations (`tpufab.cli` builds the Typer app,
`tpufab.tasks` the invoke collection), so they cannot drift, and a test compares them.

    @verb(options={"spot": "Spot capacity."})
    def create(*, name: str | None = None, spot: bool = False, ...) -> None:
        '''Create a TPU VM node and wait until it is READY.'''

Kinds of parameter: keyword-only with a default is an option (`--flag`; a bool is a switch,
a list is repeatable); one without a default is a positional argument; `Rest` marks the
trailing words (after ``--`` for invoke). Nothing here imports typer or invoke.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

_KINDS = (bool, int, float, str)


@dataclass(frozen=True)
class Opt:
    """What a signature cannot say about one parameter."""

    help: str
    flag: str | None = None            # the long flag, when not --<name with dashes>
    short: str | None = None           # e.g. "-n"
    aliases: tuple[str, ...] = ()      # more long flags, e.g. ("--accelerator-type",)
    metavar: str | None = None
    min: float | None = None
    rest: bool = False                 # the trailing words of the command line
    required: bool = False             # an option (not an argument) that must be given
    argument: bool = False             # a positional argument that may be left out
    hidden: bool = False               # a keyword for tests and the API, not a flag


# Options that many verbs share, said once.
COMMON: dict[str, Opt] = {
    "name": Opt("TPU node name (default: TPUFAB_NAME, tpufab.yaml, else this project's "
                "current pod).", short="-n"),
    "zone": Opt("Zone (default: settings).", short="-z"),
    "project": Opt("Google Cloud project.", short="-p"),
    "as_json": Opt("Print JSON instead of a table.", flag="--json"),
    "worker": Opt("Workers: all, 0, 0,3-5 or w[0-3,7].", short="-w"),
    "timeout": Opt("Seconds before giving up on a worker's command."),
    "env": Opt("Set K=V, or forward the local K (repeatable).", short="-e", metavar="K=V|K"),
    "secret": Opt("As --env, and K is a secret whatever its name (on stdin only, shown as "
                  "***; repeatable).", metavar="K=V|K"),
    "jump": Opt("Reach the workers through this SSH jump host (a bastion in their VPC), at "
                "their internal IPs; no USER: log in as on the workers (the OS Login user "
                "where OS Login is on) (default: the jump setting).",
                metavar="[USER@]HOST[:PORT]"),
    "state_dir": Opt("Where the simulated pod keeps its state (TPUFAB_SIM_DIR)."),
    "color": Opt("Let the workers' own colours through (other control sequences always show "
                 "escaped)."),
    "no_os_login": Opt("Log in with the key in node metadata even where OS Login is on "
                       "(the os_login setting: false)."),
}


@dataclass(frozen=True)
class Param:
    """One flag or argument of a verb, as both front doors show it."""

    name: str                 # the verb function's keyword
    kind: type                # bool, int, float, str, or list (of str)
    default: Any
    help: str
    flag: str                 # "--json" (positional arguments: their metavar)
    short: str | None = None
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    min: float | None = None
    positional: bool = False
    rest: bool = False
    required: bool = False
    optional: bool = False    # may be None ("not given")

    @property
    def flags(self) -> tuple[str, ...]:
        return (self.flag, *self.aliases) + ((self.short,) if self.short else ())


@dataclass(frozen=True)
class Verb:
    fn: Callable[..., Any]
    name: str                          # "create", or "up" in group "sim"
    group: str | None
    help: str
    options: dict[str, Opt] = field(default_factory=dict)
    # The Pod method this verb is the door to ("run" for exec, "start" for run), and the
    # flags that only shape what is printed (the Pod method has every other flag, by name;
    # tests/test_spine.py checks it).
    pod_method: str | None = None
    view: tuple[str, ...] = ()
    # The verb a group runs when given no subcommand (`tpufab jobs` is `tpufab jobs list`).
    default: bool = False

    @property
    def path(self) -> str:
        """`sim up`, `create`."""
        return f"{self.group} {self.name}" if self.group else self.name

    @property
    def summary(self) -> str:
        return self.help.split("\n\n", 1)[0].replace("\n", " ")

    def params(self) -> list[Param]:
        """The parameters, positional ones first in signature order."""
        hints = typing.get_type_hints(self.fn)
        out = []
        for p in inspect.signature(self.fn).parameters.values():
            opt = self.options.get(p.name) or COMMON.get(p.name)
            if opt is not None and opt.hidden:
                continue
            if opt is None:
                raise TypeError(f"{self.path}: parameter {p.name!r} has no help; give it in "
                                "@verb(options=...)")
            kind, optional = _kind(hints.get(p.name, str))
            positional = ((p.default is inspect.Parameter.empty and not opt.required)
                          or opt.rest or opt.argument)
            flag = opt.flag or "--" + p.name.rstrip("_").replace("_", "-")
            out.append(Param(
                name=p.name, kind=kind, help=opt.help, flag=flag, short=opt.short,
                aliases=opt.aliases, metavar=opt.metavar, min=opt.min,
                default=None if p.default is inspect.Parameter.empty else p.default,
                positional=positional, rest=opt.rest,
                required=opt.required or (positional and p.default is inspect.Parameter.empty
                                          and not opt.rest),
                optional=optional or p.default is None))
        return sorted(out, key=lambda q: not q.positional)


def _kind(hint: Any) -> tuple[type, bool]:
    """(bool|int|float|str|list, may be None) for a parameter's type hint."""
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        rest = [a for a in args if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else str
    origin = typing.get_origin(hint)
    if hint in _KINDS:
        return hint, optional
    if origin in (list, tuple, Sequence) or (
            isinstance(origin, type) and issubclass(origin, typing.Iterable)):  # type: ignore[arg-type]
        return list, optional
    return str, optional


# The declared verbs, in the order `tpufab --help` lists them.
DECLARED: list[Verb] = []


def verb(*, name: str | None = None, group: str | None = None,
         options: dict[str, Opt | str] | None = None, pod_method: str | None = None,
         view: Sequence[str] = (), default: bool = False) -> Callable:
    """Declare the decorated function as a verb of both front doors.

    A verb on the workers names its ``pod_method`` (the one tpufab.Pod method it calls) and
    its ``view`` flags (those that only change what is printed: --json, --raw, ...). A
    ``default`` verb of a group also runs for the group's name alone (options only)."""

    def declare(fn: Callable) -> Callable:
        opts = {k: Opt(v) if isinstance(v, str) else v for k, v in (options or {}).items()}
        doc = inspect.cleandoc(fn.__doc__ or "")
        if not doc:
            raise TypeError(f"verb {fn.__name__} needs a docstring: its first line is its help")
        declared = Verb(fn=fn, name=name or fn.__name__.rstrip("_").replace("_", "-"),
                        group=group, help=doc, options=opts, pod_method=pod_method,
                        view=tuple(view), default=default)
        if default and (group is None or any(p.positional for p in declared.params())):
            raise TypeError(f"{declared.path}: a group's default verb takes options only")
        DECLARED.append(declared)
        return fn

    return declare


def call_values(params: Sequence[Param], values: dict[str, Any]) -> dict[str, Any]:
    """Front-door values -> the verb function's keywords, converted to each parameter's kind
    (invoke hands over strings for options without a typed default)."""
    from tpufab.errors import ConfigError

    out = {}
    for p in params:
        value = values.get(p.name, p.default)
        if value is not None and p.kind in (int, float) and not isinstance(value, bool):
            try:
                value = p.kind(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{p.flag} takes a number, not {value!r}.") from None
            if p.min is not None and value < p.min:
                raise ConfigError(f"{p.flag} must be {p.min:g} or more, not {value:g}.")
        if p.kind is list and value is not None:
            value = list(value)
        out[p.name] = value
    return out
