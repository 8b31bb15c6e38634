"""Per-token advantages whitened over the batch, read top to bottom: PPO's critic, a value model with
generalized advantage estimation (`advantage = "gae"`), and REINFORCE++ without one.

The critic is the policy's decoder (a copy of the warm-started weights, with LoRA: the base ones; or
another model's, `critic_model`, on the same tokens) and a linear value head, zero at first, so the
first step's advantages are the episodes' returns. It values every generated token's state: the
hidden state that predicts the token, so a turn's first token is valued after the prompt or the
tool result before it. Observation tokens are the environment's transition, not actions: GAE runs
over an episode's generated tokens in order (its contexts' too), each turn's reward on its last
token (an episode reward beyond its turns' on the episode's last), the value after the last token
0 (an episode cut off by a limit is not bootstrapped, as verl does):

    delta_i = r_i + gamma V_{i+1} - V_i,    A_i = delta_i + gamma lambda A_{i+1},    R_i = A_i + V_i

The trainer whitens the advantages over the batch's tokens (verl's masked_whiten); the critic
regresses R with a clipped value loss, 0.5 max((V - R)^2, (V_clip - R)^2), V_clip the old value
moved by at most `value_clip` (verl's cliprange_value), its own AdamW, a step per mini-batch. Groups
are not needed (a group of one trains), and a group whose episodes all got the same reward still
does.

REINFORCE++ (Hu 2025; verl's and OpenRLHF's `reinforce_plus_plus`): no critic; each token's
discounted return to go (GAE with V = 0 and lambda 1), whitened over the batch. With `_baseline`:
each episode's reward less its group's mean on every token, whitened over the batch (the batch's
spread, not the group's, scales it).
"""
from __future__ import annotations

import copy

import torch

from rollwise.trainer.data_parallel import Comm
from rollwise.trainer.losses import split
from rollwise.trainer.optim import clipped_step, skipped
from rollwise.trainer.policy import Batch, PolicyModel, cache_kw, enable_checkpointing, inject_lora, micro_batches
from rollwise.trainer.prefix import decoder_states
from rollwise.types import Trajectory


def check(gamma: float, lam: float, lr: float | None, value_clip: float, warmup: int) -> None:
    """A ValueError naming the setting of the critic's that is out of range."""
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"need 0 <= gae_gamma <= 1 and 0 <= gae_lambda <= 1, got {gamma}, {lam}")
    if (lr is not None and lr <= 0) or value_clip <= 0 or warmup < 0:
        raise ValueError(f"need critic_lr > 0, value_clip > 0 and critic_warmup >= 0, got {lr}, {value_clip}, "
                         f"{warmup}")


def token_rewards(t: Trajectory) -> list[float]:
    """Per generated token of the episode (its sequences in order): each turn's reward on its last
    token, the episode's reward beyond its turns' on the last one; 0 elsewhere."""
    out: list[float] = []
    carry = 0.0  # the rewards of turns before any generated token (none generated yet)
    for s in t.sequences():
        for turn in s.turns:
            if turn.num_generated:
                out += [0.0] * turn.num_generated
                out[-1] += carry
                carry = 0.0
            if out:
                out[-1] += turn.reward
            else:
                carry += turn.reward
    if out:
        out[-1] += t.reward - sum(turn.reward for s in t.sequences() for turn in s.turns)
    return out


