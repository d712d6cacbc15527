"""The experiment layer as data: the methods a demo trains, one row each, and the one way two methods are compared.

A method is a row of `METHODS`: its name (`opct demo --methods`), its label and colour in reports, which trainer
runs it (`trainer`: OFFLINE = supervised fine-tuning on the frozen model's answers, opct.algo.sft; ON_POLICY =
on-policy consistency training, opct.algo.opct; None = not trained: the base model), the TrainConfig settings it changes from OPCT's (a control,
docs/controls.md) and the methods it is compared with (`compared_with`). Nothing else in opct names a method: the
demo trains the rows asked for, the report labels and colours them from here, and every comparison comes from
`compare`, so adding a control is one row here plus, if it needs one, the TrainConfig field it sets.

A run is one method trained with one training seed, named "<method>-seed<S>" (`run_name`: opct-seed0,
opct-shuffled-seed1; the base model's is "base"): its directory, stages and samples file, and its key in results.json
"runs" ({run name: the axis' evaluation result}). "The first seed" (the config's --seed) is a view, not a naming
rule: `first_runs` and `methods_view` give each method's run of it, which the comparisons, capability and the
report's tables show. `read_results` reads an earlier opct's results.json into this schema.

One model's evaluation (results "runs" values, `opct eval --axis`'s file) has four sections (`SECTIONS`,
`evaluation`): "metrics" (metric -> split -> {value, lo, hi, n}, or metric -> such a cell for a metric without
splits: what the report's tables, the Inspect log's scores and `opct eval`'s printout show), "units" (metric ->
split -> {unit: value}, a question's 0/1, a fact's pass rate: what comparisons pair), "counts" (name -> split ->
a count: n, unparsed, unclosed reasoning) and "details" (anything else the axis' own report reads: its judge's
name, per-fact tables, a second judge's reading). Each axis files its figures into them (`Axis.nest`, which
also reads the flat evaluations an earlier opct wrote; `read_evaluation`).

A comparison pairs two methods item by item on the per-unit values of their evaluations ("units"). results.json
"comparison" holds, for each pair (a, b) of the methods run where b is in a's `compared_with`, "<a>_minus_<b>":
metric -> split -> the mean over the units both have of a - b with a paired 95 % bootstrap interval over them
(opct.stats.paired_change). Across training seeds (`--seeds N`) opct.across_seeds.compare_seeds pairs the two methods'
runs of the same seed and bootstraps over seeds and units.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from opct.axes import AXES, FIRST_AXIS, get_axis
from opct.stats import paired_change


OFFLINE, ON_POLICY = "offline", "on-policy"  # the two trainers: opct.algo.sft, opct.algo.opct


@dataclass(frozen=True)
class Method:
    """One row of the methods table (module docstring)."""
    name: str
    label: str
    colour: str
    trainer: str | None  # OFFLINE, ON_POLICY, or None (not trained: the base model)
    overrides: dict = field(default_factory=dict)  # TrainConfig settings changed from OPCT's: a control
    compared_with: tuple[str, ...] = ()  # results "comparison" "<name>_minus_<other>", item by item

    @property
    def control(self) -> bool:
        """OPCT with a setting changed, asking where OPCT's update comes from (docs/controls.md)."""
        return bool(self.overrides)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("base", "base", "#8c8c8c", None),
    Method("sft", "SFT", "#4c72b0", OFFLINE, compared_with=("base",)),
    Method("opct", "OPCT", "#dd8452", ON_POLICY, compared_with=("base", "sft")),
    # the teacher reads another example's clean prompt
    Method("opct-shuffled", "OPCT, shuffled context", "#8172b3", ON_POLICY, {"teacher_context": "shuffled"},
           ("base", "opct")),
    # no teacher in the update: a constant negative advantage (a sampled-token loss by nature: an axis whose OPCT
    # uses an exact loss, jailbreak's, gets the sampled one for this control)
    Method("opct-fixed", "fixed advantage", "#937860", ON_POLICY, {"fixed_advantage": -1.0, "loss": "sampled"},
           ("base", "opct")),
    Method("opct-clip", "OPCT, KL clipped", "#da8bc3", ON_POLICY, {"kl_clip": 1.0}, ("base", "opct")),  # 1 nat a token
)}
BASE = "base"  # the model every trained method starts from: the row with no trainer
TRAINED = tuple(m.name for m in METHODS.values() if m.trainer)  # what `--methods` may name, in table order


