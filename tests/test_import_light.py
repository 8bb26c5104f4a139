"""`import polyrl` and listing backends touch no device and import no vendor module eagerly."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import json, sys
import polyrl
from polyrl.core.plugins import list_backends
from polyrl.cli import build_parser
build_parser()
described = [b.describe() for b in list_backends().values()]
import torch
vendor = [m for m in sys.modules if m.split('.')[0] in ('triton', 'torch_npu', 'vllm', 'flash_attn')]
print(json.dumps({"vendor": vendor, "cuda_initialized": torch.cuda.is_initialized(),
                  "names": sorted(b["name"] for b in described)}))
"""


def test_import_polyrl_is_vendor_free_and_device_free():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["vendor"] == []
    assert data["cuda_initialized"] is False
    assert {"cpu", "cuda", "ascend"} <= set(data["names"])


def test_probe_would_see_a_vendor_import():
    # The same probe notices a vendor module once something imports it (so the test above can fail).
    proc = subprocess.run([sys.executable, "-c", "import triton\n" + PROBE], capture_output=True, text=True)
    if proc.returncode == 0:  # triton installed: the probe must report it
        assert "triton" in json.loads(proc.stdout.strip().splitlines()[-1])["vendor"]
    else:
        assert "No module named 'triton'" in proc.stderr
