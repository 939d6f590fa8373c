"""Names: a node name and a project ID checked before any API call, and the name `tpufab
create` gives a node when none is given (pure)."""

from __future__ import annotations

import re

from tpufab.errors import ConfigError

NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 63
PROJECT_RE = re.compile(r"^(?:[a-z][-a-z0-9.]*[a-z0-9]:)?[a-z][-a-z0-9]{4,28}[a-z0-9]$")


def validate_name(name: str | None, *, num_slices: int = 1) -> str:
    """A valid node name, or one sentence saying what is wrong with it."""
    if name == "":
        raise ConfigError("The node name is empty (--name '' or an empty TPUFAB_NAME): pass a "
                          "name such as --name my-tpu, or leave --name out to use this "
                          "project's current pod.")
    if name is None:
        raise ConfigError("No node name given and this project has no current pod: pass --name, "
                          "choose one with `tpufab use NAME`, or create one with `tpufab create "
                          "--type TYPE`.")
    longest = name if num_slices <= 1 else f"{name}-{num_slices - 1}"
    if not NAME_RE.match(name) or len(longest) > MAX_NAME:
        reason = (f"is longer than {MAX_NAME} characters" if NAME_RE.match(name)
                  else "may only hold lowercase letters, digits and hyphens, start with a letter "
                       "and not end with a hyphen (no spaces or shell characters)")
        raise ConfigError(f"Invalid node name {name!r}: a TPU node name {reason}; "
                          "for example --name my-tpu.")
    return name


def validate_project(project: str) -> str:
    """A well-formed Google Cloud project ID (``domain.com:`` prefix allowed), or one
    sentence."""
    if not PROJECT_RE.match(project or ""):
        raise ConfigError(f"Invalid project {project!r}: a Google Cloud project ID has 6 to 30 "
                          "lowercase letters, digits and hyphens, starts with a letter and does "
                          "not end with a hyphen (for example my-project-123); pass --project "
                          "or set TPUFAB_PROJECT.")
    return project


def default_name(user: str, accelerator_type: str) -> str:
    """`<user>-<type>` as a valid node name: `alice-v4-512`; `tpu-v6e-8` for odd user names."""
    person = re.sub(r"[^a-z0-9-]+", "-", user.lower()).strip("-")
    name = f"{person}-{accelerator_type}" if person[:1].isalpha() else f"tpu-{accelerator_type}"
    return name if NAME_RE.match(name) and len(name) <= 40 else f"tpu-{accelerator_type}"
