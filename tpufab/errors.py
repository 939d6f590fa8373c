"""Errors a user can act on: one clear sentence, with the fix."""

from __future__ import annotations


class TpufabError(Exception):
    """An expected failure. ``str(err)`` is the sentence shown to the user (no traceback).

    ``exit_code`` is what the CLI exits with; ``details`` is optional extra text (for example
    a per-worker table) printed after the sentence.
    """

    exit_code = 1
    # The per-worker report of the step that failed, where it has one (a failed put's
    # TransferReport): the verb shows it before the sentence.
    report: object = None

    def __init__(self, message: str, *, details: str | None = None, exit_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.details = details
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(TpufabError):
    """Bad configuration or command-line input."""

    exit_code = 2


class ApiError(TpufabError):
    """The TPU API refused or failed a call (already translated into a sentence)."""


class NotFound(ApiError):
    """The node or queued resource does not exist."""


class CodeBusy(TpufabError):
    """Another tpufab holds the pod's code, or a run reads it (tpufab.steps.code.codelock)."""


class SimError(TpufabError):
    """The simulated pod could not do what was asked."""


def shown(value: object) -> str:
    """User input for an error sentence: as is when printable, else quoted with escapes (a
    newline or control character in it must not break the sentence or reach the terminal)."""
    text = str(value)
    return text if text.isprintable() else repr(text)
