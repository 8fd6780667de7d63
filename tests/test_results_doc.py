"""docs/results.md's tables are what the committed GPU runs give (scripts/results_doc.py --check)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_results_doc_tables_match_the_committed_data():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "results_doc.py"), "--check"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_results_doc_check_fails_when_a_table_is_edited(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    import results_doc

    doc = tmp_path / "results.md"
    text = (ROOT / "docs" / "results.md").read_text()
    doc.write_text(text.replace("| Wan2.2-TI2V-5B | p2poff | 81 |", "| Wan2.2-TI2V-5B | p2poff | 80 |", 1))
    monkeypatch.setattr(results_doc, "DOC", doc)
    monkeypatch.setattr(sys, "argv", ["results_doc.py", "--check"])
    assert results_doc.main() == 1
    monkeypatch.setattr(sys, "argv", ["results_doc.py"])
    assert results_doc.main() == 0 and doc.read_text() == text
