"""Print pip constraints that hold every dependency of opct (and of the extras named on the command line) at the
lowest version pyproject.toml allows: `name==X` for each `name>=X`. .ci/lowest installs through them and runs the
test suite there, so each lower bound in pyproject.toml is a version the tests pass at.

    python requirements/lowest.py dev > lowest.txt && pip install -c lowest.txt ".[dev]"
"""

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
requirements = list(project["dependencies"])
extras, seen = list(sys.argv[1:]), set()
while extras:  # an extra may name others of opct's own: dev = ["opct[wandb,trackio]", ...]
    extra = extras.pop()
    if extra in seen:
        continue
    seen.add(extra)
    if extra not in project["optional-dependencies"]:
        sys.exit(f"pyproject.toml has no extra {extra!r}")
    for req in project["optional-dependencies"][extra]:
        own = re.fullmatch(r"opct\[([^\]]+)\]", req)
        extras += own.group(1).split(",") if own else []
        requirements += [] if own else [req]
for req in requirements:
    m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(\[[^\]]*\])?\s*([^;]*)", req)
    low = re.search(r">=\s*([^,\s]+)", m.group(3))
    if not low:
        sys.exit(f"pyproject.toml: {req!r} has no lower bound")
    print(f"{m.group(1)}=={low.group(1)}")
