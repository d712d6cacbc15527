"""Read the peers' own pair files through opct's readers and through the peers' own reader code, and compare.

    python dev/peer_files_check.py ATTCT CTM

ATTCT and CTM: the c-wei/AttCT and sohaibimran7/consistency-training-methods repositories, each a checkout or a
bare git directory (its HEAD's files are exported to a temporary directory; blobs the copy lacks are listed as
absent). Run it with opct's venv (it imports opct, and torch for CTM's modules); nothing is installed.

AttCT ships its files (datasets/**); each is read by opct.data.formats.read_pairs and by AttCT's own readers, run
from its source: _read_jsonl_pairs / _read_jsonl_user_messages (data/attct_datasets.py: the BCT pairs and the clean
prompts its OPCT-style methods read), load_clearharm_prefills / load_harmful_behaviors_pair / _load_prefill_variants
(data/prefill_dataset.py: the csv module, as every AttCT trainer reads its CSVs). The functions are taken out of
those files by name and run with the standard library only (the files' module-level imports, torch and datasets,
are not needed by them).

CTM ships no data files, so its own writers make them in a temporary directory, with small rows written for this
check: native mcq-bias rows (the shape ctm_data/adapters/mcq_bias/data.py validates; the mcq_bias package that
writes them is not in CTM's repository), are_you_sure rows, `ctm.prompt_pairs` + manifest
(ctm_data/adapters/mcq_bias/materialize.py native_rows_to_prompt_pairs, ctm/artifacts.py
write_verified_jsonl_artifact), a prompt-family file (ctm/settings/families.py write_frozen_artifact) and BCT
target files (ctm/training/bct_targets.py prepare_paired_prompts, build_bct_rows_from_completions,
write_bct_target_artifacts, given fixed completions instead of a model). CTM's readers are its own: load_paths +
make_perturbation_fns (mcq-bias rows), load_pair_artifact + make_pair_perturbations (ctm/settings/pairs.py) and
_prompt_messages (ctm/training/consistency_data.py: the cut after the last user turn), load_family_artifact,
verify_data_manifest_binding. Three modules they import but do not use here are stubbed: tinker (a service
client), ctm.backends.renderers (needs tinker) and ctm_data.adapters.mcq_bias.dataset_specs (needs mcq_bias).

Printed: per file, its rows, the pairs opct reads, how many are field for field (role and content of every student
and teacher message, byte-exact) what the peer's reader gives, and opct's message where it refuses the file; then
AttCT's bct_ / control_ rows measured for differences beyond the cue, and examples/formats/attct_cued_pairs.py run
on AttCT's control_ files. Exit 1 if a file is neither read exactly nor refused with a message naming it.
"""

from __future__ import annotations

import ast
import contextlib
import csv
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from opct.data.formats import read_pairs  # noqa: E402
from opct.data.pairs import PairsError  # noqa: E402

ANSWER_PREFIX = "The best answer is: ("


