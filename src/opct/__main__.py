"""`python -m opct ...` (what torchrun launches) is the `opct` command.

Under torchrun (WORLD_SIZE > 1) the process leaves with os._exit once the command has returned and the output is
flushed: the command has closed its vLLM engine, destroyed the process group and written its files atomically by
then, and a two-rank vLLM run on a CPU occasionally aborted in native teardown after that point ("terminate called
without an active exception", exit 1 for a finished run; docs/reliability.md).
"""

import os
import sys

from opct.cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
