"""Users an agent talks to (verl's "interaction", tau-bench's user simulator): with `user` set, a
tool env's reply without a tool call (or its `finish` answer) goes to the user instead of ending
the episode, and the user's answer is the model's next message, until the user ends the
conversation. The episode's reward is then the user's, or the env's score of the agent's last reply.

    env_options = { user = "feedback" }                      # wrong answers get another try
    env_options = { user = { kind = "feedback", max_attempts = 2, discount = 0.5 } }
    env_options = { user = { url = "http://127.0.0.1:8001/v1", instruction_key = "instruction" } }
    env_options = { user = { kind = "policy", instruction_key = "instruction" } }   # self-play
    env_options = { user = "my_users.py:Customer" }          # a user's class: reply(task, dialogue, score)

`feedback` scores each answer with the env's reward and, short of `success`, asks for another
attempt (`message`), up to `max_attempts`; the reward is the last attempt's score times
`discount` ** (attempts - 1), so a policy may learn to correct itself and, with discount < 1, to
be right at once; with `details = true` the message is followed by what the env can say about the
answer (`ToolEnv.feedback`: the dataset env's `unit_tests` and the bugfix env give the failing
tests' output, as RLEF's execution feedback does). `url` simulates a user with an LLM behind an OpenAI chat-completions server:
it is told the task's hidden goal (`instruction_key`'s field) and reads the conversation with the
roles turned round, writes the user's next message, and ends the conversation by writing `stop`
(or after `max_replies`); the env then scores the agent's last reply. With `opens = true` it
speaks first (tau-bench's users do): a task then needs only its instruction, and the env's own
first message joins the system message as the agent's instructions. A failing simulator is
retried, then the episode ends with status `error` and runs again. `kind = "policy"` has the
policy itself play that user (self-play: the run's own generator, the weights being trained, with
the same prompt; its lines are observations, not trained). A user's class is made once
per episode with the table's other options and has `async reply(task, dialogue, score) ->
UserReply` (or a plain function) and optionally `opening(task) -> str`, its first message:
`dialogue` holds what the two sides said to each other (no tool calls or results), `score(answer)`
awaits the env's reward of a reply (and `score.feedback(answer)` its words on it, or None)."""
from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, fields
from typing import Awaitable, Callable, Protocol

from rollwise.agent.chat_client import ChatClient, bearer_key, check_api
from rollwise.agent.env import loop_shared
from rollwise.agent.plugins import FORM, load_object
from rollwise.agent.tools import ServiceError

Score = Callable[[str], Awaitable[float]]


@dataclass
class UserReply:
    content: str | None = None  # the user's next message; None: the conversation ends
    reward: float | None = None  # when it ends: the episode's reward (None: the env's score of the last reply)


class User(Protocol):
    async def reply(self, task: dict, dialogue: list[dict], score: Score) -> UserReply: ...

    # optional: async opening(task) -> str, the user's first message (tau-bench's: the user speaks
    # first); the env's own first user message then joins its system message, as instructions


class FeedbackUser:
    """Another attempt after a wrong answer, as verl's GSM8K interaction asks for one."""

    def __init__(self, max_attempts: int = 3, discount: float = 1.0, success: float = 1.0,
                 message: str = "That is not right. Check your work and answer again (attempts left: {left}).",
                 details: bool = False) -> None:
        if max_attempts < 1 or not 0.0 < discount <= 1.0:
            raise ValueError(f"user 'feedback' needs max_attempts >= 1 and 0 < discount <= 1 "
                             f"(got {max_attempts}, {discount})")
        try:
            message.format(attempt=1, left=1, max_attempts=1)
        except (KeyError, IndexError) as e:
            raise ValueError(f"user 'feedback' message has a field other than attempt, left, max_attempts: {e}") from e
        self.max_attempts, self.discount, self.success, self.message = max_attempts, discount, success, message
        self.details = details  # the env's words on a wrong answer after the message (a failing test's output)
        self.attempts = 0

    async def reply(self, task: dict, dialogue: list[dict], score: Score) -> UserReply:
        self.attempts += 1
        reward = await score(dialogue[-1]["content"])
        if reward >= self.success or self.attempts >= self.max_attempts:
            return UserReply(reward=reward * self.discount ** (self.attempts - 1))
        left = self.max_attempts - self.attempts
        text = self.message.format(attempt=self.attempts, left=left, max_attempts=self.max_attempts)
        said = await score.feedback(dialogue[-1]["content"]) if self.details and hasattr(score, "feedback") else None
        return UserReply(f"{text}\n\n{said}" if said else text)


