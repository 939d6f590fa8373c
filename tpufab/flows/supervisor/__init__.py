"""The supervisor off the laptop (docs/supervisor.md): jobs whose only state is a bucket.

- ``state``: the bucket layout, the job spec (never a secret value), the job's state record
  and its pure transitions, and ``Records``, the bucket's records read and written with
  generation preconditions;
- ``lease``: one supervisor at a time per job (a lease object with an expiry; a holder that
  loses it stops acting), its pure decisions and the storage-backed ``Lease``;
- ``jobs``: what the laptop does with the bucket alone: list the jobs, read a job's logs
  back in order, ask for a job to be cancelled.
- ``handover``: `babysit --remote`, the laptop's side: checks, the commit made reachable,
  the job written to the bucket;
- ``service`` (``python -m tpufab.flows.supervisor serve``): the supervisor process, one
  thread per held job running the babysit loop through its hooks (flows/babysit/hooks.py).

None of it prints: the verbs hand it their sinks.
"""
