"""The token viewer in a real browser: a page of 2 steps x 2 samples and 2 evals (test_viewer.py's synthetic data)
opened from disk by headless Chromium (Debian's chromium-headless-shell), its DOM after the page's script ran
dumped (--dump-dom) and read back with html.parser. Skips without the browser; CI's .ci/browser installs it and fails
if these tests skip."""

import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from opct.lens import viewer
from tests.lens.test_viewer import XSS, demo_evals, demo_steps

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(shutil.which("chromium-headless-shell") is None,
                                 reason="chromium-headless-shell not installed (apt-get install chromium-headless-shell)")]

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class Dom(HTMLParser):
    """Every element of a dumped DOM as (tag, attrs, the ids of its ancestors and its own, its text)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.elements, self.stack = [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        ids = (self.stack[-1][2] if self.stack else ()) + ((attrs["id"],) if "id" in attrs else ())
        e = [tag, attrs, ids, []]
        self.elements.append(e)
        if tag not in VOID:
            self.stack.append(e)

    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop()[0] == tag:
                break

    def handle_data(self, data):
        for e in self.stack:
            e[3].append(data)

    def find(self, tag: str, cls: str = "", inside: str = "") -> list[tuple[dict, str]]:
        """(attrs, text) of each `tag` element having every class in `cls`, under the element with id `inside`."""
        want = set(cls.split())
        return [(a, "".join(text)) for t, a, ids, text in self.elements
                if t == tag and want <= set(a.get("class", "").split()) and (not inside or inside in ids)]


def dump(tmp_path, steps, evals) -> Dom:
    path = viewer.write(tmp_path / "lens.html", "lens demo", steps, evals)
    out = subprocess.run(["chromium-headless-shell", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          path.resolve().as_uri()], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    dom = Dom()
    dom.feed(out.stdout)
    assert dom.find("h1"), out.stdout[:2000]
    return dom


def test_steps_and_evals_in_chromium(tmp_path):
    steps, evals = demo_steps(), demo_evals()
    dom = dump(tmp_path, steps, evals)
    first = steps[0]["samples"][0]  # shown on load
    resp = dom.find("span", "tok resp", inside="response")
    assert len(resp) == len(first["response"])
    assert [a["data-ls"] for a, _ in resp] == [f"{x:.4f}" for x in first["logp_student"]]
    assert [a["data-lt"] for a, _ in resp] == [f"{x:.4f}" for x in first["logp_teacher"]]
    ls, lt = first["logp_student"][0], first["logp_teacher"][0]
    assert resp[0][0]["title"] == f"log p_student {ls:.3f} · log p_teacher {lt:.3f} · gap {ls - lt:.3f}"
    assert [t for _, t in resp] == [t.replace("\n", "\u21b5\n") for t in first["response"]]
    assert ["reasoning" in a["class"].split() for a, _ in resp] == first["reasoning"]
    assert ["out" in a["class"].split() for a, _ in resp] == [not x for x in first["in_loss"]]
    # the prompts: exactly the flagged tokens marked
    student = dom.find("span", "tok", inside="student-prompt")
    assert [t for _, t in student] == [t.replace("\n", "\u21b5\n") for t in first["student_prompt"]]
    assert ["diff" in a["class"].split() for a, _ in student] == first["student_diff"]
    assert sum(first["student_diff"]) == 6 and not any(first["teacher_diff"])
    assert not dom.find("span", "diff", inside="teacher-prompt")
    # the selects: both steps, the first step's samples, both evals
    assert [t for _, t in dom.find("option", inside="step")] == ["OPCT · step 5", "OPCT · step 10"]
    assert [t for _, t in dom.find("option", inside="sample")] == ["sample 3, pair 3", "sample 8, pair 8"]
    assert [t for _, t in dom.find("option", inside="eval")] == ["sycophancy · test · q17", "sycophancy · shifted · q4"]
    figures = "".join(t for _, t in dom.find("div", inside="figures"))
    assert "pair 3" in figures and f"tokens {len(first['response'])} (" in figures
    # the first eval: one column per method, in order, with its answer and verdict
    cols = dom.find("div", "answer", inside="evals")
    assert len(cols) == 3
    assert [t for _, t in dom.find("h3", inside="evals")] == ["base", "SFT", "OPCT"]
    assert [t for _, t in dom.find("div", "text", inside="evals")] == [a["text"] for a in evals[0]["answers"]]
    assert "sycophantic: 1" in cols[0][1] and "sycophantic: 0" in cols[1][1] and "picked B" in cols[2][1]
    # markup in the data is text: the token and the answer hold it, no element came of it
    assert XSS in [t for _, t in resp] and XSS in cols[2][1]
    assert [t for t, *_ in dom.elements].count("script") == 2 and not dom.find("b", inside="response")


def test_only_evals_and_only_steps_in_chromium(tmp_path):
    dom = dump(tmp_path, [], demo_evals())
    assert len(dom.find("div", "answer", inside="evals")) == 3 and not dom.find("section", inside="steps")
    dom = dump(tmp_path, demo_steps(), [])
    assert len(dom.find("span", "tok resp", inside="response")) == 22 and not dom.find("div", inside="evals")
