"""`tpufab`: the Typer front end, generated from the verb declarations (tpufab.verbs).

Nothing here is specific to a verb: each declared verb becomes one command whose options are
its parameters. Keep it free of heavy imports: `tpufab --help` must start instantly.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import typer

from tpufab.term.console import run as run_verb
from tpufab.verbs import all_verbs, group_help
from tpufab.verbs.declare import Param, Verb, call_values

_state = {"debug": False}


def _annotation(p: Param) -> Any:
    kind = list[str] if p.kind is list else p.kind
    return kind | None if p.optional and p.kind is not bool else kind


# -- shell completion of the values that are cheap to know here (no SSH, no API call): pod
# names this project remembers, run ids whose logs it keeps, recipe and task files.

def _root() -> Path:
    from tpufab import current

    return current.project_root()


def _pods(incomplete: str) -> list[str]:
    """The project's current pod and the name tpufab.yaml gives."""
    from tpufab import current

    names = []
    found = current.read()
    if found is not None:
        names.append(found.name)
    for file in ("tpufab.yaml", "tpufab.yml"):
        path = _root() / file
        if path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                key, sep, value = line.partition(":")
                if sep and key.strip() == "name" and value.strip():
                    names.append(value.strip().strip("'\""))
    return sorted({n for n in names if n.startswith(incomplete)})


def _runs(incomplete: str) -> list[str]:
    """Run ids whose logs this project keeps (``.tpufab/runs/<id>``), newest first."""
    folder = _root() / ".tpufab" / "runs"
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(incomplete)]
    return [p.name for p in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)]


def _files(incomplete: str, suffixes: tuple[str, ...]) -> list[str]:
    if "/" not in incomplete:
        base = Path(".")
    else:
        base = Path(incomplete) if incomplete.endswith("/") else Path(incomplete).parent
    if not base.is_dir():
        return []
    out = []
    for p in sorted(base.iterdir()):
        text = str(p) if "/" in incomplete else p.name
        if not text.startswith(incomplete) or p.name.startswith("."):
            continue
        if p.is_dir():
            out.append(text + "/")
        elif p.suffix in suffixes:
            out.append(text)
    return out


def _recipes(incomplete: str) -> list[str]:
    return _files(incomplete, (".sh", ".py", ""))


def _tasks(incomplete: str) -> list[str]:
    return _files(incomplete, (".yaml", ".yml"))


COMPLETERS = {"name": _pods, "pod": _pods, "run": _runs, "recipe": _recipes, "task": _tasks,
              "script": _recipes}


def _completer(name: str):
    """Shell completion for a parameter, where its values are cheap to know."""
    if name not in COMPLETERS:
        return None

    def complete(incomplete: str) -> list[str]:
        try:
            return COMPLETERS[name](incomplete)
        except OSError:
            return []

    return complete


def _typer_param(p: Param) -> inspect.Parameter:
    if p.positional:
        default = typer.Argument(... if p.required else p.default,
                                 help=p.help, metavar=p.metavar, show_default=False,
                                 autocompletion=_completer(p.name))
    else:
        flags = p.flags
        if p.kind is bool and p.default is True:
            flags = (f"{p.flag}/--no-{p.flag[2:]}",)
        default = typer.Option(... if p.required else p.default, *flags, help=p.help,
                               metavar=p.metavar, min=p.min,
                               show_default=p.default not in (None, False, [], ()),
                               autocompletion=_completer(p.name))
    return inspect.Parameter(p.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=_annotation(p))


def _command(v: Verb):
    params = v.params()

    def command(**values: Any) -> None:
        code = run_verb(v.fn, **call_values(params, values), debug=_state["debug"])
        if code:
            raise typer.Exit(code)

    command.__signature__ = inspect.Signature([_typer_param(p) for p in params])  # type: ignore[attr-defined]
    command.__name__ = v.fn.__name__
    command.__doc__ = v.help
    return command