PROMPT = """You are playing a person who is talking to an AI assistant. This is your goal, which the \
assistant does not know:

{instruction}

Write only your next message to the assistant, a sentence or two in your own words. Give the facts \
it needs as it asks for them, not all at once, and never make up facts your goal does not give. \
When your goal has been met, or the assistant cannot meet it, write {stop} alone."""


@dataclass
class SimulatedUserConfig:
    url: str | None  # the server's OpenAI base URL, e.g. http://127.0.0.1:8001/v1 (None: the policy plays it)
    model: str | None = None  # default: the first model the server lists
    prompt: str = PROMPT  # fields: {instruction}, {stop}
    instruction_key: str = "instruction"  # the task's field with the user's hidden goal
    stop: str = "###STOP###"  # tau-bench's marker for the end of the conversation
    greeting: str = "Hi! How can I help you today?"  # the assistant's line before the user's first message
    opens: bool = False  # the simulator writes the first user message (the task needs no prompt)
    max_replies: int = 10
    max_tokens: int = 256
    temperature: float = 1.0
    api_key: str | None = None
    api_key_env: str | None = None
    timeout_s: float = 60.0
    retries: int = 2
    backoff_s: float = 1.0
    max_concurrency: int = 16
    api: str = "chat"  # "messages": the server speaks Anthropic's Messages API (url its base, e.g. .../v1)


class SimulatedUser:
    """A user simulated by an LLM (tau-bench's): one `ChatClient` per config and event loop."""

    def __init__(self, cfg: SimulatedUserConfig) -> None:
        self.cfg, self.replies = cfg, 0

    async def opening(self, task: dict) -> str | None:
        """With `opens`, the simulator's first message, written after the assistant's greeting."""
        return (await self._say(task, [])).replace(self.cfg.stop, "").strip() if self.cfg.opens else None

    async def reply(self, task: dict, dialogue: list[dict], score: Score) -> UserReply:
        if self.replies >= self.cfg.max_replies:
            return UserReply()
        text = await self._say(task, dialogue)
        self.replies += 1
        return UserReply() if self.cfg.stop in text else UserReply(text.strip())

    async def _say(self, task: dict, dialogue: list[dict]) -> str:
        """The simulator's next line after the dialogue so far."""
        cfg = self.cfg
        if cfg.instruction_key not in task:
            raise ValueError(f"task {task.get('id')!r} has no {cfg.instruction_key!r} for the simulated user "
                             f"(fields: {sorted(task)})")
        # the simulator plays the user: the agent's messages are its "user" turns, its own are "assistant"
        turned = [{"role": "user" if m["role"] == "assistant" else "assistant", "content": m["content"]}
                  for m in dialogue]
        if not turned or turned[0]["role"] == "assistant":
            turned.insert(0, {"role": "user", "content": cfg.greeting})
        system = cfg.prompt.format(instruction=task[cfg.instruction_key], stop=cfg.stop)
        return await self._complete([{"role": "system", "content": system}, *turned])

    async def _complete(self, messages: list[dict]) -> str:
        """The served model's reply to the simulator's messages."""
        cfg = self.cfg
        chat = loop_shared(("user", repr(cfg)), lambda: ChatClient(
            cfg.url, model=cfg.model, api_key=cfg.api_key, api_key_env=cfg.api_key_env, timeout_s=cfg.timeout_s,
            retries=cfg.retries, backoff_s=cfg.backoff_s, max_concurrency=cfg.max_concurrency,
            what="simulated user", error=ServiceError, api=cfg.api))
        return await chat.complete(messages, _nonempty, max_tokens=cfg.max_tokens, temperature=cfg.temperature)


