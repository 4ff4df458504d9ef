"""`import unimp`, `unimp.load` and the CLI import no framework; `import unimp` is fast.

The import is timed in CPU time (best of five) so a busy machine does not make it flaky.
"""

import json
import subprocess
import sys

FRAMEWORKS = ["torch", "jax", "flax", "tensorflow", "keras", "paddle", "intel_extension_for_pytorch", "numpy"]

PROBE = f"""
import sys, time, json
t = time.process_time()
import unimp
t_import = time.process_time() - t
unimp.load("mixed_bf16"); unimp.load("torch_autocast_cuda").fingerprint
from unimp.cli import main
main(["presets"]); main(["show", "pure_bf16"])
print(json.dumps({{"t": t_import, "loaded": [m for m in {FRAMEWORKS!r} if m in sys.modules]}}))
"""


def test_no_framework_imported_and_import_is_fast():
    best = None
    for _ in range(5):
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
        data = json.loads(out.stdout.strip().splitlines()[-1])
        assert data["loaded"] == [], f"imported frameworks: {data['loaded']}"
        best = data["t"] if best is None else min(best, data["t"])
    assert best < 0.1, f"import unimp took {best * 1000:.0f} ms"