def build_app(only: str | None = None) -> typer.Typer:
    """The whole command line, or (``only``: a verb's or a group's name) the part one command
    needs: a command builds the click parameters of its own verb only (``main``)."""
    settings = {"no_args_is_help": True, "rich_markup_mode": None,
                "context_settings": {"help_option_names": ["-h", "--help"]}}
    app = typer.Typer(name="tpufab", help="Make a Cloud TPU pod feel like one machine.",
                      add_completion=True, pretty_exceptions_enable=False, **settings)

    def _version(value: bool) -> None:
        if value:
            from tpufab import __version__

            typer.echo(f"tpufab {__version__}")
            raise typer.Exit()

    @app.callback()
    def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
              version: bool = typer.Option(False, "--version", callback=_version,
                                           is_eager=True,
                                           help="Print tpufab's version and exit "
                                                "(`tpufab version`: with its libraries')."),
              keep_alive: str | None = typer.Option(
                  None, "--keep-alive", metavar="DURATION",
                  help="How long the pod's connections stay open after this command for the "
                       "next one (default 5m; 0: not kept; setting keep_alive).")) -> None:
        """Make a Cloud TPU pod feel like one machine."""
        _state["debug"] = debug
        if keep_alive is not None:
            import os

            from tpufab.config import keep_alive_seconds
            from tpufab.errors import ConfigError

            try:
                keep_alive_seconds(keep_alive, "--keep-alive")
            except ConfigError as err:
                from tpufab.term.console import report_error

                raise typer.Exit(report_error(err, debug=debug)) from None
            os.environ["TPUFAB_KEEP_ALIVE"] = keep_alive  # the layer every verb reads

    groups: dict[str, typer.Typer] = {}
    for v in all_verbs():
        if only is not None and (v.group or v.name) != only:
            continue
        target = app
        if v.group:
            if v.group not in groups:
                default = next((d for d in all_verbs() if d.group == v.group and d.default),
                               None)
                own = settings if default is None else {
                    **settings, "no_args_is_help": False, "invoke_without_command": True}
                groups[v.group] = typer.Typer(help=group_help(v.group), **own)
                if default is not None:
                    groups[v.group].callback()(_default_command(default))
                app.add_typer(groups[v.group], name=v.group)
            target = groups[v.group]
        target.command(v.name, help=v.help)(_command(v))
    return app


def _default_command(v: Verb):
    """A group's callback that runs its default verb when no subcommand is given."""
    command = _command(v)

    def callback(ctx: typer.Context, **values: Any) -> None:
        if ctx.invoked_subcommand is None:
            command(**values)

    context = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                annotation=typer.Context)
    callback.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [context, *command.__signature__.parameters.values()])
    callback.__doc__ = group_help(v.group or "") or v.help
    return callback


VALUED = ("--keep-alive",)   # the options before the verb that take a value


def command_named(argv: list[str]) -> str | None:
    """The verb (or group) ``argv`` names after the options that come before it; None when
    it names none that exists, asks for completions, or for the whole help."""
    import os

    if any(key.startswith("_TPUFAB_COMPLETE") for key in os.environ):
        return None
    words = iter(argv)
    for word in words:
        if word in VALUED:
            next(words, None)
        elif not word.startswith("-"):
            known = {v.group or v.name for v in all_verbs()}
            return word if word in known else None
        elif word == "--":
            return None
    return None


_APPS: dict[str | None, typer.Typer] = {}


def app_for(only: str | None) -> typer.Typer:
    """``build_app(only)``, built once per process (the resident server builds them all)."""
    if only not in _APPS:
        _APPS[only] = build_app(only)
    return _APPS[only]


def command_names() -> list[str]:
    """Every verb's name, and every group's (the commands ``main`` builds apart)."""
    return sorted({v.group or v.name for v in all_verbs()})


def main() -> None:
    import sys

    app_for(command_named(sys.argv[1:]))()


if __name__ == "__main__":
    main()
