"""This project's tasks: tpufab's verbs (`invoke create`, `setup`, `run`, `kill`, `status` ...)
and your own beside them. `invoke --list` shows them all."""

from invoke import task

from tpufab.tasks import ns, run, setup


@task(pre=[setup])
def hello(c):
    """Set up every worker (scripts/setup.sh, skipped where it already ran), then run
    recipes/hello.sh on all of them."""
    run(c, recipe="recipes/hello.sh")


ns.add_task(hello)
