"""Allows `python -m ferry ...` (and `torchrun -m ferry ...`).

A rank of a multi-process job (torch's launcher sets `LOCAL_RANK` in its environment) ends with `os._exit` once
its command has returned and its output is flushed. By then the command has closed its process group, its
files and its sinks; the interpreter's teardown of native libraries afterwards has been seen to abort a rank
that had finished ("terminate called without an active exception", SIGABRT, after a 2-rank CPU job's last
step), which the launcher would report as a failed job.
"""

import os
import sys

from ferry.cli.main import main

code = main()
if "LOCAL_RANK" in os.environ:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
raise SystemExit(code)
