"""Every verb declared once: a verb function plus `@verb(...)` is the whole declaration.

A verb on a pod's workers names its `tpufab.Pod` method, and takes its flags from that
method's signature (names, kinds, defaults): the operation's keywords are written once, in
the Pod. The flags that pick and reach the pod (CONNECTION: --name, --zone, --project,
--no-os-login, --jump) are declared here once and injected into every such verb, as pyinfra
injects its connector arguments; so is the road of --timeout (it bounds connecting and every
command of the call, where the timeout table says it bounds commands). The verb function
itself takes the `Call` (the pod and the flags, ready to call) and only its view flags,
those that change what is printed (--json, --raw, ...):

    @verb(pod_method="status", options={"wide": WIDE_HELP})
    def status(call: Call, *, as_json: bool = False, wide: bool = False) -> int:
        '''The node and every worker ...'''
        show(report := call(), as_json=as_json)

Other verbs (create, list, the simulated pod's) take their flags from their own signature:

    @verb(options={"spot": "Spot capacity."})
    def create(*, name: str | None = None, spot: bool = False, ...) -> None:
        '''Create a TPU VM node and wait until it is READY.'''

Kinds of parameter: keyword-only with a default is an option (`--flag`; a bool is a switch,
a list is repeatable; a union's first type decides); one without a default is a positional
argument; `rest=True` marks the trailing words (after ``--`` for invoke). `@verb` adds the
help of each flag (the common ones have theirs in COMMON). Both front doors are generated
from the declarations (`tpufab.cli` builds the Typer app, `tpufab.tasks` the invoke
collection), so they cannot drift, and a test compares them. Nothing here imports typer or
invoke.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tpufab.config import GENERIC, TIMEOUTS

if TYPE_CHECKING:
    from tpufab.config import Settings
    from tpufab.pod.api import Pod

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


# The flags that pick and reach a pod: declared once, injected into every verb on a pod
# (the Pod is made from them: Settings), last in its --help.
CONNECTION: dict[str, Opt] = {
    "name": Opt("TPU node name (default: TPUFAB_NAME, tpufab.yaml, else this project's "
                "current pod).", short="-n"),
    "zone": Opt("Zone (default: settings).", short="-z"),
    "project": Opt("Google Cloud project.", short="-p"),
    "no_os_login": Opt("Log in with the key in node metadata even where OS Login is on "
                       "(the os_login setting: false)."),
    "jump": Opt("Reach the workers through this SSH jump host (a bastion in their VPC), at "
                "their internal IPs; no USER: log in as on the workers (the OS Login user "
                "where OS Login is on) (default: the jump setting).",
                metavar="[USER@]HOST[:PORT]"),
}
CONNECTION_TYPES: dict[str, Any] = {"name": str | None, "zone": str | None,
                                    "project": str | None, "no_os_login": bool,
                                    "jump": str | None}
# Pod method parameters that are never flags: what a front door hands in itself (views,
# progress lines, callbacks).
HOOKS = frozenset({"sink", "progress", "on_event", "on_frame", "out", "console", "view"})

# Options that many verbs share, said once.
COMMON: dict[str, Opt] = {
    **CONNECTION,
    "as_json": Opt("Print JSON instead of a table.", flag="--json"),
    "worker": Opt("Workers: all, 0, 0,3-5 or w[0-3,7].", short="-w"),
    "workers": Opt("Workers: all, 0, 0,3-5 or w[0-3,7].", flag="--worker", short="-w"),
    "timeout": Opt("Seconds before giving up on a worker's command."),
    "env": Opt("Set K=V, or forward the local K (repeatable).", short="-e", metavar="K=V|K"),
    "secret": Opt("As --env, and K is a secret whatever its name (on stdin only, shown as "
                  "***; repeatable).", metavar="K=V|K"),
    "state_dir": Opt("Where the simulated pod keeps its state (TPUFAB_SIM_DIR)."),
    "color": Opt("Let the workers' own colours through (other control sequences always show "
                 "escaped)."),
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


def timeout_help(path: str) -> str:
    """The help of a verb's --timeout, from the timeout table (tpufab.config.TIMEOUTS)."""
    entry = TIMEOUTS.get(path) or TIMEOUTS[GENERIC]
    setting = "; the command_timeout setting when set" if entry.commands else ""
    return f"Seconds for {entry.bounds} (default: {entry.text}{setting})."