def gae(values: list[float], rewards: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """Advantages and returns of one episode's generated tokens (the value after the last is 0)."""
    adv, last, nxt = [0.0] * len(values), 0.0, 0.0
    for i in reversed(range(len(values))):
        delta = rewards[i] + gamma * nxt - values[i]
        last = delta + gamma * lam * last
        adv[i], nxt = last, values[i]
    return adv, [a + v for a, v in zip(adv, values)]


def positions(s: Trajectory) -> list[int]:
    """The target positions of a sequence's generated tokens, in order (target j predicts token j + 1)."""
    return [j for turn in s.turns for j in range(turn.start - 1, turn.start - 1 + turn.num_generated)]


def _warm_start(policy: PolicyModel, share: bool):
    """The policy's model without its adapters, built on the meta device and given the policy's base
    tensors (`share`) or a copy of each (tied ones copied once), so no second model is allocated only
    to be overwritten; the buffers the state dict leaves out (rotary frequencies) copied from it."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(policy.model.config, dtype=torch.float32)
    copies: dict[int, torch.Tensor] = {}
    state = {k: v.detach() if share else copies.setdefault(id(v), v.detach().clone())
             for k, v in policy.base_state().items()}
    model.load_state_dict(state, assign=True)
    own = dict(policy.model.named_buffers())
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:
            mod, _, attr = name.rpartition(".")
            model.get_submodule(mod)._buffers[attr] = own[name].clone()
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise RuntimeError("the critic's warm start left tensors unset")
    return model


class Critic:
    def __init__(self, policy: PolicyModel, lr: float = 1e-4, value_clip: float = 0.5, max_grad_norm: float = 1.0,
                 weight_decay: float = 0.0, model_dir: str = "", lora: bool = False, comm=None) -> None:
        """`lora`: the critic trains LoRA adapters (the policy's rank, alpha and targets) and the value
        head on the policy's own frozen base weights, shared, not copied (the policy must train LoRA).
        `comm`: data parallel (data_parallel.py): `update` sums the ranks' tokens, losses and gradients."""
        from transformers import AutoModelForCausalLM
        self.comm = comm or Comm()
        if lora and (policy.lora is None or model_dir):
            raise ValueError("critic_lora trains adapters on the policy's frozen base weights, shared: it needs "
                             "the policy to train LoRA (lora_rank > 0) and no critic_model")
        if model_dir:  # a model of its own (verl's critic.model.path): another size, but the policy's tokens
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            if model.config.vocab_size != policy.model.config.vocab_size:
                raise ValueError(f"critic_model {model_dir} has a vocabulary of {model.config.vocab_size}, the "
                                 f"policy {policy.model.config.vocab_size}: the critic reads the policy's tokens")
        else:  # the warm start (with LoRA: the weights under the adapters; with `lora`, those very tensors)
            model = _warm_start(policy, share=lora)
        if lora:  # the policy's LoRA settings (a copy: peft fills a config in as it injects)
            inject_lora(model, copy.deepcopy(policy.lora))
        self.lora = lora
        if policy.checkpointing:
            enable_checkpointing(model)
        self.body = model.get_decoder().train()
        self.head = torch.nn.Linear(model.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.value_clip, self.max_grad_norm = value_clip, max_grad_norm
        self._cache_kw = cache_kw(model)
        self.lr = lr  # the base learning rate (the trainer's schedule scales it)
        self.opt = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=weight_decay)
        self._first: list[float] | None = None  # the first epoch's loss and clipped tokens (`estimate`'s)
        self._scale = 1.0  # what `estimate` divided the first epoch's losses by
        self._done: set[int] = set()  # the batches whose first epoch `estimate` backpropagated

    def parameters(self) -> list[torch.nn.Parameter]:
        """The trained ones (with `lora`: the adapters and the head)."""
        return [p for p in [*self.body.parameters(), *self.head.parameters()] if p.requires_grad]

    def values(self, b: Batch) -> torch.Tensor:
        """[B, L-1] the value of each generated target's state (0 off `b.mask`)."""
        h, off = decoder_states(self.body, b, self._cache_kw)
        sel = b.mask[:, off:] > 0
        out = torch.zeros(b.mask.shape)
        out[:, off:][sel] = self.head(h[sel]).squeeze(-1)
        return out

    def estimate(self, trajs: list[Trajectory], gamma: float, lam: float, micro_batch_tokens: int,
                 penalty: dict[int, list[float]] | None = None, backward: float | None = None) -> list[tuple]:
        """`estimate` (below) with the current critic's values. `backward`: also the first epoch's
        value loss, divided by `backward` (1: summed, and `update` divides it by the batch's tokens;
        the batch's tokens, when it comes whole), backpropagated from the same forward: the values at
        the old weights are the first epoch's prediction. A micro-batch's graph lives until its
        episodes' advantages are known, after its own forward unless an episode of several contexts
        goes on in a later micro-batch: that one's graph is dropped at the next forward and its loss
        recomputed, so one graph lives at a time."""
        if backward is None:
            with torch.no_grad():
                return estimate(trajs, gamma, lam, micro_batch_tokens, self.values, penalty=penalty)
        if self._first is None:
            self._first, self._scale = [0.0, 0.0], backward
        elif self._scale != backward:
            raise ValueError(f"a step's value losses take one divisor, got {backward} after {self._scale}")
        held: dict[int, torch.Tensor] = {}  # batch id -> its values with their graph

        def values(b: Batch) -> torch.Tensor:
            held.clear()
            v = held[id(b)] = self.values(b)
            return v.detach()

        def done(item: tuple) -> None:
            _, b, _, ret, old = item
            self._done.add(id(b))
            loss, clipped = self._loss(b, ret, old, backward, held.pop(id(b), None))
            loss.backward()
            self._first[0] += float(loss.detach())
            self._first[1] += clipped

        return estimate(trajs, gamma, lam, micro_batch_tokens, values, penalty=penalty, done=done)

    def reset(self) -> None:
        """A new step: no gradients, nothing backpropagated yet."""
        self.opt.zero_grad(set_to_none=True)
        self._first, self._done = None, set()

    def _loss(self, b: Batch, ret: torch.Tensor, old: torch.Tensor, n: float,
              v: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """The clipped value loss of a micro-batch over `n` tokens (the values `v`, or the current
        critic's), and its clipped tokens."""
        v = self.values(b) if v is None else v
        vc = old + (v - old).clamp(-self.value_clip, self.value_clip)
        unclipped, worse = (v - ret) ** 2, (vc - ret) ** 2
        loss = (0.5 * torch.maximum(unclipped, worse) * b.mask).sum() / n
        return loss, float(((worse > unclipped).float() * b.mask).sum())

    def update(self, items: list[tuple], epochs: int, mini_batches: int = 1) -> dict[str, float]:
        """`epochs` passes over the items (`estimate`'s), each `mini_batches` optimizer steps of the
        clipped value loss over contiguous parts of about equal tokens (the policy's, as verl's critic
        takes the actor's mini-batch size), a step's loss the mean over its part's generated tokens
        (the first epoch's gradients those `estimate` backpropagated, if it did: one part only).
        Returns the first epoch's metrics."""
        comm = self.comm
        n = float(comm.sum(torch.tensor(sum(float(b.mask.sum()) for _, b, *_ in items), dtype=torch.float64)))
        m: dict[str, float] = {}
        first, done, scale, self._first, self._done = self._first, self._done, self._scale, None, set()
        if not n:
            self.opt.zero_grad(set_to_none=True)
            return m
        if first is not None and mini_batches > 1:
            raise ValueError("the first epoch's gradients were backpropagated for one part, not mini_batches > 1")
        parts = [[it for _, it in part] for part in split([(it[1], it) for it in items], mini_batches)]
        if comm.world > 1:  # the k-th parts of every rank make the k-th step
            k = max(comm.gather(len(parts) if items else 0))
            parts = (parts + [[]] * k)[:k] if items else [[] for _ in range(k)]
        for epoch in range(epochs):
            loss_sum, clipped, norms = 0.0, 0.0, []
            for part in parts:
                pn = n if len(parts) == 1 else float(comm.sum(torch.tensor(
                    sum(float(b.mask.sum()) for _, b, *_ in part), dtype=torch.float64)))
                summed = epoch == 0 and first is not None  # backpropagated by `estimate`, divided by `scale`
                part_loss, c_sum = first if summed else (0.0, 0.0)
                for _, b, _, ret, old in part:
                    if not (summed and id(b) in done):
                        loss, c = self._loss(b, ret, old, scale if summed else pn)
                        loss.backward()
                        part_loss += float(loss.detach())
                        c_sum += c
                if summed and scale != pn:
                    for p in self.parameters():
                        if p.grad is not None:
                            p.grad.div_(pn / scale)
                    part_loss /= pn / scale
                loss_sum, clipped = loss_sum + part_loss, clipped + c_sum
                comm.grads(self.parameters())
                norms.append(clipped_step(self.parameters(), self.opt, self.max_grad_norm))
            if epoch == 0:
                loss_sum, clipped = comm.sum(torch.tensor([loss_sum, clipped], dtype=torch.float64)).tolist()
                m = {"value_loss": loss_sum / len(parts), "value_clip_frac": clipped / n,
                     "critic_grad_norm": sum(norms) / len(norms), "critic_skipped_updates": skipped(norms)}
        sel = [(ret[b.mask > 0], old[b.mask > 0]) for _, b, _, ret, old in items]
        none = [torch.zeros(0)]  # (a rank with no tokens)
        ret, old = torch.cat([r for r, _ in sel] or none), torch.cat([o for _, o in sel] or none)
        if comm.world > 1:  # (every rank's tokens)
            ret, old = (torch.cat(x) for x in zip(*comm.gather((ret, old))))
        # how much of the returns' variance the values (before this update) explain: 1 perfect, <= 0 none
        var = float(ret.var()) if len(ret) > 1 else 0.0
        m.update(value_mean=float(old.mean()), return_mean=float(ret.mean()),
                 explained_var=1.0 - float((ret - old).var()) / var if var > 0 else 0.0)
        return m

    def state(self) -> dict:
        body = {k: v for k, v in self.body.state_dict().items() if "lora_" in k or not self.lora}  # (not the base)
        return {"body": body, "head": self.head.state_dict(), "optimizer": self.opt.state_dict()}

    def load_state(self, state: dict) -> None:
        self.body.load_state_dict(state["body"], strict=not self.lora)
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["optimizer"])


def estimate(trajs: list[Trajectory], gamma: float, lam: float, micro_batch_tokens: int, values=None,
             episode: dict[int, float] | None = None, penalty: dict[int, list[float]] | None = None,
             done=None) -> list[tuple]:
    """Micro-batches of the trajectories' sequences, each (sequences, batch, advantages, returns, values),
    the last three [B, L-1]: GAE per episode over its generated tokens under `values` (Batch -> [B, L-1];
    None: 0, so the advantages are the discounted returns to go), each token's reward less its
    `penalty` (trajectory id -> per generated token, kl_reward.py), or with `episode` (trajectory id ->
    advantage) that advantage on every generated token. `done(item)` is called with each item as soon
    as its advantages are known: after the values of the last micro-batch holding any of its
    episodes' sequences (its own, unless an episode of several contexts goes on in a later one)."""
    mbs = micro_batches([s for t in trajs for s in t.sequences()], micro_batch_tokens)
    where = {id(s): (i, r) for i, mb in enumerate(mbs) for r, s in enumerate(mb)}
    last = {id(t): max(where[id(s)][0] for s in t.sequences()) for t in trajs}  # an episode's last micro-batch
    ending: list[list[Trajectory]] = [[] for _ in mbs]  # the episodes whose last micro-batch is i
    ready = list(range(len(mbs)))  # micro-batch i's advantages are known after micro-batch ready[i]
    for t in trajs:
        ending[last[id(t)]].append(t)
        for s in t.sequences():
            i = where[id(s)][0]
            ready[i] = max(ready[i], last[id(t)])
    items: list[tuple] = []
    for i, mb in enumerate(mbs):
        b = Batch.of(mb)
        v = values(b) if values is not None else torch.zeros(b.mask.shape)
        items.append((mb, b, torch.zeros(b.mask.shape), torch.zeros(b.mask.shape), v))
        for t in ending[i]:
            seqs = [(where[id(s)], positions(s)) for s in t.sequences()]
            vals = [float(items[j][4][r, k]) for (j, r), pos in seqs for k in pos]
            if episode is not None:
                a = g = [episode[id(t)]] * len(vals)
            else:
                rew = token_rewards(t)
                if penalty is not None:
                    rew = [x - p for x, p in zip(rew, penalty[id(t)], strict=True)]
                a, g = gae(vals, rew, gamma, lam)
            k = 0
            for (j, r), pos in seqs:
                items[j][2][r, pos] = torch.tensor(a[k:k + len(pos)])
                items[j][3][r, pos] = torch.tensor(g[k:k + len(pos)])
                k += len(pos)
        if done is not None:
            for j in range(i + 1):
                if ready[j] == i:
                    done(items[j])
    return items


def whiten(items: list[tuple], comm=None) -> tuple[float, float]:
    """The mean and std (sqrt(var + 1e-8), as verl's masked_whiten) of the items' advantages over
    their generated tokens (`estimate`'s items); with a data-parallel `comm`, over every rank's."""
    a = torch.cat([adv[b.mask > 0] for _, b, adv, _, _ in items] or [torch.zeros(0)])
    if comm is not None and comm.world > 1:  # every rank's count and sum, then squared deviations from their mean
        a = a.double()
        n, mean = comm.sum(torch.tensor(float(len(a)), dtype=torch.float64)), comm.sum(a.sum())
        mean = mean / n.clamp(min=1)
        sq = comm.sum(((a - mean) ** 2).sum())
        return float(mean), float((sq / (n - 1).clamp(min=1) + 1e-8).sqrt()) if n >= 2 else 1.0
    if len(a) < 2:
        return float(a.mean()) if len(a) else 0.0, 1.0
    return float(a.mean()), float((a.var() + 1e-8).sqrt())