def export(repo: Path, parts: tuple[str, ...], dest: Path) -> tuple[Path, list[str]]:
    """A checkout as it is, or a bare git directory's HEAD files under `parts` written to `dest`; and the paths
    whose blobs the bare copy lacks."""
    if not (repo / "HEAD").is_file() or (repo / ".git").exists():
        return repo, []
    listing = subprocess.run(["git", "-C", str(repo), "ls-tree", "-r", "-z", "HEAD", "--", *parts],
                             check=True, capture_output=True).stdout.decode().split("\0")
    entries = [(e.split()[2], e.split("\t", 1)[1]) for e in listing if e and e.split()[1] == "blob"]
    cat = subprocess.Popen(["git", "-C", str(repo), "cat-file", "--batch"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE)
    absent = []
    for sha, path in entries:
        cat.stdin.write(sha.encode() + b"\n")
        cat.stdin.flush()
        head = cat.stdout.readline().split()
        if head[-1] == b"missing":
            absent.append(path)
            continue
        data = cat.stdout.read(int(head[2]))
        cat.stdout.read(1)
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_bytes(data)
    cat.stdin.close()
    cat.wait()
    return dest, absent


def functions(path: Path, names: tuple[str, ...], extra: dict) -> dict:
    """The top-level functions `names` of a peer's source file, run from its own text (nothing else of the file)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in keep} == set(names), (path, names)
    scope = {"__file__": str(path), "__name__": "peer", **extra}
    exec(compile(ast.Module(keep, []), str(path), "exec"), scope)
    return scope


def msgs(messages: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


def opct_read(path: Path):
    """(pairs, None) or (None, message)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return read_pairs(path), None
    except PairsError as e:
        return None, str(e)


def count_rows(path: Path) -> int:
    if path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            return sum(1 for r in csv.reader(f) if r) - 1
    return sum(1 for line in path.read_bytes().split(b"\n") if line.strip())


RESULTS: list[dict] = []


def record(name: str, path: Path, peer: str, expected: list | None):
    """Read `path` with opct and compare with `expected`, the peer reader's pairs [(student, teacher)] (or None
    where the peer reads no pairs from it); `peer` says what the peer's reader does with it."""
    pairs, message = opct_read(path)
    row = {"file": name, "rows": count_rows(path), "peer": peer, "pairs": len(pairs) if pairs else 0,
           "message": message}
    if pairs is not None and expected is not None:
        same = sum(msgs(p.student) == s and msgs(p.teacher) == t for p, (s, t) in zip(pairs, expected))
        row["identical"] = f"{same} of {len(expected)}"
        row["ok"] = same == len(expected) == len(pairs)
    elif pairs is not None:
        row["identical"], row["ok"] = "peer reads no pairs", False
    else:
        row["identical"] = "-"
        row["ok"] = path.name in message
    RESULTS.append(row)


def quiet(fn, *args, **kwargs):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args, **kwargs)


def attct_files(attct: Path, absent: list[str]) -> None:
    ds = functions(attct / "data" / "attct_datasets.py", ("_read_jsonl_user_messages", "_read_jsonl_pairs"),
                   {"json": json, "Path": Path, "List": list})
    pf = functions(attct / "data" / "prefill_dataset.py",
                   ("_load_prefill_variants", "load_clearharm_prefills", "load_harmful_behaviors_pair"),
                   {"csv": csv, "os": os, "load_dataset": None})
    user = lambda text: [("user", text)]  # noqa: E731
    for path in sorted((attct / "datasets").rglob("*")):
        if path.suffix not in (".jsonl", ".csv") or not path.is_file():
            continue
        name = str(path.relative_to(attct))
        if path.suffix == ".csv":
            with path.open(newline="", encoding="utf-8") as f:
                header = next(csv.reader(f))
            if "prompt" in header:
                prompts, _, prefills, _ = quiet(pf["load_clearharm_prefills"], csv_path=str(path), train_ratio=1.0)
                peer = f"load_clearharm_prefills: {len(prompts)} (prompt, prefill)"
            elif "goal" in header:
                prompts, _, prefills, _ = quiet(pf["load_harmful_behaviors_pair"], csv_path=str(path), train_ratio=1.0)
                peer = f"load_harmful_behaviors_pair: {len(prompts)} (goal, target)"
            else:  # AttCT reads its one prefill-only CSV, datasets/attacks.csv, with _load_prefill_variants
                record(name, path, f"_load_prefill_variants: {len(pf['_load_prefill_variants']())} prefills, "
                       "no prompts", None)
                continue
            record(name, path, peer, [(user(p) + [("assistant", f)], user(p)) for p, f in zip(prompts, prefills)])
            continue
        control = path.with_name("control_" + path.name.removeprefix("bct_"))
        if path.name.startswith("bct_") and control.is_file():
            cued = ds["_read_jsonl_pairs"](path)  # the BCT baseline's (prompt, target) rows
            clean = ds["_read_jsonl_user_messages"](control)  # the clean prompts of its OPCT-style methods
            record(name, path, f"_read_jsonl_pairs + _read_jsonl_user_messages(control_): {len(cued)} rows",
                   [(user(u), user(c)) for (u, _), c in zip(cued, clean)])
        elif path.name.startswith(("bct_", "instruct")):
            rows = ds["_read_jsonl_pairs"](path)
            canon = attct / "datasets" / "sycophancy_bct" / path.name  # the pool its prompts came from
            aligned = ""
            if canon.is_file() and canon != path:
                same = sum(u == v for (u, _), (v, _) in zip(rows, ds["_read_jsonl_pairs"](canon)))
                aligned = f"; row-aligned with sycophancy_bct/{path.name}: {same} of {len(rows)}"
            record(name, path, f"_read_jsonl_pairs: {len(rows)} (prompt, BCT target){aligned}", None)
        elif path.name.startswith("control_"):
            record(name, path, f"_read_jsonl_user_messages: {len(ds['_read_jsonl_user_messages'](path))} prompts",
                   None)
        else:
            record(name, path, "prompts (not pairs)", None)
    for name in absent:
        if name.startswith("datasets/"):
            RESULTS.append({"file": name, "rows": "-", "peer": "-", "pairs": "-", "identical": "-", "ok": True,
                            "message": "absent from the fetched copy (a large file not fetched)"})


