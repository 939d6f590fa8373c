"""Holds this worker's TPU chips (opens every /dev/accel* or /dev/vfio/N) and computes on the
main thread until killed: the simulated libtpu reports its chips busy."""
import glob
import sys
import time

held = [open(p, "rb") for p in sorted(glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*"))]
print(f"holding {len(held)} chips", flush=True)
ballast = bytearray(64 << 20)  # 64 MiB resident: the HBM it reports
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
until = time.monotonic() + float(sys.argv[1] if len(sys.argv) > 1 else 120)
x = 0
while time.monotonic() < until:
    for _ in range(20000):
        x = (x * 31 + 7) % 1000003
