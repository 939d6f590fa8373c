"""The cloud: control planes (the Cloud TPU API), node records, create/delete/list/describe,
OS Login. Nothing here opens an SSH connection."""
