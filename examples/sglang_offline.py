"""A script written against SGLang's offline engine (`sglang.Engine`) that runs on rollwise by its import
alone, as an RL loop drives it: token-in-token-out rollouts with logprobs (a GRPO group by
sampling_params.n), memory given back while a trainer would run, and the trainer's weights pushed back
in buckets of tensors.

    python examples/sglang_offline.py MODEL_DIR
"""
from __future__ import annotations

import sys

from safetensors.torch import load_file
from transformers import AutoTokenizer

try:
    from sglang import Engine
except ImportError:  # the same script on rollwise
    from rollwise import SGLangEngine as Engine


def main(model: str) -> None:
    engine = Engine(model_path=model, tp_size=1, mem_fraction_static=0.5, random_seed=0, log_level="error")
    ids = AutoTokenizer.from_pretrained(model).encode("Solve: 12 + 30 =")  # token in, token out
    group = engine.generate(input_ids=ids, sampling_params={"n": 4, "temperature": 1.0, "max_new_tokens": 16},
                            return_logprob=True)
    for out in group:  # what a trainer keeps: each sample's tokens and their logprobs
        logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
        print(f"rollout {out['meta_info']['id']}: {len(out['output_ids'])} tokens, logprob {sum(logprobs):.2f}")
    greedy = {"temperature": 0, "max_new_tokens": 8}
    before = engine.generate(input_ids=ids, sampling_params=greedy)["output_ids"]
    engine.release_memory_occupation()  # the trainer's turn: KV pool and weights given back
    engine.resume_memory_occupation()
    weights = load_file(f"{model}/model.safetensors")  # (the trainer's new weights; here the same ones)
    names = sorted(weights)
    for bucket in (names[: len(names) // 2], names[len(names) // 2:]):
        ok, message, *_ = engine.update_weights_from_tensor([(n, weights[n]) for n in bucket], flush_cache=False)
        assert ok, message
    engine.flush_cache()
    after = engine.generate(input_ids=ids, sampling_params=greedy)["output_ids"]
    print(f"same tokens after the update: {after == before}")
    engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