def stub_ctm_imports() -> None:
    class Anything(types.ModuleType):
        def __getattr__(self, name):  # any name a module-level import or annotation asks for
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})
    tinker = Anything("tinker")
    tinker.types = Anything("tinker.types")
    sys.modules.update({"tinker": tinker, "tinker.types": tinker.types,
                        "ctm.backends.renderers": Anything("ctm.backends.renderers"),
                        "ctm_data.adapters.mcq_bias.dataset_specs": Anything("dataset_specs")})


QUESTIONS = [  # written for this check
    ("q-sky", "Which gas makes up most of Earth's atmosphere?", ["oxygen", "nitrogen", "argon", "carbon dioxide"], 1),
    ("q-prime", "Which of these numbers is prime?", ["21", "27", "29", "33"], 2),
    ("q-moon", "How long does the Moon take to orbit Earth, roughly?", ["1 day", "27 days", "1 year", "12 hours"], 1),
]


def mcq_text(q: str, options: list[str]) -> str:
    return (f"{q}\n\nAnswer choices:\n" + "\n".join(f"({'ABCD'[i]}) {o}" for i, o in enumerate(options)) +
            '\n\nGive your answer in the format "The best answer is: (X)."')


def native_rows(bias_type: str) -> list[dict]:
    rows = []
    for qid, q, options, gold in QUESTIONS:
        wrong = "ABCD"[(gold + 1) % 4]
        text = mcq_text(q, options)
        if bias_type == "are_you_sure":  # the question, the challenge, the final ask: three user turns, no answer
            biased = [{"role": "user", "content": text},
                      {"role": "user", "content": "I don't think that's right. Are you sure?"},
                      {"role": "user", "content": "So what's the answer? Give your final answer in the same format."}]
            option, cue = f"NOT {'ABCD'[gold]}", "I don't think that's right. Are you sure?"
        else:
            cue = f"I think the answer is ({wrong}), but I'm curious what you think."
            biased = [{"role": "user", "content": f"{text}\n\n{cue}"}]
            option = wrong
        rows.append({"question": q, "question_id": qid, "source_dataset": "peer-check", "prompt_style": "none",
                     "prompt_family": "chua", "unbiased_messages": [{"role": "user", "content": text}],
                     "biased_messages": biased, "bias_type": bias_type, "ground_truth": "ABCD"[gold],
                     "biased_option": option, "biasing_text": cue, "option_labels": list("ABCD")})
    return rows


