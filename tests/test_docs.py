"""The documentation site builds: `mkdocs build --strict` (mkdocs.yml at the repository root, pages in docs/).

Strict mode turns every warning into a failure: a page missing from the nav, a link to a page or anchor that does
not exist. The build is offline (no plugin fetches anything; the theme uses the system fonts).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).with_name("mkdocs")


def test_the_docs_build_strictly(tmp_path: Path) -> None:
    assert MKDOCS.exists(), f"{MKDOCS} is missing: install the test extra (pip install -e '.[test]')"
    site = tmp_path / "site"
    result = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(site)], cwd=REPO,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    pages = {path.relative_to(site).as_posix() for path in site.rglob("index.html")}
    for page in ("index.html", "getting-started/index.html", "architecture/index.html", "configuration/index.html",
                 "strategies/index.html", "writing-plugins/index.html", "compression/index.html", "wan/index.html",
                 "dashboard/index.html", "deployment/index.html", "benchmarks/index.html", "glossary/index.html"):
        assert page in pages, f"{page} was not built"
    assert (site / "crossdc.svg").exists()
