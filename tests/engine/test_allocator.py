"""glibc's malloc set up for an engine's activations (rollwise.engine.allocator): a thread that
allocates and frees a step's activations again and again keeps their pages (glibc's defaults hand
them back and fault them in again, zeroed, at every step); an environment that chose glibc's
settings keeps them."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or not os.path.exists("/proc/self/stat"),
                                reason="glibc's mallopt and Linux's /proc")

STEPS = """
import json, sys, threading
from rollwise.engine import allocator
settled = allocator.settle() if sys.argv[1] == "settle" else None  # (first thing, as rollwise's command line)
import torch
def faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
torch.manual_seed(0)
up, down = torch.nn.Linear(512, 3072, bias=False), torch.nn.Linear(1536, 512, bias=False)
def step():  # an MLP's activations for 1024 tokens: megabytes each, freed at the step's end
    x = torch.randn(1024, 512)
    for _ in range(4):
        g, u = up(x).chunk(2, -1)
        x = x + down(torch.nn.functional.silu(g) * u)
out = []
def steps():
    with torch.no_grad():
        for _ in range(3):
            step()
        f0 = faults()
        for _ in range(10):
            step()
        out.append(faults() - f0)
t = threading.Thread(target=steps)  # (an engine's thread, as in rollwise serve)
t.start()
t.join()
print(json.dumps({"settled": settled, "faults": out[0]}))
"""


def _steps(mode: str, **env) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    r = subprocess.run([sys.executable, "-c", STEPS, mode], env={**clean, "OMP_NUM_THREADS": "1", **env},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_threads_activations_keep_their_pages():
    settled, default = _steps("settle"), _steps("glibc")
    assert settled["settled"] is True
    # 10 steps of 4 MLP blocks: glibc's defaults fault pages in again at every step
    assert default["faults"] > 2000 and settled["faults"] * 10 < default["faults"], (settled, default)


@pytest.mark.parametrize("env", [{"MALLOC_ARENA_MAX": "4"}, {"MALLOC_TRIM_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.perturb=0"}])
def test_an_environment_that_chose_glibcs_settings_keeps_them(env):
    assert _steps("settle", **env)["settled"] is False