@dataclass(frozen=True)
class Verb:
    fn: Callable[..., Any]             # the verb as both front doors call it: every flag
    name: str                          # "create", or "up" in group "sim"
    group: str | None
    help: str
    options: dict[str, Opt] = field(default_factory=dict)
    # The Pod method this verb is the door to ("run" for exec, "start" for run): its flags
    # are that method's parameters, then the verb's own view flags (``view``: those that
    # only shape what is printed), then CONNECTION.
    pod_method: str | None = None
    view: tuple[str, ...] = ()
    body: Callable[..., Any] | None = None   # a pod verb's own function: (call, **view)
    api_only: tuple[str, ...] = ()           # Pod keywords that are not flags (0.1 spellings)
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
        out = []
        for p, hint in _declared(self):
            opt = self.options.get(p.name) or COMMON.get(p.name)
            if opt is not None and opt.hidden:
                continue
            if opt is None:
                raise TypeError(f"{self.path}: parameter {p.name!r} has no help; give it in "
                                "@verb(options=...)")
            kind, optional = _kind(hint)
            rest = opt.rest or p.kind is inspect.Parameter.VAR_POSITIONAL
            if rest:
                kind = list
            empty = p.default is inspect.Parameter.empty
            positional = (empty and not opt.required) or rest or opt.argument
            flag = opt.flag or "--" + p.name.rstrip("_").replace("_", "-")
            text = opt.help
            if p.name == "timeout" and self.pod_method:
                text = timeout_help(self.path)
            out.append(Param(
                name=p.name, kind=kind, help=text, flag=flag, short=opt.short,
                aliases=opt.aliases, metavar=opt.metavar, min=opt.min,
                default=None if empty else p.default,
                positional=positional, rest=rest,
                required=opt.required or (positional and empty and not rest),
                optional=optional or p.default is None))
        return sorted(out, key=lambda q: not q.positional)


@functools.cache
def _hint(module: str, annotation: str) -> Any:
    """A Pod parameter's annotation (a string: postponed annotations), evaluated once."""
    return eval(annotation, vars(sys.modules[module]))


def _declared(v: Verb) -> list[tuple[inspect.Parameter, Any]]:
    """(parameter, type hint) of every flag of ``v``: its own signature's, or for a verb on a
    pod its Pod method's (hooks and the verb's api_only names left out), its view flags and
    CONNECTION."""
    if v.pod_method is None:
        hints = typing.get_type_hints(v.fn)
        return [(p, hints.get(p.name, str)) for p in inspect.signature(v.fn).parameters.values()]
    from tpufab.pod.api import Pod

    method = getattr(Pod, v.pod_method)
    out = []
    for p in list(inspect.signature(method).parameters.values())[1:]:   # self
        if p.name in HOOKS or p.name in v.api_only:
            continue
        hint = _hint(method.__module__, p.annotation) if isinstance(p.annotation, str) \
            else p.annotation
        out.append((p, hint))
    assert v.body is not None
    hints = typing.get_type_hints(v.body)
    for p in inspect.signature(v.body).parameters.values():
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            out.append((p, hints.get(p.name, str)))
    for name, hint in CONNECTION_TYPES.items():
        default = False if hint is bool else None
        out.append((inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default),
                    hint))
    return out


