"""``import riemannian_ref`` stays light: the compiler, Triton and SciPy's statistics load only when used.

Behavioural, not timed (``benchmarks/bench_import.py`` measures the time):
a fresh interpreter imports the package and reports which heavy modules
``sys.modules`` holds, then runs one eager attention call with its backward
(the eager operator does not go through the custom op, whose first call would
import ``torch._dynamo``) and reports again; finally a statistic of the
protocol loads ``scipy.stats``, the positive control that the probe sees a
lazy import happen.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ["torch._dynamo", "triton", "scipy.stats", "sympy", "torch._inductor"]

PROBE = f"""
import json, sys
heavy = {HEAVY!r}
loaded = lambda: [m for m in heavy if m in sys.modules]
import riemannian_ref as rr
res = {{"file": rr.__file__, "after_import": loaded()}}
import torch
q = torch.randn(2, 5, 4, requires_grad=True)
U = torch.randn(2, 5, 4, 2)
rr.riemannian_attention(q, q, q, torch.rand(2, 5, 5) > 0.3, U_k=U).sum().backward()
res["after_attention"] = loaded()
rr.protocol.paired_difference([1.0, 2.0, 4.0], [0.5, 1.0, 1.0], n_resamples=10)
res["after_statistics"] = loaded()
print(json.dumps(res))
"""


def test_import_and_eager_attention_load_no_compiler_triton_or_scipy():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=env)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(res["file"]).resolve().is_relative_to(ROOT)  # the package under test, not an installed copy
    assert res["after_import"] == []
    # the first call may load sympy: torch.broadcast_shapes imports it (torch's own lazy import)
    assert [m for m in res["after_attention"] if m != "sympy"] == []
    assert "scipy.stats" in res["after_statistics"]
