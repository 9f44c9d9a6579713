"""scripts/bench/sync_sites.py: sync warnings counted per call site, other warnings passed through, the
script run with its own arguments."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import warnings

def sync():
    warnings.warn("called a synchronizing CUDA operation")

print("argv", sys.argv[1:])
for _ in range(3):
    sync()
warnings.warn("called a synchronizing CUDA operation")
warnings.warn("an unrelated deprecation")
"""


def test_sync_sites_counts_each_call_site(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    out = tmp_path / "sites.json"
    cmd = [sys.executable, str(ROOT / "scripts/bench/sync_sites.py"), "--out", str(out), "--", str(script)]
    proc = subprocess.run([*cmd, "--rows", "4"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "argv ['--rows', '4']"
    report = json.loads(out.read_text())
    assert report == json.loads(proc.stdout.split("\n", 1)[1])
    assert report["total_syncs"] == 4
    (three, one) = report["sites"]
    assert three["count"] == 3 and one["count"] == 1
    assert three["stack"][-1].endswith(":6 sync") and one["stack"][-1].endswith(":11 <module>")
    assert three["warning"] == "called a synchronizing CUDA operation"
    assert "an unrelated deprecation" in proc.stderr