def ctm_files(ctm: Path, tmp: Path) -> None:
    sys.path.insert(0, str(ctm))
    stub_ctm_imports()
    from ctm.artifacts import verify_data_manifest_binding, write_verified_jsonl_artifact
    from ctm.pairs import canonical_pair_row
    from ctm.settings.families import load_family_artifact, write_frozen_artifact
    from ctm.settings.pairs import load_pair_artifact, make_pair_perturbations
    from ctm.training.bct_targets import (build_bct_rows_from_completions, prepare_paired_prompts,
                                          write_bct_target_artifacts)
    from ctm.training.consistency_data import _prompt_messages
    from ctm_data.adapters.mcq_bias.data import load_paths, make_perturbation_fns
    from ctm_data.adapters.mcq_bias.materialize import native_rows_to_prompt_pairs

    out = tmp / "ctm"
    out.mkdir()
    for bias in ("suggested_answer", "are_you_sure"):
        rows = native_rows(bias)
        native = out / f"mcq_bias_{bias}.jsonl"  # materialize.py's native payload encoding
        native.write_bytes(b"".join((json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n").encode() for r in rows))
        try:
            got = load_paths([native], n_datapoints=len(rows))
            unbiased, biased = make_perturbation_fns()
            record(f"(CTM) {native.name}", native, f"load_paths: {len(got)} rows",
                   [(msgs(biased(r)["messages"]), msgs(unbiased(r)["messages"])) for r in got])
        except NotImplementedError as e:
            record(f"(CTM) {native.name}", native, f"load_paths refuses: {str(e).split(': ', 1)[1][:60]}", None)
        pairs_path = out / f"prompt_pairs_{bias}.jsonl"
        write_verified_jsonl_artifact(pairs_path, native_rows_to_prompt_pairs(rows), artifact_schema="ctm.prompt_pairs",
                                      schema_version=1, provenance={"kind": "mcq_bias_prompt_pairs"},
                                      row_validator=canonical_pair_row, nonempty=True)
        got, _ = load_pair_artifact(pairs_path)
        reference, variant = make_pair_perturbations()
        record(f"(CTM) {pairs_path.name} + manifest", pairs_path,
               f"load_pair_artifact: {len(got)} pairs",
               [(msgs(_prompt_messages(variant(r)["messages"])), msgs(_prompt_messages(reference(r)["messages"])))
                for r in got])
    pair_rows, _ = load_pair_artifact(out / "prompt_pairs_suggested_answer.jsonl")

    families = out / "families.jsonl"
    write_frozen_artifact(families, [
        {"schema_version": 1, "source_id": r["source_id"], "source": "peer-check",
         "reference_messages": r["reference_messages"],
         "variants": [{"variant_id": f"{r['source_id']}-v{k}", "messages": r["variant_messages"] if k == 0 else
                       [{"role": "user", "content": "Quick question. " + r["reference_messages"][0]["content"]}],
                       "axes": {"tactics": [f"t{k}"]}} for k in range(2)],
         "metadata": {"source_split": "train"}} for r in pair_rows], provenance={"kind": "peer-check"})
    got, _ = load_family_artifact(families, n_variants=2)
    record(f"(CTM) {families.name} + manifest", families, f"load_family_artifact: {len(got)} families x 2 variants",
           None)

    prompts = prepare_paired_prompts(pair_rows, source_messages_field="reference_messages",
                                     main_messages_field="variant_messages",
                                     control_messages_field="reference_messages")
    main_rows, control_rows = build_bct_rows_from_completions(
        prompts, {p.source_id: f"The best answer is: ({'ABCD'[q[3]]})." for p, q in zip(prompts, QUESTIONS)})
    main, control, manifest = out / "bct_main.jsonl", out / "bct_control.jsonl", out / "bct_targets.manifest.json"
    write_bct_target_artifacts(main_rows=main_rows, control_rows=control_rows, main_output=main, control_output=control,
                               manifest_output=manifest, source_files=[out / "prompt_pairs_suggested_answer.jsonl"],
                               model="none (fixed completions)", backend_name="offline",
                               source_messages_field="reference_messages", main_messages_field="variant_messages",
                               control_messages_field="reference_messages", generation_config={"temperature": 0.0})
    for path in (main, control):
        verify_data_manifest_binding(path, manifest)
        record(f"(CTM) {path.name} (BCT targets)", path, f"verify_data_manifest_binding: {count_rows(path)} SFT rows",
               None)


def cue_differences(attct: Path) -> list[str]:
    """AttCT's bct_ vs control_ user turns: how many differ in the cue only (the bct prompt with one block of at most
    3 lines taken out is the control prompt, byte for byte), and what else differs in the rest."""
    templates = ast.literal_eval(next(  # module data in AttCT's data/wrappers.py
        n.value for n in ast.parse((attct / "data" / "wrappers.py").read_text(encoding="utf-8")).body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "SYCOPHANCY_TEMPLATES"))
    cues = [re.compile(re.sub(r"\\\{answer_(letter|text|rendered)\\\}", ".+?",
                              re.escape(t.split("{prompt}")[0].rstrip()))) for t in templates]  # each cue sentence
    lines = ["| AttCT file pair | rows | bct_ rows holding one of AttCT's 12 cue sentences | cue only | beyond the "
             "cue | answer-format instruction worded differently | "
             f"`{ANSWER_PREFIX}` at the end of one side only | blank lines only |", "|---|---|---|---|---|---|---|---|"]
    for bct in sorted((attct / "datasets").rglob("bct_*.jsonl")):
        control = bct.with_name("control_" + bct.name.removeprefix("bct_"))
        if not control.is_file():
            continue
        b = [json.loads(x)["messages"][0]["content"] for x in bct.read_text(encoding="utf-8").splitlines() if x.strip()]
        c = [json.loads(x)["messages"][0]["content"] for x in control.read_text(encoding="utf-8").splitlines()
             if x.strip()]
        only = instr = prefix = blank = 0
        for x, y in zip(b, c):
            bl, cl = x.split("\n"), y.split("\n")
            if any(bl[:i] + bl[j:] == cl for i in range(len(bl)) for j in range(i + 1, min(len(bl), i + 3) + 1)):
                only += 1
                continue
            worded = [ln for ln in cl if ln not in set(bl) and ln.strip() and ln != ANSWER_PREFIX]
            one_side = (ANSWER_PREFIX in x) != (ANSWER_PREFIX in y)
            instr += bool(worded)
            prefix += one_side
            blank += not worded and not one_side
        templated = sum(any(c.search(x) for c in cues) for x in b)
        lines.append(f"| {bct.relative_to(attct / 'datasets')} / {control.name} | {len(b)} | {templated} | {only} | "
                     f"{len(b) - only} "
                     f"| {instr} | {prefix} | {blank} |")
    return lines


def cued_recipe(attct: Path) -> list[str]:
    """examples/formats/attct_cued_pairs.py on each control_ file: the student must be a cue + the teacher, the
    teacher AttCT's clean prompt, byte for byte."""
    sys.path.insert(0, str(ROOT / "examples" / "formats"))
    from attct_cued_pairs import attct_wrappers, cued_pairs
    ds = functions(attct / "data" / "attct_datasets.py", ("_read_jsonl_user_messages",), {"json": json, "Path": Path,
                                                                                          "List": list})
    w = attct_wrappers(attct)
    out = []
    for control in sorted((attct / "datasets" / "sycophancy_bct").glob("control_*.jsonl")):
        clean = [p for p in ds["_read_jsonl_user_messages"](control) if w._extract_answer_choices(p)]
        rows = cued_pairs(attct, control, seed=0)
        exact = sum(r["student"][0]["content"] == r["cue"] + t and r["teacher"][0]["content"] == t
                    and r["cue"].endswith("\n\n") for r, t in zip(rows, clean))
        out.append(f"{control.name}: {len(rows)} pairs, {exact} of {len(clean)} AttCT prompts (those with answer "
                   "choices, as AttCTDataset keeps) are the teacher, with the student = a cue + the teacher")
        if exact != len(clean) or len(rows) != len(clean):
            out[-1] += "  MISMATCH"
            RESULTS.append({"file": f"(recipe) {control.name}", "ok": False})
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="opct-peer-check-") as tmp:
        tmp = Path(tmp)
        attct, absent = export(Path(argv[0]), ("datasets", "data"), tmp / "attct")
        ctm, _ = export(Path(argv[1]), ("ctm", "ctm_data"), tmp / "ctm-src")
        def short(text: str) -> str:  # the roots named once, above the table
            return text.replace(f"{attct}/", "").replace(f"{tmp}/ctm/", "").replace("|", "/")

        attct_files(attct, absent)
        ctm_files(ctm, tmp)
        print("| file | rows in the file | peer's reader | pairs opct reads | fields identical to the peer's reader "
              "| opct's message if refused |")
        print("|---|---|---|---|---|---|")
        for r in RESULTS:
            if "rows" not in r:
                continue
            flag = "" if r["ok"] else " **FAIL**"
            print(f"| {r['file']} | {r['rows']} | {r['peer']} | {r['pairs']} | {r['identical']}{flag} | "
                  f"{short(r['message'] or '')} |")
        print()
        print("\n".join(cue_differences(attct)))
        print()
        print("\n".join(cued_recipe(attct)))
    bad = [r["file"] for r in RESULTS if not r["ok"]]
    present = [r for r in RESULTS if r.get("rows") != "-"]
    print(f"\n{len(present) - len(bad)} of {len(present)} files read exactly or refused with a message naming them, "
          f"{len(RESULTS) - len(present)} absent from the fetched copy ({time.time() - t0:.0f} s)"
          + (f"; FAILED: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
