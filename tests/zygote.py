"""A fork server for the tests' rank processes: it imports torch once, and each `python <script> <args>`
a test launches is a fork of it that runs the script as __main__, as the interpreter would have.

    python tests/zygote.py        (started by tests/conftest.py's ForkServer, one per import-time environment)

A launch is mostly start-up: a fresh interpreter spends about 2.2 s importing torch and torch._dynamo (which
torch.optim imports at the first optimizer) before the script's first line, on every rank of every launch. A fork of
this process has them already. Nothing of the project is imported here (tests/user_torch.py must see the project's
imports happen), and no tensor is made: torch starts no thread pool before the fork (numpy's OpenBLAS may, and
shuts it down at fork, as Python's multiprocessing has it do). The child then becomes the
process `python <script>` would be: its own session, stdin from /dev/null, stdout and stderr to the files given,
the cwd, environment, sys.argv and sys.path[0] of that command, and the script run by runpy as __main__; it ends
as any interpreter ends (atexit, finalisation, exit code 0, the SystemExit's code, or 1 after a traceback).

Protocol, one JSON line or text line each way: on stdin {"argv": [script, *args], "cwd", "env", "stdout",
"stderr"} -> on stdout "started <pid>"; when a child ends, "exited <pid> <code>" (-N: killed by signal N). EOF on
stdin ends the server (children it started run on: they are in their own sessions).
"""
import json
import os
import select
import sys

import numpy  # noqa: F401
import tiktoken  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401


def serve(requests=0, replies=1):
    """The server's loop; in a forked child, returns that child's job."""
    children, pending = set(), b""
    while True:
        ready, _, _ = select.select([requests], [], [], 0.01 if children else 1.0)
        if ready:
            chunk = os.read(requests, 1 << 16)
            if not chunk:
                return None
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                job = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    os.close(requests)
                    os.close(replies)
                    return job
                children.add(pid)
                os.write(replies, f"started {pid}\n".encode())
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            os.write(replies, f"exited {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def become(job):
    """Turns this forked child into `python <script> <args>` run as the job says."""
    os.setsid()
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, job["stdout"], os.O_WRONLY | os.O_APPEND),
                            (2, job["stderr"], os.O_WRONLY | os.O_APPEND)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    sys.argv = list(job["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    import runpy
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    job = serve()
    if job is not None:
        become(job)
