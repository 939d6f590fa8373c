"""The control planes, by registry: each plane is one module of this package (a
``ControlPlane``, tpufab/cloud/planes/base.py) and one entry of ``PLANES`` below; nothing
outside this package names one. ``control_plane(settings)`` is the one factory everything
that talks to the cloud gets its plane from (docs/control-plane.md).

Which plane: ``control_plane`` in the settings (``--on``, ``TPUFAB_CONTROL_PLANE``,
``control_plane:`` in tpufab.yaml; a plane's name or alias) if set; else the one a type
implies (the first plane does not offer it, another does: TPU7x is Compute Engine's alone);
else every plane side by side (``AnyPlane``), a name looked up on each."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tpufab.cloud.nodes import Node
from tpufab.cloud.planes.any import AnyPlane
from tpufab.cloud.planes.base import ControlPlane
from tpufab.cloud.planes.compute import ComputeEngine
from tpufab.cloud.planes.tpu import TpuApi
from tpufab.config import Settings
from tpufab.errors import ConfigError
from tpufab.topology import parse_accelerator_type


class Registry(dict[str, type[ControlPlane]]):
    """The registered planes by name, in the order a name is looked up on them."""

    def __init__(self, planes: Iterable[type[ControlPlane]] = ()):
        super().__init__()
        for plane in planes:
            self.register(plane)

    def register(self, plane: type[ControlPlane]) -> type[ControlPlane]:
        if not plane.name or plane.name in self:
            raise ValueError(f"a control plane needs a name of its own, not {plane.name!r}")
        self[plane.name] = plane
        return plane

    @property
    def primary(self) -> type[ControlPlane]:
        return next(iter(self.values()))

    def named(self, text: str | None) -> type[ControlPlane] | None:
        """The plane ``text`` names (its name or an alias, any case); None for nothing; one
        sentence for a name no plane has."""
        chosen = (text or "").strip().lower()
        if not chosen:
            return None
        for plane in self.values():
            if chosen == plane.name or chosen in plane.aliases:
                return plane
        names = list(self)
        listed = " or ".join(names) if len(names) < 3 else \
            f"{', '.join(names[:-1])} or {names[-1]}"
        raise ConfigError(f"control_plane (--on) must be {listed}, not {text!r}.")


# The registry: a new plane is its module and one entry here (plus its emulator in tpufab/sim).
PLANES = Registry([TpuApi, ComputeEngine])


def plane_of(settings: Settings) -> str | None:
    """The name of the plane ``settings`` call for, or None (any: look on each):
    ``control_plane`` if set, else the plane a type implies (one the first plane lacks)."""
    chosen = PLANES.named(settings.control_plane)
    if chosen is not None:
        return chosen.name
    if settings.type:
        shape = parse_accelerator_type(settings.type)
        if not PLANES.primary.offers(shape):
            return next((p.name for p in PLANES.values() if p.offers(shape)), None)
    return None


def retry_note(exc: BaseException, attempt: int, delay: float) -> str:
    """The line (rich markup) a command prints on stderr when the API is retried."""
    from rich.markup import escape

    from tpufab.cloud.planes.calls import status_name

    return (f"[dim]TPU API busy ({escape(str(status_name(exc)))}); retrying in {delay:.1f}s "
            f"(attempt {attempt + 1}).[/dim]")


def control_plane(settings: Settings, control: ControlPlane | None = None, *,
                  plane: str | None = "auto",
                  on_retry: Callable[[BaseException, int, float], None] | None = None,
                  ) -> ControlPlane:
    """``control`` if given, else the control plane ``settings`` call for (``plane_of``,
    or the plane named ``plane``): one plane, its ``rivals`` the others for the same
    settings, or every plane side by side (``AnyPlane``); each retry noted on stderr (or
    ``on_retry(exc, attempt, delay)``)."""
    if control is not None:
        return control
    if on_retry is None:
        def on_retry(exc: BaseException, attempt: int, delay: float) -> None:
            from tpufab.term.console import stderr

            stderr().print(retry_note(exc, attempt, delay))

    made = [cls(settings, on_retry=on_retry) for cls in PLANES.values()]
    which = plane_of(settings) if plane == "auto" else plane
    if which is None:
        return AnyPlane(settings, made)
    one = next(p for p in made if p.name == which)
    one.rivals = [p for p in made if p is not one]
    return one


def plane_for(node: Node, settings: Settings) -> ControlPlane:
    """The plane ``node`` came from, for ``settings`` (the first plane for a record that
    names none)."""
    cls = PLANES.get(node.plane) or PLANES.primary
    return cls(settings)
