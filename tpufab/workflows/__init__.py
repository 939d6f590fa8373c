"""What a Pod does on its workers, one module a concern: deploy (and the code lease, local
git), mount, kill, status, check, profile, autostop."""
