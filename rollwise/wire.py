"""What a LoRA run and an MoE rollout send beside the shared types (`rollwise.types`): a policy's
weights as a LoRA adapter, and routed experts in SGLang's wire encoding; SGLang's default name of a
weight-update group. Imports no torch."""
from __future__ import annotations

import base64
from dataclasses import dataclass

GROUP = "weight_update_group"  # SGLang's default name of a weight-update group


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """A policy's weights as a LoRA adapter on the base weights a replica holds (peft's
    `adapter_config.json` as a dict, and its tensors under peft's names): what a LoRA run sends
    each step instead of merged weights (`lora_sync = "adapter"`)."""
    config: dict
    tensors: dict

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def encode_routing(experts) -> str:
    """Routed experts (int numpy [n, layers, k]) as SGLang sends them: base64 of int32, flattened."""
    import numpy as np
    return base64.b64encode(np.ascontiguousarray(experts, dtype="<i4").tobytes()).decode()


def decode_routing(data: str, shape) -> object:
    """The inverse of `encode_routing`: int32 numpy of `shape` ([n, layers, k]; n may be -1)."""
    import numpy as np
    return np.frombuffer(base64.b64decode(data), dtype="<i4").reshape(shape).copy()


def npy64(a) -> str:
    """An array as vLLM sends one (its numpy2base64): the .npy bytes, base64."""
    import io

    import numpy as np
    buf = io.BytesIO()
    np.save(buf, np.asarray(a), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def from_npy64(data: str) -> object:
    """The inverse of `npy64`."""
    import io

    import numpy as np
    return np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)
