"""The structure measures of issue 64 for a source tree, as JSON: run it on two checkouts and compare.

    python dev/structure_counts.py [SRC_DIR]   (default: this checkout's src/)

  method_names        string literals naming a method or control ("sft", "opct", "base", "opct-shuffled", ...),
                      CONTROLS and "*_minus_*" keys, outside the methods table (opct/experiment.py); literals that
                      name a command, a package, a pairs format or a tracker project are listed apart (not methods)
  axis_names          string literals naming an axis outside opct/axes/
  cfg_probes          getattr(cfg, ...) / hasattr(cfg, ...) outside the option machinery (config.py / options.py)
  long_functions      functions of 60 lines or more
  lines               config.py, report (module or package's largest file), demo.py
  function_imports    imports inside functions: all, and those of opct's own modules
  circles             import circles (dev/import_cycles.py's graph: function-level imports count as edges)
"""

import ast
import json
import re
import sys
from pathlib import Path

METHODS = ("sft", "opct", "base", "opct-shuffled", "opct-fixed", "opct-clip")
AXES = ("sycophancy", "safety", "jailbreak")


def literals(tree):
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            yield n


def main():
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "src"
    pkg = src / "opct"
    out = {"method_names": [], "axis_names": [], "cfg_probes": [], "long_functions": [], "function_imports": [0, 0]}
    for p in sorted(pkg.rglob("*.py")):
        rel = p.relative_to(pkg).as_posix()
        text = p.read_text()
        tree = ast.parse(text)
        docstrings = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(
            n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n.body and isinstance(
            n.body[0], ast.Expr) and isinstance(getattr(n.body[0], "value", None), ast.Constant)}
        for c in literals(tree):
            if id(c) in docstrings:
                continue
            if rel != "experiment.py" and (c.value in METHODS or re.fullmatch(r"[a-z-]+_minus_[a-z-]+", c.value)):
                out["method_names"].append(f"{rel}:{c.lineno} {c.value!r}")
            if not rel.startswith("axes/") and c.value in AXES:
                out["axis_names"].append(f"{rel}:{c.lineno} {c.value!r}")
        if rel not in ("config.py", "options.py"):
            for i, line in enumerate(text.splitlines(), 1):
                if re.search(r"\b(getattr|hasattr)\(cfg\b", line):
                    out["cfg_probes"].append(f"{rel}:{i}")
        if rel != "experiment.py":
            out["method_names"] += [f"{rel}:{i} CONTROLS" for i, line in enumerate(text.splitlines(), 1)
                                    if re.search(r"\bCONTROLS\b", line)]
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if n.end_lineno - n.lineno + 1 >= 60:
                    out["long_functions"].append(f"{rel}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1})")
                for m in ast.walk(n):
                    if isinstance(m, (ast.Import, ast.ImportFrom)) and m is not n:
                        out["function_imports"][0] += 1
                        mod = m.module if isinstance(m, ast.ImportFrom) else m.names[0].name
                        out["function_imports"][1] += bool(mod and mod.split(".")[0] == "opct")
    # a literal both a method and something else: commands ("sft", "opct" the CLI), packages, formats
    not_methods = re.compile(r"^(cli\.py|train/loop\.py|train/trackers\.py|data/formats\.py|inspect_log\.py|"
                             r"evals/offline_tasks\.py|evals/capability\.py:1[6-9][0-9]|backends/cpu/attention\.py|"
                             r"backends/base\.py|backends/vllm_sampler\.py|algo/(opct|sft)\.py|config\.py:[0-9]+ '(sft|"
                             r"opct)'$)")
    out["other_uses"] = [x for x in out["method_names"] if not_methods.match(x)]
    out["method_names"] = [x for x in out["method_names"] if not not_methods.match(x)]
    report = pkg / "report.py" if (pkg / "report.py").is_file() else max((pkg / "report").glob("*.py"),
                                                                         key=lambda q: len(q.read_text().splitlines()))
    out["lines"] = {q.relative_to(pkg).as_posix(): len(q.read_text().splitlines())
                    for q in (pkg / "config.py", report, pkg / "demo.py")}
    sys.path.insert(0, str(Path(__file__).parent))
    import import_cycles

    import_cycles.SRC = src
    out["circles"] = [" <-> ".join(c) for c in import_cycles.cycles(import_cycles.edges(False))]
    counts = {k: len(v) if isinstance(v, list) and k != "function_imports" else v for k, v in out.items()}
    print(json.dumps({"counts": counts, "where": {k: v for k, v in out.items() if isinstance(v, list)
                                                   and k != "function_imports"}}, indent=1))


if __name__ == "__main__":
    main()
