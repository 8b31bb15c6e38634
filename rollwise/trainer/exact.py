"""True on-policy logprobs: the trainer's values bit for bit the replicas' (`TrainConfig.true_on_policy`).

transformers' forward rounds otherwise than the engine's kernels, so a trainer's logprobs of
freshly sampled tokens differ from the rollout's in their last bits, and the importance ratio of
an on-policy sample is 1 +- 1e-6 rather than 1. Here the trainer computes every logprob's value
with the engine's own model and kernels, batch-invariant (rollwise/engine/models/linear.py), over
each whole sequence at once; batch-invariant replicas computed each of those tokens in whatever
batch, chunk or draft, with the same bits. The gradient is transformers' (autograd through its
forward of the same weights): `value + (hf - hf.detach())` is the exact value, since x - x is 0.

The engine model's weights are the trainer's (merged LoRA included: `PolicyModel.engine_weights`; or,
as replicas that take the adapter alone hold them, the base weights and the adapter on every row),
copied in before each forward, so a forward under a kept older version (`behaviour = "recompute"`)
gets that version's values too.
"""
from __future__ import annotations

import torch

from rollwise.engine import lora
from rollwise.engine.attention import build_metadata
from rollwise.engine.models.loader import load_model, load_weights
from rollwise.wire import AdapterWeights


class ExactLogprobs:
    BLOCK = 16

    def __init__(self, model_dir: str) -> None:
        self.model = load_model(model_dir, "float32", "cpu")
        self.model.set_batch_invariant()
        c = self.model.config
        self.kv_shape = (c.num_layers, c.num_kv_heads, c.head_dim)
        self.loads = 0
        # the weights last copied in, held (so their memory is not another tensor's) with their
        # version counters: the same tensors unchanged since (no optimizer step) are not copied again
        self._held: list[tuple[torch.Tensor, int]] = []

    @torch.inference_mode()
    def __call__(self, weights: dict[str, torch.Tensor], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 targets: torch.Tensor, mask: torch.Tensor, temperature: float,
                 adapter: AdapterWeights | None = None) -> torch.Tensor:
        """[B, L-1] log p(targets) at the masked positions (0 elsewhere), as the engine samples them:
        rows of input_ids [B, L] are right-padded sequences (attention_mask). With `adapter`, the
        weights are the base it runs on, and every row runs on it as a replica serves it."""
        held = [(t, t._version) for t in weights.values()]
        if len(held) != len(self._held) or any(a.data_ptr() != b.data_ptr() or u != v
                                                for (a, u), (b, v) in zip(held, self._held)):
            load_weights(self.model, weights, partial=True)
            self.model.prepack()
            self.loads += 1
        self._held = held
        if adapter is not None:
            built = lora.build(self.model, "policy", adapter.config, adapter.tensors, 0, max_rank=1 << 16)
        lens = attention_mask.sum(1).tolist()
        blocks, tables = 0, []
        for n in lens:
            k = -(-n // self.BLOCK)
            tables.append(list(range(blocks, blocks + k)))
            blocks += k
        layers, heads, dim = self.kv_shape
        kv = (torch.empty(layers, blocks * self.BLOCK, heads, dim), torch.empty(layers, blocks * self.BLOCK, heads, dim))
        meta = build_metadata(lens, [0] * len(lens), tables, self.BLOCK, torch.device("cpu"), use_native=True)
        ids = torch.cat([input_ids[i, :n] for i, n in enumerate(lens)])
        pos = torch.cat([torch.arange(n) for n in lens])
        if adapter is not None:
            lora.set_plan([(torch.arange(len(ids)), built)])
        try:
            hidden = self.model(ids, pos, meta, kv)
        finally:
            lora.set_plan(None)
        starts = torch.tensor([0] + lens[:-1]).cumsum(0)  # each sequence's first row in the flat batch
        sel = mask > 0  # target j of a row is predicted at its position j
        b, j = sel.nonzero(as_tuple=True)
        logits = self.model.logits(hidden[starts[b] + j])  # every row's own bits, whatever the others
        # as the sampler scales: by a float32 tensor of the row's temperature
        logp = torch.log_softmax(logits / torch.tensor([temperature])[:, None], dim=-1)
        out = torch.zeros(targets.shape)
        out[b, j] = logp.gather(1, targets[b, j][:, None]).squeeze(1)
        return out
