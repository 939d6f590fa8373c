"""The simulated TPU pod: a local Cloud TPU API emulator whose workers are real sshd servers.

`tpufab.sim.daemon` starts and stops it (`up`, `down`, `status`, `SimInfo`),
`tpufab.sim.admin` injects faults, `tpufab.sim.emulator` is the API itself.
See docs/simulated-pod.md.
"""
