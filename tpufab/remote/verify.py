# tpufab's verifying loader: how every shipped worker-side file is run. Python 3.6+, stdlib.
# Not shipped: it travels on the command line, `python3 -I -S -c "L=<this file>;exec(L)"
# N H1 P1 .. HN PN ARGS` (remote_files.VERIFY), so nothing on the worker's disk runs unchecked.
#
# File 1 is the program, the others files it needs. One missing or not of its sha256 (any
# process of the login user can write ~/.cache/tpufab/remote): exit 97 without a byte of
# output, which tells the client to ship the files again and rerun. Otherwise run the bytes
# that were hashed, never the file again: a .sh program as `sh -c BYTES P1 ARGS`, each
# needed file's path among ARGS replaced by /dev/fd/N, a sealed in-memory copy (where Python
# has memfd_create, 3.8+); a Python program compiled here and run as __main__ (its directory
# first on sys.path unless isolated, as `python FILE` does), with `__tpufab_rerun__` the argv
# that runs it again the same checked way (a script that restarts itself: sudo, detached).
import os
import sys
import types

try:                                  # the C sha256 alone: hashlib's OpenSSL import costs ms
    from _sha2 import sha256  # 3.12+
except ImportError:
    try:
        from _sha256 import sha256
    except ImportError:
        from hashlib import sha256
a = sys.argv
if len(a) < 4 or not a[1].isdigit() or int(a[1]) < 1:
    sys.stderr.write("usage: verify.py N SHA256 PATH [SHA256 PATH]... [ARGS]\n")
    sys.exit(2)
n = int(a[1])
pairs, args, data = a[2:2 + 2 * n], a[2 + 2 * n:], []
for i in range(0, 2 * n, 2):
    try:
        with open(pairs[i + 1], "rb") as fh:
            b = fh.read()
    except OSError:
        sys.exit(97)
    if sha256(b).hexdigest() != pairs[i]:
        sys.exit(97)
    data.append(b)
main = pairs[1]
if main.endswith(".sh"):
    for k in range(1, n):
        if not hasattr(os, "memfd_create"):
            break
        import fcntl
        fd = os.memfd_create(os.path.basename(pairs[2 * k + 1]), 2)   # MFD_ALLOW_SEALING
        os.write(fd, data[k])
        os.fchmod(fd, 0o700)
        fcntl.fcntl(fd, 1033, 15)     # F_ADD_SEALS: SEAL, SHRINK, GROW, WRITE
        os.set_inheritable(fd, True)
        args = [f"/dev/fd/{fd}" if x == pairs[2 * k + 1] else x for x in args]
    os.execvp("sh", ["sh", "-c", data[0].decode("utf-8", "surrogateescape"), main] + args)
if not sys.flags.isolated and sys.path and sys.path[0] == "":
    sys.path[0] = os.path.dirname(os.path.abspath(main))
program = types.ModuleType("__main__")
program.__file__ = main
program.__tpufab_rerun__ = [sys.executable, "-I", "-S", "-c", f"L={L!r};exec(L)",  # noqa: F821
                            "1", pairs[0], os.path.abspath(main)]
code = compile(data[0], main, "exec")
sys.modules["__main__"] = program
sys.argv = [main] + args
exec(code, program.__dict__)
