"""One path per step (issue 36), read from the source: one deploy call site, which reads
``TPUFAB_GIT_TOKEN``, and one start path with one lease for every job. What a user sees of
them is tested on the simulated pod: tests/test_private_remote_sim.py (the token reaches the
workers from every verb that deploys), tests/test_one_writer.py (no job beside a running
run, however it starts)."""

from __future__ import annotations

import ast
from functools import cache

from house import modules


@cache
def units() -> dict[tuple[str, str], ast.AST]:
    """(module, function or Class.method) -> its node: the units the checks below count calls
    in (nested functions and lambdas count as their enclosing unit)."""
    out: dict[tuple[str, str], ast.AST] = {}
    for mod, path in modules().items():
        if mod.startswith(("tpufab.sim", "tpufab.remote")):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                out[(mod, node.name)] = node
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        out[(mod, f"{node.name}.{item.name}")] = item
    return out


def called(node: ast.AST) -> set[tuple[str | None, str]]:
    """(receiver name or None, function name) of every call in ``node``."""
    found = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            f = call.func
            if isinstance(f, ast.Name):
                found.add((None, f.id))
            elif isinstance(f, ast.Attribute):
                found.add((f.value.id if isinstance(f.value, ast.Name) else "", f.attr))
    return found


def callers(name: str, receivers: tuple[str | None, ...] | None = None) -> set[tuple[str, str]]:
    """The units that call ``name`` (on one of ``receivers``, if given)."""
    return {unit for unit, node in units().items()
            if any(n == name and (receivers is None or r in receivers)
                   for r, n in called(node))}


def test_one_deploy_call_site():
    """Every deploy goes through ``deploy_checkout``: the one call of the apply step, and the
    one place that reads TPUFAB_GIT_TOKEN (the workers' scripts read it on the worker)."""
    apply = callers("deploy", (None, "deploy", "deploying"))
    assert apply == {("tpufab.steps.code.deploy", "deploy_checkout")}, apply
    reads = {unit for unit, node in units().items()
             if "TOKEN_ENV" in ast.unparse(node) and "environ" in ast.unparse(node)}
    assert reads == {("tpufab.steps.code.deploy", "deploy_checkout")}, reads
    users = callers("deploy_checkout")
    assert users == {("tpufab.pod.api", "Pod.deploy"),
                     ("tpufab.steps.start.starting", "deploy_for_job"),
                     ("tpufab.flows.babysit.recover", "restore_commit")}, users


def test_every_job_starts_through_start_job():
    """One start path, one lease: a plan starts on the workers only in ``start_plan``, which
    only ``start_job``'s callers hand it (run, babysit, launch, check's collective); a Ray job
    is submitted only there too (``ray submit``, babysit --ray, launch --ray); the code lease
    and the one-job check are taken only by ``job_lease`` (and deploy's own lease)."""
    starting = "tpufab.steps.start.starting"
    assert callers("start_on_workers") == {(starting, "start_plan")}
    plans = callers("start_plan")
    assert plans == {(starting, "start_run"), ("tpufab.flows.babysit.attempt", "Attempts._attempt"),
                     ("tpufab.flows.launch", "execute"),
                     ("tpufab.steps.start.collective", "run_collective")}, plans
    assert plans <= callers("start_job"), plans - callers("start_job")
    submits = callers("submit", ("api",))
    assert submits == {("tpufab.steps.start.raycluster", "submit")}, submits
    assert submits <= callers("start_job")
    assert callers("refuse_a_second_run") == {(starting, "job_lease")}
    assert callers("hold", ("codelock",)) == {(starting, "job_lease"),
                                             ("tpufab.steps.code.deploy", "deploy")}
    leases = callers("job_lease")
    assert leases == {(starting, "start_job"), ("tpufab.flows.babysit.loop",
                                                "Babysitter._deploy_first"),
                      ("tpufab.flows.launch", "execute")}, leases
