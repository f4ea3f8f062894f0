"""sgpa-decoupled's prior means at long T on the CPU: time and peak extra memory of one layer's forward + backward
(B = 1, H = 2, Dh = 32, fp32, one thread; issue #30's CPU setting), each case in a child process through
``benchmarks/attention_scaling.py``'s ``measure_case`` (resident-set high-water mark; run with
``MALLOC_MMAP_THRESHOLD_=131072`` as docs/benchmarks.md explains, which this script sets for its children).
docs/benchmarks.md, "Prior means at long T".

Run: ``python research/prior_mean_memory.py``.
"""

import json
import os
import subprocess
import sys

#: "softmax-mean" is the softmax prior mean alone (an object, made in the child); recipe "encoder-swap" adds the
#: separate query and key maps
CASES = [
    ("softmax", {}),
    ("sgpa-decoupled", {"covariance": "diag", "num_global": 16, "prior_mean": "attention"}),
    ("sgpa-decoupled", {"covariance": "diag", "num_global": 16, "prior_mean": "softmax-mean"}),
    ("sgpa-decoupled", {"covariance": "diag", "num_global": 16, "recipe": "encoder-swap"}),
]
if len(sys.argv) > 1:  # a child: one case
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import torch

    torch.set_num_threads(1)
    from attention_scaling import measure_case

    from gpattn.variational.means import SoftmaxMean

    name, opts, T = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    opts = {k: SoftmaxMean() if v == "softmax-mean" else v for k, v in opts.items()}
    r = measure_case(name, opts, T, "fwd+bwd", 1, 2, 32, warmup=1, min_reps=2, max_reps=3, budget=5.0)
    print(json.dumps(r))
    sys.exit()
env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
for T in (1024, 8192):
    for name, opts in CASES:
        out = subprocess.run(
            [sys.executable, __file__, name, json.dumps(opts), str(T)], capture_output=True, text=True, env=env
        )
        r = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-300:]}
        print(T, name, opts, r, flush=True)
