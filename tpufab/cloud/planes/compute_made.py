"""The workload policies and instance templates tpufab makes for a Compute Engine slice (a
mixin of ``ComputeEngine``): deleting them with the slice when they are tpufab's and nothing
else uses them, and finding them when the slice is gone from every zone (`tpufab gc`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tpufab.cloud.planes.compute_parts import made_for, owner_of, reword_text
from tpufab.errors import TpufabError


class MadeForSlices:
    """Needs the plane's ``project``, ``zone``, ``region``, ``c`` (the clients), ``removed``
    and its ``_call``, ``_wait``, ``_action`` and ``_group_safe``."""

    def _delete_made(self, kind: str, client: Any, name: str, slice_name: str,
                     **where: Any) -> str | None:
        """Delete a template or policy tpufab made for ``slice_name``; else why it stays."""
        from google.api_core import exceptions as gexc

        if not name:
            return None
        field = {"instance template": "instance_template",
                 "workload policy": "resource_policy"}[kind]
        try:
            found = client.get(project=self.project, **where, **{field: name})
            if (made_for(found.description) or ("", ""))[0] != slice_name:
                return f"{kind} {name} (not made by tpufab for it)"
            op = client.delete_unary(project=self.project, **where, **{field: name})
            self._wait(self._op_name(op), self._action("delete", slice_name), timeout=120)
            self.removed.append(f"{kind} {name}")
        except gexc.NotFound:
            return None
        except (gexc.GoogleAPICallError, TpufabError) as err:
            return f"{kind} {name} ({reword_text(str(err))})"
        return None

    def _delete_template(self, template: str, slice_name: str) -> str | None:
        return self._delete_made("instance template", self.c.templates, template, slice_name)

    def _delete_policy(self, policy: str, slice_name: str) -> str | None:
        return self._delete_made("workload policy", self.c.policies, policy, slice_name,
                                 region=self.region)

    def leftovers(self) -> list[tuple[str, str, str]]:
        """Instance templates (global) and workload policies (regional) tpufab made for a
        slice that exists in no zone any more (autostop deletes the MIG from one of its VMs,
        which goes with it): ``(kind, name, slice)``. A slice made elsewhere is looked for in
        the zone its description names; one made before tpufab wrote the zone there, by its
        VMs in any zone."""
        def fetch(client: Any, **where: Any) -> Callable[..., list]:
            return lambda **kw: list(client.list(project=self.project, **where, **kw))

        listing = self._action("list")
        here = {g.name for g in self._call(listing, fetch(self.c.groups, zone=self.zone))}
        anywhere: set[str] | None = None   # MIGs with VMs in any zone, read once if needed
        found = []
        templates = self._call(listing, fetch(self.c.templates))
        policies = self._call(listing, fetch(self.c.policies, region=self.region))
        for kind, items in (("instance template", templates), ("workload policy", policies)):
            for item in items:
                owner, zone = made_for(item.description) or ("", "")
                if not owner or owner in here or \
                        item.name != f"{owner}-tpufab-{'tt' if 'template' in kind else 'wp'}":
                    continue
                if zone and zone != self.zone:
                    if self._group_safe(owner, zone) is not None:
                        continue
                elif not zone:
                    if anywhere is None:
                        anywhere = self._groups_with_vms()
                    if owner in anywhere:
                        continue
                found.append((kind, item.name, owner))
        return sorted(found)

    def _groups_with_vms(self) -> set[str]:
        """The MIGs that have VMs in any zone of the project (their ``created-by``)."""
        def fetch(**kw: Any) -> set[str]:
            out = set()
            for _, scoped in self.c.instances.aggregated_list(project=self.project, **kw):
                out |= {owner_of(inst) for inst in scoped.instances}
            return out - {""}

        return self._call(self._action("list"), fetch)

    def delete_leftover(self, kind: str, name: str, owner: str) -> str | None:
        self.removed = []
        if kind == "instance template":
            return self._delete_template(name, owner)
        return self._delete_policy(name, owner)
