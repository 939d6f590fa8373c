"""`tpufab`: the Typer front end, generated from the verb declarations (tpufab.verbs).

Nothing here is specific to a verb: each declared verb becomes one command whose options are
its parameters. Keep it free of heavy imports: `tpufab --help` must start instantly.
"""

from __future__ import annotations

import inspect
from typing import Any

import typer

from tpufab.console import run as run_verb
from tpufab.verbs import GROUP_HELP, all_verbs
from tpufab.verbs.declare import Param, Verb, call_values

_state = {"debug": False}


def _annotation(p: Param) -> Any:
    kind = list[str] if p.kind is list else p.kind
    return kind | None if p.optional and p.kind is not bool else kind


def _typer_param(p: Param) -> inspect.Parameter:
    if p.positional:
        default = typer.Argument(... if p.required else p.default,
                                 help=p.help, metavar=p.metavar, show_default=False)
    else:
        flags = p.flags
        if p.kind is bool and p.default is True:
            flags = (f"{p.flag}/--no-{p.flag[2:]}",)
        default = typer.Option(... if p.required else p.default, *flags, help=p.help,
                               metavar=p.metavar, min=p.min,
                               show_default=p.default not in (None, False, [], ()))
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


def build_app() -> typer.Typer:
    settings = {"no_args_is_help": True, "rich_markup_mode": None,
                "context_settings": {"help_option_names": ["-h", "--help"]}}
    app = typer.Typer(name="tpufab", help="Make a Cloud TPU pod feel like one machine.",
                      add_completion=False, pretty_exceptions_enable=False, **settings)

    @app.callback()
    def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks.")) -> None:
        """Make a Cloud TPU pod feel like one machine."""
        _state["debug"] = debug

    groups: dict[str, typer.Typer] = {}
    for v in all_verbs():
        target = app
        if v.group:
            if v.group not in groups:
                groups[v.group] = typer.Typer(help=GROUP_HELP.get(v.group), **settings)
                app.add_typer(groups[v.group], name=v.group)
            target = groups[v.group]
        target.command(v.name, help=v.help)(_command(v))
    return app


app = build_app()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
