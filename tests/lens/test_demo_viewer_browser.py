"""A demo's tokens.html (opct.lens.report) opened in headless Chromium: the page a user opens from a report."""

import json
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from opct.cli import main
from opct.lens import tokens

BROWSER = shutil.which("chromium-headless-shell")
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(BROWSER is None, reason="needs chromium-headless-shell (Debian's package)")]


class Spans(HTMLParser):
    """The response tokens' spans (span.tok.resp: data-ls, data-lt, text) and the answers' boxes of a dumped DOM."""

    def __init__(self):
        super().__init__()
        self.resp, self.answers, self._in = [], 0, None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "span" and {"tok", "resp"} <= set(classes):
            self.resp.append({"ls": float(a["data-ls"]), "lt": float(a["data-lt"]), "text": ""})
            self._in = self.resp[-1]
        if "answer" in classes:
            self.answers += 1

    def handle_data(self, data):
        if self._in is not None:
            self._in["text"] += data

    def handle_endtag(self, tag):
        if tag == "span":
            self._in = None


def test_a_demos_token_viewer_shows_its_logged_tokens(tiny_model_dir, tmp_path):
    out = tmp_path / "demo"
    rc = main(["demo", "--axis", "sycophancy", "--model", str(tiny_model_dir), "--methods", "sft,opct", "--steps", "2",
               "--prompts-per-step", "2", "--n-train", "4", "--n-eval", "4", "--cued-n", "4", "--shift-n", "4",
               "--probe-every", "0", "--capability", "", "--report-to", "none", "--max-new-tokens", "5",
               "--token-log-every", "1", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    page = out / "tokens.html"
    assert "tokens.html" in (out / "report.md").read_text()
    dom = subprocess.run([BROWSER, "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    got = Spans()
    got.feed(dom)
    # the page opens on OPCT's first logged step, its first sample: those tokens and values, as the step logged them
    step = tokens.logged_steps(out / "opct-seed0")[0]
    rows = [r for r in tokens.read_step(out / "opct-seed0", step)[0].to_pylist() if r["sample"] == 0]
    assert len(got.resp) == len(rows) > 0
    for span, row in zip(got.resp, rows):
        assert span["ls"] == pytest.approx(row["logp_student"], abs=1e-4)
        assert span["lt"] == pytest.approx(row["logp_teacher"], abs=1e-4)
    assert got.answers == 3  # base, SFT and OPCT side by side on the first evaluated prompt
    results = json.loads((out / "results.json").read_text())
    assert set(results["runs"]) == {"base", "sft-seed0", "opct-seed0"}
