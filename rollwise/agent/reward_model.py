"""A learned reward model as the reward: a sequence classifier with one output (Hugging Face's
`*ForSequenceClassification`, as Skywork-Reward and the reward models verl and OpenRLHF use) scores
each answer in its conversation, for tasks no rule can check.

    env = "dataset"
    env_options = { reward = "model", reward_model = { path = "my-rm", max_length = 4096 } }

The conversation (the task's messages, or its prompt as a user message, then the answer as the
assistant's) is rendered with the reward model's own chat template, cut from the left to
`max_length` tokens (the answer's end is what a reward model reads last), and the model's output
at its last token is the reward, as it is (GRPO's groups compare answers with each other; `scale`
and `shift` map it as `scale * score + shift`). The model is loaded once per run (an event loop),
in a worker thread while the episodes go on, and scores the answers of concurrent episodes
together: those waiting, by length, up to `batch_size` at once in a worker thread, padded on the
left, so an answer's score does not depend on what it was batched with (tests: equal to the
model's forward of it alone).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, fields
from pathlib import Path

from rollwise.agent.env import loop_shared

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class RewardModelConfig:
    path: str  # a local Hugging Face directory: config.json, weights, tokenizer (with a chat template)
    max_length: int = 4096  # tokens of a scored conversation (cut from the left)
    batch_size: int = 16  # answers scored in one forward
    dtype: str = "float32"
    scale: float = 1.0
    shift: float = 0.0

    @classmethod
    def from_dict(cls, d: dict) -> RewardModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown reward_model options {unknown}; valid: {sorted(known)}")
        if "path" not in d:
            raise ValueError("reward_model needs path = a local reward model's directory")
        cfg = cls(**d)
        if cfg.dtype not in DTYPES:
            raise ValueError(f"reward_model dtype {cfg.dtype!r} is not one of {list(DTYPES)}")
        if cfg.max_length < 2 or cfg.batch_size < 1:
            raise ValueError(f"reward_model needs max_length >= 2 and batch_size >= 1, got {cfg.max_length} and "
                             f"{cfg.batch_size}")
        if not (Path(cfg.path) / "config.json").is_file():
            raise ValueError(f"reward_model path {cfg.path!r} is not a model directory (no config.json)")
        return cfg


class RewardModel:
    """The model, its tokenizer, and the answers waiting to be scored."""

    def __init__(self, cfg: RewardModelConfig) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from rollwise import mkl
        mkl.settle()  # (a score the same bits in every process: its rotary embedding's cos)
        self.cfg, self.torch = cfg, torch
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.path)
        model = AutoModelForSequenceClassification.from_pretrained(cfg.path, dtype=getattr(torch, cfg.dtype))
        if model.config.num_labels != 1 or not isinstance(getattr(model, "score", None), torch.nn.Linear):
            raise ValueError(f"{cfg.path} is not a reward model: a *ForSequenceClassification with one label and a "
                             f"`score` head is needed (got {type(model).__name__}, {model.config.num_labels} labels)")
        self.model = model.eval()
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.waiting: list[tuple[list[int], asyncio.Future]] = []
        self.pump: asyncio.Task | None = None
        self.forwards = 0  # (batches run: tests)

    @classmethod
    async def shared(cls, cfg: RewardModelConfig) -> RewardModel:
        """The run's one model of this config (per event loop), loaded in a worker thread the first
        time: the episodes go on meanwhile, and those scoring wait for it."""
        loading = loop_shared(("reward-model", cfg), lambda: asyncio.ensure_future(asyncio.to_thread(cls, cfg)))
        return await asyncio.shield(loading)

    def encode(self, messages: list[dict]) -> list[int]:
        """The conversation's tokens as the reward model reads it, cut from the left to max_length."""
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return ids[-self.cfg.max_length:]

    def scores(self, batch: list[list[int]]) -> list[float]:
        """One forward of the batch, padded on the left: each row's output at its last token."""
        torch = self.torch
        n = max(map(len, batch))
        ids = torch.tensor([[self.pad] * (n - len(r)) + r for r in batch])
        mask = torch.tensor([[0] * (n - len(r)) + [1] * len(r) for r in batch])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (each row counts from its first token)
        with torch.inference_mode():
            hidden = self.model.base_model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
            out = self.model.score(hidden[:, -1]).float()[:, 0]
        self.forwards += 1
        return [self.cfg.scale * float(x) + self.cfg.shift for x in out]

    async def score(self, messages: list[dict]) -> float:
        """The reward of the conversation's last (assistant) message; batched with the others waiting."""
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((self.encode(messages), fut))
        if self.pump is None or self.pump.done():
            self.pump = asyncio.create_task(self._pump())
        return await asyncio.shield(fut)

    async def _pump(self) -> None:
        while self.waiting:
            await asyncio.sleep(0)  # (the episodes scoring in this tick join the batch)
            self.waiting.sort(key=lambda w: len(w[0]))  # (similar lengths together: less padding)
            batch, self.waiting = self.waiting[:self.cfg.batch_size], self.waiting[self.cfg.batch_size:]
            try:
                out = await asyncio.to_thread(self.scores, [ids for ids, _ in batch])
            except Exception as e:  # noqa: BLE001 - each episode of the batch gets it
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, fut), s in zip(batch, out):
                if not fut.done():
                    fut.set_result(s)
