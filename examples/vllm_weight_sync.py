"""A trainer's weight sync written against vLLM's offline engine, run on rollwise by its import
alone: vLLM 0.32's `reload_weights` through `collective_rpc` (from the trainer's tensors, or from a
checkpoint), `collective_rpc` with a function given the worker (verl's, NeMo-RL's way) and with the
name of a worker extension's method (OpenRLHF's, prime-rl's), `apply_model`, vLLM 0.32's weight
labels on each output, and last the model path TRL's colocated GRPO writes through, one tensor a
call (vLLM's CPU backend drops each linear's weight once it has packed it, so there it fails).

    python examples/vllm_weight_sync.py MODEL_DIR
    python examples/vllm_weight_sync.py TRAINED_DIR --fresh   # a fresh engine on the trained weights
"""
from __future__ import annotations

import gc
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # (TRL's: vLLM's engine in this process)

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

try:
    from vllm import LLM, SamplingParams
except ImportError:  # the same script on rollwise
    from rollwise import LLM, SamplingParams


class FileSync:
    """A worker extension (vLLM mixes it into its worker): read a checkpoint the trainer wrote."""

    def load_checkpoint(self, path: str) -> str:
        self.reload_weights(weights_iterator=load_file(path).items())
        return "loaded"


def trained(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A stand-in for a trainer's step: every matrix moved a little, the same way on any machine."""
    return {k: v + 0.05 * torch.sin(torch.arange(v.numel(), dtype=v.dtype)).reshape(v.shape) if v.dim() == 2 else v
            for k, v in state.items()}


PROMPTS = ["The capital of France is", "Two plus two is"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def engine(model: str, **kwargs) -> LLM:
    return LLM(model=model, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.5, seed=0,
               max_model_len=512, **kwargs)


def main(model: str) -> None:
    llm = engine(model, worker_extension_cls="__main__.FileSync")

    def show(when: str) -> list:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for out in outs:
            c = out.outputs[0]
            spans = [(s.version, s.start, s.end) for s in c.weight_versions or ()]
            print(f"{when}: {out.prompt!r} -> {list(c.token_ids)} weight_versions {spans}")
        return [list(o.outputs[0].token_ids) for o in outs]

    first = show("before")
    print(f"weight version {llm.get_weight_version()!r}, vocabulary {llm.apply_model(lambda m: m.config.vocab_size)}")
    checkpoint = os.path.join(model, "model.safetensors")
    state = load_file(checkpoint)
    # vLLM 0.32's in-place reload, from the trainer's tensors (Hugging Face names)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": trained(state).items()})
    llm.reset_prefix_cache()
    llm.update_weight_version("step-1")
    assert show("after the trainer's step") != first
    # verl's and NeMo-RL's way: a function run on each worker, given the worker; back to the checkpoint
    llm.collective_rpc(lambda worker, path: worker.reload_weights(weights_path=path), args=(model,))
    llm.reset_prefix_cache()
    llm.update_weight_version("step-0")
    assert show("back on the checkpoint") == first
    # prime-rl's and OpenRLHF's way: a worker extension's method, by name
    print(f"extension: {llm.collective_rpc('load_checkpoint', args=(checkpoint,))}")
    llm.reset_prefix_cache()
    assert show("reloaded by the extension") == first
    # TRL's colocated GRPO: each of the trainer's tensors through the model, then the prefix cache reset
    engine_model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    try:
        for name, tensor in trained(state).items():
            engine_model.load_weights([(name, tensor)])
    except (AssertionError, RuntimeError, ValueError) as e:
        print(f"TRL's path: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    else:
        llm.reset_prefix_cache()
        print(f"TRL's path: {[list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]}")
    llm = None  # (vLLM 0.32 on the CPU may abort at interpreter exit otherwise)
    gc.collect()


def fresh(trained_dir: str) -> None:
    """What the synced engine should give: a fresh engine on the trained weights (a checkpoint of `trained`)."""
    llm = engine(trained_dir)
    for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False):
        print(f"a fresh engine on the trained weights: {out.prompt!r} -> {list(out.outputs[0].token_ids)}")
    del llm
    gc.collect()


if __name__ == "__main__":
    fresh(sys.argv[1]) if sys.argv[2:3] == ["--fresh"] else main(sys.argv[1])