def _kind(hint: Any) -> tuple[type, bool]:
    """(bool|int|float|str|list, may be None) for a parameter's type hint; of a union, its
    first type (``int | str``: an int flag; ``Mapping[str, str] | Sequence[str]``: a list)."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        optional = type(None) in args
        hint = next(a for a in args if a is not type(None))
    origin = typing.get_origin(hint)
    if hint in _KINDS:
        return hint, optional
    if origin in (list, tuple, Sequence) or (
            isinstance(origin, type) and issubclass(origin, typing.Iterable)):  # type: ignore[arg-type]
        return list, optional
    return str, optional


# The declared verbs, in the order `tpufab --help` lists them.
DECLARED: list[Verb] = []


@dataclass
class Call:
    """A verb's one Pod call with the flags it was given: ``call(**more)`` makes it (the verb
    adds its views, progress and callbacks), ``call.args`` are the flags under the Pod
    method's names, ``call.pod`` the pod (made from CONNECTION's flags)."""

    pod: Pod
    method: str
    args: dict[str, Any]

    @property
    def settings(self) -> Settings:
        return self.pod.settings

    def __call__(self, **more: Any) -> Any:
        fn = getattr(self.pod, self.method)
        args = {**self.args, **more}
        spread = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind is inspect.Parameter.VAR_POSITIONAL]
        return fn(*(args.pop(spread[0]) or ()) if spread else (), **args)


class Door:
    """The verb as both front doors call it: every flag a keyword (the positional ones in
    order too); CONNECTION's flags make the Settings and the Pod, the view flags go to the
    verb's body, the rest are the Pod method's keywords (``Call``). Its signature is read
    from the Pod method on first use (`tpufab topology` builds no other verb's)."""

    def __init__(self, declared: Verb):
        self.declared = declared
        body = declared.body
        self.__name__, self.__qualname__ = body.__name__, body.__qualname__
        self.__module__, self.__doc__ = body.__module__, body.__doc__

    @functools.cached_property
    def __signature__(self) -> inspect.Signature:
        v = self.declared
        positional = {q.name for q in v.params() if q.positional}
        parameters = []
        for p, _hint in _declared(v):
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if p.name in positional else \
                inspect.Parameter.KEYWORD_ONLY
            default = () if p.kind is inspect.Parameter.VAR_POSITIONAL else p.default
            parameters.append(inspect.Parameter(p.name, kind, default=default))
        parameters.sort(key=lambda q: q.kind)
        return inspect.Signature(parameters)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from tpufab.pod.api import Pod
        from tpufab.verbs.common import check_timeout, settings_from_flags

        v = self.declared
        bound = self.__signature__.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        connection = {k: values.pop(k) for k in CONNECTION}
        view = {k: values.pop(k) for k in v.view}
        timeout = check_timeout(values["timeout"]) if "timeout" in values else None
        # the timeout's road: where its row bounds commands, it also bounds connecting and
        # every command of the call (the Pod's Settings)
        entry = TIMEOUTS.get(v.path) or TIMEOUTS[GENERIC]
        road = timeout if entry.commands else None
        pod = Pod.from_settings(settings_from_flags(**connection, timeout=road))
        assert v.body is not None and v.pod_method is not None
        return v.body(Call(pod, v.pod_method, values), **view)


def verb(*, name: str | None = None, group: str | None = None,
         options: dict[str, Opt | str] | None = None, pod_method: str | None = None,
         api_only: Sequence[str] = (), default: bool = False) -> Callable:
    """Declare the decorated function as a verb of both front doors.

    A verb on the workers names its ``pod_method`` (the one tpufab.Pod method it calls):
    its flags are that method's parameters (but the HOOKS and ``api_only``), the decorated
    function's keyword-only ones (its view flags) and CONNECTION; the function takes the
    `Call` and its view flags. `@verb` returns the verb as the front doors call it. A
    ``default`` verb of a group also runs for the group's name alone (options only)."""

    def declare(fn: Callable) -> Callable:
        opts = {k: Opt(v) if isinstance(v, str) else v for k, v in (options or {}).items()}
        doc = inspect.cleandoc(fn.__doc__ or "")
        if not doc:
            raise TypeError(f"verb {fn.__name__} needs a docstring: its first line is its help")
        view = () if pod_method is None else tuple(
            p.name for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY)
        declared = Verb(fn=fn, name=name or fn.__name__.rstrip("_").replace("_", "-"),
                        group=group, help=doc, options=opts, pod_method=pod_method, view=view,
                        body=fn if pod_method else None, api_only=tuple(api_only),
                        default=default)
        if default and (group is None or any(p.positional for p in declared.params())):
            raise TypeError(f"{declared.path}: a group's default verb takes options only")
        if pod_method is not None:
            from dataclasses import replace

            declared = replace(declared, fn=Door(declared))
        DECLARED.append(declared)
        return declared.fn

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