def parse_methods(text: str) -> list[str]:
    """`--methods` as a list of trained methods (each once); ValueError naming what it takes otherwise."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    if set(names) - set(TRAINED) or len(set(names)) < len(names):
        raise ValueError(f"--methods takes some of {', '.join(TRAINED)} (each once), got {text!r}")
    return names


def pairs(names, trained_only: bool = False) -> list[tuple[str, str]]:
    """The comparisons among `names` (methods run): (a, b) for each b in a's `compared_with` that was run, in table
    order; `trained_only`: only pairs of two trained methods (what differs across seeds of both)."""
    run = set(names)
    return [(a, b) for a in ordered(run) if a in METHODS for b in METHODS[a].compared_with
            if b in run and not (trained_only and not METHODS[b].trainer)]


def tests_control(a: str, b: str) -> bool:
    """(a, b) compares a control with the trained method it changes one setting of (docs/controls.md)."""
    return METHODS[a].control and METHODS[b].trainer is not None


def ordered(names) -> list[str]:
    """`names` in table order, then any other name in first-seen order."""
    names = list(dict.fromkeys(names))
    return [m for m in METHODS if m in names] + [m for m in names if m not in METHODS]


def key(a: str, b: str) -> str:
    """A comparison's key in results.json: "<a>_minus_<b>"."""
    return f"{a}_minus_{b}"


def compare(units: dict[str, dict], names=None) -> dict:
    """results.json "comparison": {"<a>_minus_<b>": metric -> split -> paired change} for the pairs (`pairs`) of the
    methods in `units` (method -> its evaluation's "units"); pairs or cells without shared units are left out."""
    out = {}
    for a, b in pairs(names if names is not None else units):
        table = {metric: cells for metric, splits in units[a].items()
                 if (cells := {s: c for s, v in splits.items() if s in units[b].get(metric, {})
                               and (c := paired_change(v, units[b][metric][s]))})}
        if table:
            out[key(a, b)] = table
    return out


def run_name(method: str, seed: int) -> str:
    """A training run's name: its directory <out>/<name>, its stages (train_<name>, eval_<name>), its samples file
    samples/<name>.jsonl and its key in results "runs": "<method>-seed<S>" with S the training seed (`--seed` +
    k for `--seeds N`), e.g. opct-seed0, opct-shuffled-seed1. The base model is trained with no seed: "base"."""
    return BASE if method == BASE else f"{method}-seed{seed}"


def parse_run(name: str) -> tuple[str, int | None]:
    """(method, seed) of a run name (`run_name`); (name, None) for base or a name of no such shape."""
    method, sep, seed = name.rpartition("-seed")
    return (method, int(seed)) if sep and method and seed.isdigit() else (name, None)


def first_seed(results: dict) -> int | None:
    """A demo's first training seed: its config's --seed (the first of its training seeds); without a config, the
    smallest seed of its runs; None when it has no trained run."""
    seed = (results.get("config") or {}).get("seed") if isinstance(results.get("config"), dict) else None
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed
    seeds = [s for s in (parse_run(r)[1] for r in results.get("runs") or {}) if s is not None]
    return min(seeds) if seeds else None


def first_runs(results: dict) -> dict[str, str]:
    """{method: its run of the first training seed} for base and every method run (`first_seed`), in the order of
    results "runs": the view of one model per method that the report's tables, the comparisons and capability
    show."""
    first = first_seed(results)
    out = {}
    for run in results.get("runs") or {}:
        method, seed = parse_run(run)
        if run == BASE or (seed is not None and seed == first):
            out[method] = run
    return out


def methods_view(results: dict) -> dict[str, dict]:
    """{method: evaluation} of base and each method's run of the first training seed (`first_runs`), from results
    "runs"; entries that are not an evaluation (a JSON object) are left out."""
    every = results.get("runs") or {}
    return {m: every[r] for m, r in first_runs(results).items() if isinstance(every[r], dict)}


def on_disk(out, run: str, results: dict) -> str:
    """The name `run` of demo `results` has in its folder `out` (its directory <out>/<name>, its
    samples/<name>.jsonl): the run's own, or in a demo an earlier opct wrote, the method's for the first seed's run
    (`read_runs`)."""
    out, (method, seed) = Path(out), parse_run(run)

    def there(name):
        return (out / name).is_dir() or (out / "samples" / f"{name}.jsonl").is_file()
    return method if seed is not None and seed == first_seed(results) and not there(run) and there(method) else run


def runs(results: dict) -> dict[str, dict]:
    """Every evaluated run of a demo's results, {run name: its evaluation} (results "runs": base and
    "<method>-seed<S>" for each method and training seed)."""
    return dict(results.get("runs") or {})


