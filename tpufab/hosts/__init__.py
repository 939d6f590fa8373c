"""Hosts: a pod's node(s) found, logged into and connected as one group (connect): the object
every step runs on. Below the steps, above the SSH and cloud engines."""
