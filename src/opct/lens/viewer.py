"""The token viewer: one static HTML page (inline CSS and vanilla JS, no server, no network) over a run's token logs
and its evaluations.

Part 1, training samples: a select of steps and one of that step's samples; for the chosen sample the perturbed
(student) and the clean (teacher) prompt side by side, token by token, with the tokens the other side lacks marked
(class `diff`), and below them the response, each token coloured by its gap log p_student - log p_teacher (red where
the student puts more mass on the token than the teacher, blue where less, white at 0, saturating at |gap| = 3
nats) and carrying both log-probs in its hover title and in data-ls / data-lt. Part 2, evaluations: a select of
prompts and, for the chosen one, one column per method with its answer and verdicts. Either part is left out of the
page when it has nothing to show; an optional header (trusted HTML from the caller) goes on top.

The data travels as JSON in <script type="application/json" id="lens-data"> with every "<" written "\\u003c"
(still the same JSON string), so no token, "</script>" included, can end that element; the script reads it with
JSON.parse and inserts every piece of text with textContent or text nodes, never as HTML. The arguments are checked
and copied to plain JSON types first (a length that disagrees raises ValueError naming the step, the sample and the
field), so a bad caller fails here rather than drawing a wrong page.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from opct.data.io import atomic_write

SATURATE = 3.0  # nats: |gap| at which a response token's colour is fully red or blue

# (field, the field whose length it must have); "reasoning" may also be None (not a thinking model)
LENGTHS = (("student_diff", "student_prompt"), ("teacher_diff", "teacher_prompt"), ("logp_student", "response"),
           ("logp_teacher", "response"), ("in_loss", "response"), ("reasoning", "response"))


def need(d: dict, key: str, where: str):
    if not isinstance(d, dict) or key not in d:
        raise ValueError(f"{where}: no {key!r}")
    return d[key]


def clean_sample(s: dict, where: str) -> dict:
    """A sample as the page's JSON holds it (module docstring), its lengths checked."""
    pair = int(need(s, "pair", where))
    out = {"pair": pair, "label": str(s.get("label") or f"pair {pair}")}
    for key in ("student_prompt", "teacher_prompt", "response"):
        out[key] = [str(t) for t in need(s, key, where)]
    for key, ref in LENGTHS:
        values = s.get(key) if key == "reasoning" else need(s, key, where)
        if values is None and key == "reasoning":
            out[key] = None
            continue
        values = list(values)
        if len(values) != len(out[ref]):
            raise ValueError(f"{where}: {key} has {len(values)} entries, {ref} has {len(out[ref])}")
        if key.startswith("logp"):
            values = [float(v) for v in values]
            bad = next((j for j, v in enumerate(values) if not math.isfinite(v)), None)
            if bad is not None:
                raise ValueError(f"{where}: {key}[{bad}] is {values[bad]}, not a finite log-prob")
        else:
            values = [bool(v) for v in values]
        out[key] = values
    return out


def clean_value(v):
    return None if v is None else int(v) if float(v).is_integer() else float(v)


def clean_eval(e: dict, where: str) -> dict:
    out = {k: str(need(e, k, where)) for k in ("axis", "split", "id")}
    out["prompt"] = str(e.get("prompt") or "")
    out["answers"] = []
    for a in need(e, "answers", where):
        verdict = a.get("verdict") or {}
        if not all(isinstance(v, dict) for v in verdict.values()):
            raise ValueError(f"{where}: {a.get('method')!r}'s verdict is not {{name: {{value, answer, explanation}}}}")
        out["answers"].append({"method": str(need(a, "method", where)), "text": str(a.get("text") or ""),
                               "verdict": {str(name): {"value": clean_value(v.get("value")),
                                                       "answer": str(v.get("answer") or ""),
                                                       "explanation": str(v.get("explanation") or "")}
                                           for name, v in verdict.items()}})
    return out


def page_data(steps: list[dict], evals: list[dict]) -> dict:
    """The page's JSON: {"saturate", "steps": [{"label", "samples"}], "evals"}, checked and in plain JSON types."""
    out_steps = []
    for step in steps:
        label = str(need(step, "label", "step"))
        samples = [clean_sample(s, f"step {label!r} sample {j}") for j, s in enumerate(need(step, "samples", label))]
        out_steps.append({"label": label, "samples": samples})
    return {"saturate": SATURATE, "steps": out_steps,
            "evals": [clean_eval(e, f"eval {i}") for i, e in enumerate(evals)]}