class PolicyUser(SimulatedUser):
    """The simulated user played by the policy itself (self-play): its lines are generated by the
    episode's own generator (the run's replicas, the weights being trained) from the policy's chat
    template, and are not trained on: they are the agent's observations, as any user's are. The
    episode loop binds the generator (`ToolEnv.bind_generator`). An empty line ends the
    conversation, as `stop` does. Seeded from the run's seed, per reply."""

    def bind(self, generator, tok, params, trajectory_id: str) -> None:
        self._policy, self._said = (generator, tok, params, trajectory_id), 0

    async def _complete(self, messages: list[dict]) -> str:
        from rollwise.types import GenerateRequest, SamplingParams
        generator, tok, params, tid = getattr(self, "_policy", None) or (None,) * 4
        if generator is None:
            raise ValueError("user 'policy' needs the episode's generator: run the env through run_episode")
        seed = None  # (a stable hash: Python's hash of a string differs between processes)
        if params.seed is not None:
            key = f"{params.seed}/{tid}/user/{self._said}".encode()
            seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        p = SamplingParams(temperature=self.cfg.temperature, max_tokens=self.cfg.max_tokens, seed=seed)
        self._said += 1
        out = await generator.generate(GenerateRequest(prompt_token_ids=tok.encode_chat(messages), params=p,
                                                       turn=self._said - 1))
        text = tok.decode(p.text_ids(out.token_ids, out.finish_reason, {tok.eos_token_id}))
        return text if text.strip() else self.cfg.stop


def _nonempty(text: str) -> str:
    if not text.strip():
        raise ValueError("the simulated user's reply is empty")
    return text


def _options(cls, options: dict, what: str) -> dict:
    """The options, if `cls` (a dataclass, a class or a function) takes each of them by name."""
    if hasattr(cls, "__dataclass_fields__"):
        names = {f.name for f in fields(cls)}
    else:
        try:
            params = inspect.signature(cls).parameters
        except (TypeError, ValueError):  # (no signature to check against)
            return options
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return options
        names = set(params)
    unknown = sorted(set(options) - names)
    if unknown:
        raise ValueError(f"user {what!r}: unknown options {unknown}; valid: {sorted(names)}")
    return options


def _maker(make: Callable[[], User], opens: bool) -> Callable[[], User]:
    make.opens = opens  # (its users may write the first message: a task then needs no prompt)
    return make


def user_factory(spec) -> Callable[[], User]:
    """What makes an episode's user from the `user` option: "feedback", a user's class (or a
    function returning a user) as 'module:Name' / 'file.py:Name', or a table with `kind` (one of
    those) or `url` (a simulated user) and the user's options. A ValueError names the valid forms."""
    if isinstance(spec, str):
        spec = {"kind": spec}
    if not isinstance(spec, dict):
        raise ValueError(f"user must be a name or a table, not {type(spec).__name__}")
    options = dict(spec)
    kind = options.pop("kind", "simulated" if "url" in options else None)
    if kind == "simulated":
        if "url" not in options:
            raise ValueError("user 'simulated' needs url = the simulator's OpenAI base URL")
        cfg = SimulatedUserConfig(**_options(SimulatedUserConfig, options, kind))
        try:
            cfg.prompt.format(instruction="", stop="")
        except (KeyError, IndexError) as e:
            raise ValueError(f"simulated user prompt has a field other than instruction, stop: {e}") from e
        if cfg.max_replies < 1 or cfg.retries < 0 or cfg.max_concurrency < 1:
            raise ValueError("simulated user needs max_replies >= 1, retries >= 0, max_concurrency >= 1")
        check_api(cfg.api, "simulated user")
        if cfg.api_key_env:  # checked now, not at the first reply
            bearer_key(cfg.api_key, cfg.api_key_env, "simulated user")
        return _maker(lambda: SimulatedUser(cfg), cfg.opens)
    if kind == "policy":
        served = sorted({"url", "model", "api_key", "api_key_env", "timeout_s", "retries", "backoff_s",
                         "max_concurrency", "api"} & set(options))
        if served:
            raise ValueError(f"user 'policy' is played by the run's own generator: {served} are a served model's")
        cfg = SimulatedUserConfig(url=None, **_options(SimulatedUserConfig, options, kind))
        if cfg.max_replies < 1:
            raise ValueError("user 'policy' needs max_replies >= 1")
        return _maker(lambda: PolicyUser(cfg), cfg.opens)
    if kind == "feedback":
        _options(FeedbackUser, options, kind)
        FeedbackUser(**options)  # its options checked now
        return _maker(lambda: FeedbackUser(**options), False)
    if isinstance(kind, str) and ":" in kind:
        cls = load_object(kind, "user")
        _options(cls, options, kind)
        return _maker(lambda: cls(**options), callable(getattr(cls, "opening", None)))
    raise ValueError(f"unknown user {kind!r}; valid: 'feedback', 'policy' (the policy plays the user), a table "
                     f"with url (a simulated user), or a user's class as {FORM}")
