"""A screenshot of a token viewer page (opct.lens.viewer) in headless Chromium, to look at the page without a
desktop browser.

    python dev/viewer_screenshot.py PAGE.html OUT.png [--width 1400 --height 1000]
    python dev/viewer_screenshot.py --demo OUT.png       # the browser test's synthetic page (tests/lens)

Runs `chromium-headless-shell --no-sandbox --disable-gpu --screenshot=OUT --window-size=W,H file://PAGE` (Debian's
package chromium-headless-shell) and prints OUT's path. The window is what is shot: a page taller than --height is
cut there. --demo writes the synthetic page of tests/lens/test_viewer.py (2 steps x 2 samples, 2 evals) to a
temporary file first; run it from the repository with opct's venv (it imports opct and that test module).
"""

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def demo_page(folder: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from opct.lens import viewer
    from tests.lens.test_viewer import demo_evals, demo_steps
    return viewer.write(folder / "lens-demo.html", "opct lens: synthetic demo", demo_steps(), demo_evals())


def screenshot(page: Path, out: Path, width: int, height: int) -> Path:
    browser = shutil.which("chromium-headless-shell")
    if browser is None:
        sys.exit("chromium-headless-shell not found (apt-get install chromium-headless-shell)")
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([browser, "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--screenshot={out}",
                    f"--window-size={width},{height}", page.resolve().as_uri()],
                   check=True, timeout=60, capture_output=True)
    if not out.exists():
        sys.exit(f"no screenshot written to {out}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("page", nargs="?", help="the viewer's HTML file")
    ap.add_argument("out", help="the PNG to write")
    ap.add_argument("--demo", action="store_true", help="shoot the browser test's synthetic page instead of PAGE")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=1000)
    args = ap.parse_args()
    if args.demo == (args.page is not None):
        ap.error("give PAGE.html OUT.png, or --demo OUT.png")
    with tempfile.TemporaryDirectory() as tmp:
        page = demo_page(Path(tmp)) if args.demo else Path(args.page)
        print(screenshot(page, Path(args.out), args.width, args.height))


if __name__ == "__main__":
    main()
