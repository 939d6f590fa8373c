"""The Pod's environment methods (docs/environment.md): `tpufab env build`, `tpufab env
status`, and what `Pod.setup` asks before its script. A base of ``tpufab.Pod`` (the Pod
class stays under the house's 600 lines); the work is ``tpufab.steps.host.environment``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from tpufab.errors import ConfigError

if TYPE_CHECKING:
    from tpufab.steps.host.environment import EnvReport, EnvStatusReport


class PodEnvironment:
    """Mixed into ``tpufab.Pod``: it has ``settings``, ``hosts``, ``select``,
    ``internal_ips`` and ``_timeout``."""

    def env_build(self, *, force: bool = False, workers: str | Iterable[int] = "all",
                  timeout: float | None = None) -> EnvReport:
        """Build the configured environment once (worker 0, with uv) and put that build on
        every worker lacking its hash, host to host, each tree verified (`tpufab env
        build`); ``force``: build again though the hash is unchanged. An EnvReport; raises
        EnvError naming a resolution failure once, or the hosts still failing after a
        retry."""
        from tpufab.steps.host.environment import env_spec, put_environment

        spec = env_spec(self.settings)
        if spec is None:
            raise ConfigError("No environment is configured: add `environment: "
                              "{requirements: requirements.txt}` (or lock: uv.lock) to "
                              "tpufab.yaml.")
        return put_environment(self.hosts, spec, workers=self.select(workers), force=force,
                               timeout=self._timeout("env build", timeout))

    def env_status(self, *, workers: str | Iterable[int] = "all",
                   timeout: float | None = None) -> EnvStatusReport:
        """Which workers have which environment (its hash) at the configured path, folded
        (`tpufab env status`): an EnvStatusReport (``.expected``: the configured hash)."""
        from tpufab.config import DEFAULT_ENVIRONMENT_PATH
        from tpufab.steps.host.environment import env_spec, environment_status, virtual_env

        return environment_status(self.hosts.fanout, env_spec(self.settings),
                                  virtual_env(self.settings) or DEFAULT_ENVIRONMENT_PATH,
                                  workers=self.select(workers),
                                  timeout=self._timeout("env status", timeout))

    def _environment_only(self, script: str | Path) -> bool:
        """The default setup script is asked for and an environment is configured."""
        from tpufab.steps.runs.env import virtual_env

        return str(script) == "scripts/setup.sh" and virtual_env(self.settings) is not None

    def _environment_first(self, workers, timeout: float | None) -> EnvReport | None:
        """Before a setup script: the configured environment, if any (``env_build``)."""
        from tpufab.steps.runs.env import virtual_env

        if virtual_env(self.settings) is None:
            return None
        return self.env_build(workers=workers, timeout=timeout)

    def _with_venv(self, public: Mapping[str, str] | None) -> Mapping[str, str] | None:
        """A setup script's environment with VIRTUAL_ENV where one is configured (the
        worker puts its bin first on PATH)."""
        from tpufab.steps.runs.env import virtual_env

        venv = virtual_env(self.settings)
        return public if venv is None else {**(public or {}), "VIRTUAL_ENV": venv}