def script_json(data: dict) -> str:
    """JSON that can sit inside a <script> element: "<" only occurs inside its strings, where "\\u003c" is the same
    character to JSON.parse, so "</script>" or "<!--" in a token cannot end or alter the element."""
    return json.dumps(data, allow_nan=False).replace("<", "\\u003c")


CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.2em 2em; color: #222; }
h1 { font-size: 1.4em; margin: 0 0 .4em; } h2 { font-size: 1.2em; margin: 1.4em 0 .4em; border-bottom: 1px solid #ccc; }
h3 { font-size: 1em; margin: .8em 0 .3em; }
#header { background: #f6f6f6; border: 1px solid #ddd; padding: .4em .8em; }
.controls select { margin: 0 1em 0 .3em; max-width: 40em; }
#figures { margin: .6em 0; } #figures b { font-weight: 600; }
.tokens { font: 13px/1.7 ui-monospace, Menlo, Consolas, monospace; white-space: pre-wrap; word-break: break-word;
  border: 1px solid #ddd; padding: .5em; max-height: 45vh; overflow: auto; }
.tok { box-shadow: inset -1px 0 #e4e4e4; } .tok.diff { background: #ffe866; }
.tok.reasoning { font-style: italic; text-decoration: underline dotted #555; }
.tok.out { opacity: .4; }
.prompts { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 1em; }
.legend { margin: .4em 0; font-size: 12.5px; } .legend > span { margin-right: 1.2em; white-space: nowrap; }
.scale { display: inline-block; width: 12em; height: .9em; vertical-align: middle; border: 1px solid #bbb;
  background: linear-gradient(to right, rgb(0,0,255), #fff, rgb(255,0,0)); }
#eval-prompt { margin-top: .5em; white-space: pre-wrap; background: #f6f6f6; border: 1px solid #ddd; padding: .5em; }
#evals { display: grid; gap: 1em; margin-top: .6em; }
#evals .answer { border: 1px solid #ddd; padding: .5em; min-width: 0; } .answer h3 { margin-top: 0; }
.answer .text { white-space: pre-wrap; word-break: break-word; }
.verdict { margin-top: .5em; border-top: 1px dashed #ccc; padding-top: .3em; font-size: 13px; }
.verdict .expl { color: #555; white-space: pre-wrap; }
"""

STEPS_HTML = """<section id="steps"><h2>Training samples</h2>
<div class="controls"><label>step<select id="step"></select></label><label>sample<select id="sample"></select></label>
</div>
<div id="figures"></div>
<div class="legend">gap = log p_student &minus; log p_teacher: <span><small>&minus;3</small> <span class="scale"></span>
<small>+3 nats</small></span><span class="tok diff">differs from the other prompt</span>
<span class="tok out">not in the loss</span><span id="legend-reasoning"><span class="tok reasoning">reasoning</span>
<span class="tok final">answer</span></span></div>
<div class="prompts"><div><h3>student (perturbed) prompt</h3><div id="student-prompt" class="tokens"></div></div>
<div><h3>teacher (clean) prompt</h3><div id="teacher-prompt" class="tokens"></div></div></div>
<h3>response</h3><div id="response" class="tokens"></div>
</section>
"""

EVALS_HTML = """<section id="evaluations"><h2>Evaluations</h2>
<div class="controls"><label>prompt<select id="eval"></select></label></div>
<div id="eval-prompt"></div><div id="evals"></div>
</section>
"""

JS = r"""
"use strict";
const D = JSON.parse(document.getElementById("lens-data").textContent);
const $ = (id) => document.getElementById(id);
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
// a newline shows as an arrow, then breaks the line (white-space: pre-wrap keeps spaces and the break)
const visible = (t) => t.split("\n").join("\u21b5\n");
function fill(select, labels, onchange) {
  labels.forEach((l, i) => { const o = el("option", "", l); o.value = i; select.append(o); });
  select.onchange = () => onchange(+select.value);
  onchange(0);
}
function put(box, nodes) { const f = document.createDocumentFragment(); f.append(...nodes); box.replaceChildren(f); }
function colour(g) {
  const a = Math.min(Math.abs(g) / D.saturate, 1), c = Math.round(255 * (1 - a));
  return g >= 0 ? `rgb(255,${c},${c})` : `rgb(${c},${c},255)`;
}
function prompt(box, tokens, diff) {
  put(box, tokens.map((t, i) => el("span", diff[i] ? "tok diff" : "tok", visible(t))));
}
function showSample(s) {
  prompt($("student-prompt"), s.student_prompt, s.student_diff);
  prompt($("teacher-prompt"), s.teacher_prompt, s.teacher_diff);
  const gaps = s.response.map((_, i) => s.logp_student[i] - s.logp_teacher[i]);
  put($("response"), s.response.map((t, i) => {
    const ls = s.logp_student[i], lt = s.logp_teacher[i], g = gaps[i];
    let cls = "tok resp";
    if (s.reasoning) cls += s.reasoning[i] ? " reasoning" : " final";  // final: the answer after the reasoning
    if (!s.in_loss[i]) cls += " out";
    const span = el("span", cls, visible(t));
    span.style.background = colour(g);
    if (Math.abs(g) > 0.6 * D.saturate) span.style.color = "#fff";
    span.title = `log p_student ${ls.toFixed(3)} · log p_teacher ${lt.toFixed(3)} · gap ${g.toFixed(3)}`;
    span.dataset.ls = ls.toFixed(4);
    span.dataset.lt = lt.toFixed(4);
    return span;
  }));
  $("legend-reasoning").hidden = !s.reasoning;
  const loss = gaps.map((g, i) => i).filter((i) => s.in_loss[i]);
  const mean = loss.length ? loss.reduce((a, i) => a + gaps[i], 0) / loss.length : NaN;
  const top = loss.reduce((b, i) => (b < 0 || Math.abs(gaps[i]) > Math.abs(gaps[b]) ? i : b), -1);
  const parts = [["pair", String(s.pair)], ["tokens", `${s.response.length} (${loss.length} in the loss)`],
                 ["mean gap", loss.length ? `${mean.toFixed(3)} nats` : "—"],
                 ["largest |gap|", top < 0 ? "—"
                   : `${gaps[top].toFixed(3)} nats at token ${top} ${JSON.stringify(s.response[top])}`]];
  put($("figures"), parts.flatMap(([k, v], i) => [i ? " · " : "", el("b", "", k + " "), v]));
}
function showStep(i) {
  const samples = D.steps[i].samples, sel = $("sample");
  sel.replaceChildren();
  if (samples.length) fill(sel, samples.map((s) => s.label), (j) => showSample(samples[j]));
  else for (const id of ["figures", "student-prompt", "teacher-prompt", "response"]) $(id).replaceChildren();
}
function showEval(e) {
  $("eval-prompt").textContent = e.prompt;
  $("evals").style.gridTemplateColumns = `repeat(${Math.max(e.answers.length, 1)}, minmax(0, 1fr))`;
  put($("evals"), e.answers.map((a) => {
    const col = el("div", "answer");
    col.append(el("h3", "", a.method), el("div", "text", a.text));
    for (const [name, v] of Object.entries(a.verdict)) {
      const d = el("div", "verdict");
      d.append(el("b", "", `${name}: ${v.value === null ? "—" : v.value}`));
      if (v.answer) d.append(" · answer ", el("span", "vanswer", v.answer));
      if (v.explanation) d.append(el("div", "expl", v.explanation));
      col.append(d);
    }
    return col;
  }));
}
if (D.steps.length) fill($("step"), D.steps.map((s) => s.label), showStep);
if (D.evals.length) {
  fill($("eval"), D.evals.map((e) => `${e.axis} · ${e.split} · ${e.id}`), (i) => showEval(D.evals[i]));
}
"""


def page(title: str, steps: list[dict], evals: list[dict], header_html: str = "") -> str:
    """The viewer's HTML text (module docstring). `steps`: [{"label", "samples": [sample]}], a sample {"pair",
    "label" (optional), "student_prompt", "teacher_prompt" (decoded tokens), "student_diff", "teacher_diff",
    "response", "logp_student", "logp_teacher", "in_loss", "reasoning" (or None)}; `evals`: [{"axis", "split",
    "id", "prompt", "answers": [{"method", "text", "verdict": {name: {"value", "answer", "explanation"}}}]}];
    `header_html` is inserted as it is (trusted)."""
    data = page_data(steps, evals)
    t = html.escape(title)
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
            f"<title>{t}</title>\n<style>{CSS}</style></head>\n<body>\n<h1>{t}</h1>\n"
            + (f"<div id=\"header\">{header_html}</div>\n" if header_html else "")
            + (STEPS_HTML if data["steps"] else "") + (EVALS_HTML if data["evals"] else "")
            + f"<script type=\"application/json\" id=\"lens-data\">{script_json(data)}</script>\n"
            + f"<script>{JS}</script>\n</body></html>\n")


def write(path, title: str, steps: list[dict], evals: list[dict], header_html: str = "") -> Path:
    """The page (`page`) written to `path` whole (atomic_write: a reader never sees half a page)."""
    return atomic_write(path, page(title, steps, evals, header_html))