def read_comparison(comparison: dict) -> dict:
    """A results.json "comparison" in this schema, from this opct or an earlier one. Earlier ones wrote each axis'
    own shapes: the sycophancy axis' {"vs_base": {method: {split: cell}}, "opct_minus_sft": {split: cell}} (metric
    sycophancy_rate), the safety axis' {"<metric>_change": {method: {split: cell}}, "opct_minus_sft": {split: cell}}
    and the demo's {"control_minus_opct": {control: {metric: {split: cell}}}}; a pair's {split: cell} without its
    metric takes the metric under which the first method's change from base holds that split."""
    if not isinstance(comparison, dict):
        return comparison
    old = {k for k in comparison if k == "vs_base" or k.endswith("_change") or k == "control_minus_opct"}
    if not old:
        return comparison
    out: dict = {}
    for k in sorted(old, key=list(comparison).index):
        if k == "control_minus_opct":
            for c, table in comparison[k].items():
                out[key(c, "opct")] = table
            continue
        metric = "sycophancy_rate" if k == "vs_base" else k.removesuffix("_change")
        for m, cells in comparison[k].items():
            out.setdefault(key(m, BASE), {})[metric] = cells
    for k, cells in comparison.items():  # an earlier pair of two trained methods: {split: cell}
        if k in old or not isinstance(cells, dict):
            continue
        a = k.split("_minus_")[0]
        for split, cell in cells.items():
            metric = next((mt for mt, sp in out.get(key(a, BASE), {}).items() if split in sp), "sycophancy_rate")
            out.setdefault(k, {}).setdefault(metric, {})[split] = cell
    return {k: {mt: {s: c for s, c in sp.items() if c} for mt, sp in tables.items()} for k, tables in out.items()}


def read_runs(results: dict) -> dict:
    """Earlier demos' runs in this schema: they named the first training seed's runs after their method (results
    "methods": base, sft, opct, ...; directories <out>/sft, <out>/opct) and only the other seeds' "<method>-seed<S>"
    (results "seed_runs"). Here every run is "<method>-seed<S>" (`run_name`) in one map, results "runs"; the
    first seed is the config's --seed, and results "seeds" "runs" names them so too."""
    if "methods" not in results and "seed_runs" not in results:
        return results
    results = dict(results)
    first = first_seed(results) or 0  # an earlier demo without a config ran with --seed's default, 0

    def renamed(name):
        return name if name == BASE or parse_run(name)[1] is not None else run_name(name, first)
    every = {renamed(k): v for k, v in (results.pop("methods", None) or {}).items()}
    results["runs"] = {**every, **(results.pop("seed_runs", None) or {})}
    seeds = results.get("seeds")
    if isinstance(seeds, dict) and isinstance(seeds.get("runs"), dict):
        results["seeds"] = {**seeds, "runs": {m: [renamed(r) for r in rs] if isinstance(rs, list) else rs
                                              for m, rs in seeds["runs"].items()}}
    return results


SECTIONS = ("metrics", "units", "counts", "details")  # one model's evaluation (module docstring)


def evaluation(metrics: dict, units: dict | None = None, counts: dict | None = None,
               details: dict | None = None) -> dict:
    """One model's evaluation in results.json's schema (module docstring); an empty section is {}."""
    return {"metrics": metrics, "units": units or {}, "counts": counts or {}, "details": details or {}}


def from_flat(flat: dict, units: dict, counts: tuple = (), details: tuple = (), drop: tuple = ()) -> dict:
    """An axis' flat figures as an evaluation (`Axis.nest`): the keys named in `counts` and `details` go to those
    sections, `drop` (the per-item tables `units` was read from) to none, and every other one is a metric, except
    one that is None (not measured)."""
    metrics = {k: v for k, v in flat.items() if k not in (*counts, *details, *drop) and v is not None}
    return evaluation(metrics, units, {k: flat[k] for k in counts if k in flat},
                      {k: flat[k] for k in details if k in flat})


def entry(ev: dict, section: str, name: str):
    """One entry of an evaluation's section (`SECTIONS`: a metric, a count, a detail), {} when absent."""
    return (ev.get(section) or {}).get(name) or {}


def read_evaluation(result: dict, axis: str) -> dict:
    """An evaluation in this schema (`SECTIONS`), from this opct or from an earlier one that wrote it flat (its
    metrics, per-item tables and counts side by side): `axis`' `nest` files a flat one. Anything else (not a
    JSON object, an axis this opct does not know) is returned as it is."""
    if not isinstance(result, dict) or "metrics" in result or axis not in AXES:
        return result
    return get_axis(axis).nest(result)


def read_results(results: dict, where: str = "results.json") -> dict:
    """A results.json in this opct's schema, from this opct or an earlier one: demos before the axes existed were
    sycophancy runs and wrote no "axis"; earlier demos named their first seed's runs after the method and kept the
    other seeds apart (`read_runs`); earlier comparisons had each axis' own shape (`read_comparison`). The one place
    old files are read; each run's evaluation through `read_evaluation`."""
    if not isinstance(results, dict):
        raise ValueError(f"{where}: expected a JSON object")
    results = {"axis": FIRST_AXIS, **results} if "axis" not in results else dict(results)
    results = read_runs(results)
    if isinstance(results.get("runs"), dict):
        results["runs"] = {r: read_evaluation(ev, results["axis"]) for r, ev in results["runs"].items()}
    if "comparison" in results:
        results["comparison"] = read_comparison(results["comparison"])
    return results
