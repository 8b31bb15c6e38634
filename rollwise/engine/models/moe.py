"""Sparse mixture-of-experts feed-forward, as Qwen3-MoE defines it: a linear router scores every
expert per token, softmax in fp32, the top-k are kept (renormalised to sum to 1 if the config says
so) and the token's output is their SwiGLU experts' outputs weighted by those probabilities.

The experts' weights lie as transformers holds them in memory (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]), so a trainer's tensors load as they are; checkpoints name each
expert's linears (`experts.{e}.gate_proj.weight`, ...), which `CausalLM.hf_tensors` lists as views.

`routing` is each forward's chosen experts per token ([T, k] int, this layer's) when asked for
(`record = True`): the model runner keeps them beside the tokens' KV for Rollout Routing Replay
(the trainer then takes each token through the experts the rollout routed it to).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollwise.engine import native
from rollwise.engine.models.linear import Linear, pack, packed_linear


class Experts(nn.Module):
    # batch invariance: each expert's rows through oneDNN's packed GEMM (see linear.py), whatever
    # number of tokens the batch routes to it
    batch_invariant: bool = False

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def repack(self) -> None:
        self.packed = None
        if self.batch_invariant:
            self.packed = [(pack(g), pack(d)) for g, d in zip(self.gate_up_proj, self.down_proj)]

    def _linear(self, x: torch.Tensor, e: int, which: int) -> torch.Tensor:
        if self.packed is not None and not torch.is_grad_enabled():
            return packed_linear(x, self.packed[e][which])
        return F.linear(x, (self.gate_up_proj, self.down_proj)[which][e])

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; experts, weights [T, k]: sum over j of weights[t, j] * expert experts[t, j](x[t])."""
        t, k = experts.shape
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        rows = x[order // k]
        ys = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            gate_up = self._linear(rows[start:start + n], e, 0)
            if native.takes(gate_up):
                h = native.silu_and_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                h = F.silu(gate) * up
            ys[start:start + n] = self._linear(h, e, 1)
            start += n
        ys *= weights.reshape(-1)[order].unsqueeze(1)
        out = torch.empty_like(ys)
        out[order] = ys  # back to (token, slot) order: a copy (index_add here cost more than the experts)
        return out.view(t, k, -1).sum(1)


class SparseMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.gate = Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, intermediate)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.record = False
        self.routing: torch.Tensor | None = None  # the last forward's experts, [T, k], when recording

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, experts = torch.softmax(self.gate(x).float(), dim=-1).topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        if self.record:
            self.routing = experts
        return self.experts(x, experts, top.to(x.dtype))
