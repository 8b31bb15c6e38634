"""Users an agent talks to (`user` in env_options, rollwise.agent.users): another attempt after
feedback, a simulated user behind a chat-completions server (a stand-in that checks what it is
sent, and `rollwise serve` with a real model), a user's own class, and a short training run."""
from __future__ import annotations

import asyncio
import json

import pytest

from rollwise.agent.envs import make_env
from rollwise.agent.episode import run_attempts, run_episode
from rollwise.agent.generator import ScriptedGenerator
from rollwise.agent.users import UserReply, user_factory
from rollwise.engine.tokenizer import Tokenizer
from rollwise.rl import TrainConfig, train
from rollwise.serve.process import ServerProcess
from rollwise.types import SamplingParams
from tests.agent.servers import ChatServer

USER_HEADER = "<|im_start|>user"  # (the test model's chat template: Qwen3's)
TASK = {"id": "q1", "prompt": "What is the capital of France?", "answer": "Paris"}
BOOKING = {"id": "b1", "prompt": "I need to change my flight.", "answer": "HAT-170",
           "instruction": "You are Mia Li. Move reservation HAT-170 to May 20; your user id is mia_li_3668."}


def lookup(code: str) -> str:
    """Look up a reservation by its code."""
    return json.dumps({"code": code, "date": "2024-05-18"})


def replies(tok, *texts):
    """The model's turns, in order (the last one again if asked for more); the requests are kept."""
    seen = []

    def policy(request):
        seen.append(tok.decode(request.prompt_token_ids, skip_special_tokens=False))
        return texts[min(len(seen), len(texts)) - 1]
    gen = ScriptedGenerator(tok, policy)
    gen.seen = seen
    return gen


def episode(gen, env, task=TASK):
    return asyncio.run(run_episode(gen, env, task, SamplingParams(max_tokens=64)))


def test_feedback_gives_another_attempt_and_discounts_the_later_ones(model_dir):
    tok = Tokenizer(model_dir)
    user = {"kind": "feedback", "max_attempts": 3, "discount": 0.5}
    gen = replies(tok, "Lyon", "Paris")
    t = episode(gen, make_env("dataset", user=user))
    assert t.status == "done" and len(t.turns) == 2 and t.reward == 0.5  # right at the second attempt
    assert "That is not right" in gen.seen[1] and "(attempts left: 2)" in gen.seen[1]
    assert t.env_stats == {"user_replies": 1.0}
    t = episode(replies(tok, "Paris"), make_env("dataset", user=user))
    assert len(t.turns) == 1 and t.reward == 1.0  # right at once: no feedback
    t = episode(replies(tok, "Lyon", "Nice", "Lille", "Paris"), make_env("dataset", user=user))
    assert len(t.turns) == 3 and t.reward == 0.0 and t.env_stats == {"user_replies": 2.0}  # out of attempts
    finish = '<tool_call>\n{"name": "finish", "arguments": {"answer": "Lyon"}}\n</tool_call>'
    t = episode(replies(tok, finish, "Paris"), make_env("dataset", user="feedback"))
    assert t.reward == 1.0 and len(t.turns) == 2  # discount 1 by default; `finish` answers as a reply does
    t = episode(replies(tok, "Lyon", "Paris"), make_env("dataset"))
    assert len(t.turns) == 1 and t.reward == 0.0  # no user: the first reply is the answer


def test_feedback_with_details_tells_the_failing_tests_output(model_dir):
    """RLEF's execution feedback: with details, a wrong program's failing run (its assert's traceback)
    follows the message; the next program passes the tests."""
    tok = Tokenizer(model_dir)
    task = {"id": "c1", "prompt": "Write add(a, b).", "tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0"}
    wrong = "```python\ndef add(a, b):\n    return a * b + 1\n```"
    right = "```python\ndef add(a, b):\n    return a + b\n```"
    user = {"kind": "feedback", "details": True, "discount": 0.5}
    gen = replies(tok, wrong, right)
    t = episode(gen, make_env("dataset", reward="unit_tests", user=user), task)
    assert t.status == "done" and t.reward == 0.5 and len(t.turns) == 2
    told = t.messages[-2]["content"]
    assert t.messages[-2]["role"] == "user" and told.startswith("That is not right.")
    assert "The tests failed:" in told and "AssertionError" in told and "tests passed" not in told
    t = episode(replies(tok, wrong, right), make_env("dataset", reward="unit_tests", user="feedback"), task)
    assert "AssertionError" not in t.messages[-2]["content"]  # details are asked for
    t = episode(replies(tok, "Lyon", "Paris"), make_env("dataset", user=user))
    assert t.reward == 0.5 and t.messages[-2]["content"].endswith("(attempts left: 2).")  # an env with nothing to say


class UserServer(ChatServer):
    """A chat-completions server playing the user: its lines in order, then the stop marker; it
    fails its first `fail` requests (HTTP 500)."""

    def __init__(self, lines: list[str], fail: int = 0) -> None:
        lines = list(lines)
        super().__init__(lambda body: lines.pop(0) if lines else "###STOP###", "user-sim", fail)


def test_a_simulated_user_reads_the_dialogue_turned_round_and_ends_it(model_dir):
    tok = Tokenizer(model_dir)
    call = '<tool_call>\n{"name": "lookup", "arguments": {"code": "HAT-170"}}\n</tool_call>'
    gen = replies(tok, "Which reservation?", call, "It is moved: HAT-170.")
    with UserServer(["It is HAT-170, to May 20 please."]) as server:
        env = make_env("dataset", reward="contains", tools=["tests.agent.test_users:lookup"],
                       user={"url": server.url, "temperature": 0.0})
        t = episode(gen, env, BOOKING)
    assert t.status == "done" and t.reward == 1.0 and len(t.turns) == 3
    assert "It is HAT-170, to May 20 please." in gen.seen[1]  # the user's line is the model's next message
    (_, first), (_, second) = server.requests
    assert first["model"] == "user-sim" and first["temperature"] == 0.0
    system, *turned = first["messages"]
    assert system["role"] == "system" and BOOKING["instruction"] in system["content"]
    assert "###STOP###" in system["content"]
    # the agent's greeting, the user's first message (the task's prompt, with the env's hint), the agent's question
    assert [m["role"] for m in turned] == ["user", "assistant", "user"]
    assert turned[0]["content"] == "Hi! How can I help you today?"
    assert turned[1]["content"].startswith(BOOKING["prompt"]) and turned[2]["content"] == "Which reservation?"
    # the user never sees the tool call or its result, only what the two sides said to each other
    assert [m["content"] for m in second["messages"][-2:]] == ["It is HAT-170, to May 20 please.",
                                                              "It is moved: HAT-170."]
    assert not any("lookup" in m["content"] or "2024-05-18" in m["content"] for m in second["messages"])


def test_a_simulated_user_who_speaks_first(model_dir):
    """opens = true (tau-bench's): the simulator writes the first user message; the env's own first
    message joins the system message as instructions, and a task needs only the user's instruction."""
    tok = Tokenizer(model_dir)
    task = {"id": "b2", "instruction": BOOKING["instruction"], "answer": "HAT-170"}
    gen = replies(tok, "Moved: HAT-170.")
    with UserServer(["Hi, I need to move my flight HAT-170."]) as server:
        env = make_env("dataset", reward="contains", user={"url": server.url, "opens": True},
                       system_prompt="You are an airline agent.")
        t = episode(gen, env, task)
    assert t.status == "done" and t.reward == 1.0 and len(t.turns) == 1 and len(server.requests) == 2
    (_, opening), (_, after) = server.requests
    assert [m["role"] for m in opening["messages"]] == ["system", "user"]  # the greeting alone
    assert [m["content"] for m in after["messages"][1:]] == ["Hi! How can I help you today?",
                                                            "Hi, I need to move my flight HAT-170.", "Moved: HAT-170."]
    assert t.messages[0]["role"] == "system" and t.messages[0]["content"].startswith("You are an airline agent.")
    assert env.answer_hint in t.messages[0]["content"]  # the env's own first message: now instructions
    assert t.messages[1] == {"role": "user", "content": "Hi, I need to move my flight HAT-170."}
    assert gen.seen[0].count(USER_HEADER) == 1
    with pytest.raises(ValueError, match="has no 'prompt'"):  # without opens a task still needs its prompt
        asyncio.run(make_env("dataset", user={"url": "http://127.0.0.1:9/v1"}).reset(task))


def test_a_failing_simulator_is_retried_then_the_episode_errs_and_is_rerun(model_dir):
    tok = Tokenizer(model_dir)
    user = {"url": None, "retries": 1, "backoff_s": 0.01}
    with UserServer(["May 20, please."], fail=1) as server:  # one failure: retried, the episode goes on
        t = episode(replies(tok, "Which day?", "Done: HAT-170."),
                    make_env("dataset", reward="contains", user={**user, "url": server.url}), BOOKING)
        assert t.status == "done" and t.reward == 1.0 and len(server.requests) == 3
    with UserServer([], fail=2) as server:  # both tries fail: the episode errs, then runs again and ends
        env = lambda: make_env("dataset", reward="contains", user={**user, "url": server.url})  # noqa: E731
        t = asyncio.run(run_attempts(replies(tok, "Which day?"), env, BOOKING, SamplingParams(max_tokens=16),
                                     retries=1))
        assert t.status == "done" and t.reward == 0.0 and len(t.retried) == 1 and len(server.requests) == 3
        assert "ServiceError" in t.retried[0] and "simulated user at" in t.retried[0]
    with UserServer(["?"] * 10) as server:  # a task without the user's instruction
        t = episode(replies(tok, "Hello."), make_env("dataset", user={"url": server.url}), TASK)
        assert t.status == "error" and "has no 'instruction'" in t.error


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_model_served_by_rollwise_plays_the_user(model_dir, api):
    """The request is one a real server takes: system prompt, alternating turns; the model's lines
    (at temperature 0) come back as the user's messages until max_replies. On chat completions or
    Anthropic's Messages API (`api = "messages"`: the system prompt its own field, x-api-key)."""
    tok = Tokenizer(model_dir)
    gen = replies(tok, "Which reservation?", "Anything else?", "Done.")
    with ServerProcess(model_dir, "--api-key", "sk-user") as server:
        env = make_env("dataset", reward="contains",
                       user={"url": server.url + "/v1", "temperature": 0.0, "max_tokens": 12, "max_replies": 2,
                             "api": api, "api_key": "sk-user"})
        t = episode(gen, env, BOOKING)
    assert t.status == "done" and len(t.turns) == 3 and t.env_stats == {"user_replies": 2.0}
    # each of the model's later turns reads one more user message than the one before
    users = [p.count(USER_HEADER) for p in gen.seen]
    assert users == [1, 2, 3] and gen.seen[2].startswith(gen.seen[1])


class Quizmaster:
    """A user's class: the hint it was given after the first wrong answer, then its own reward."""

    def __init__(self, hint: str) -> None:
        self.hint, self.asked = hint, 0

    async def reply(self, task, dialogue, score):
        self.asked += 1
        right = await score(dialogue[-1]["content"])
        if right or self.asked > 1:
            return UserReply(reward=0.25 + 0.75 * right)
        return UserReply(self.hint)


def test_a_users_own_class_and_the_options_are_checked(model_dir):
    tok = Tokenizer(model_dir)
    user = {"kind": "tests.agent.test_users:Quizmaster", "hint": "It is on the Seine."}
    gen = replies(tok, "Lyon", "Paris")
    t = episode(gen, make_env("dataset", user=user))
    assert t.reward == 1.0 and len(t.turns) == 2 and "It is on the Seine." in gen.seen[1]
    t = episode(replies(tok, "Lyon", "Nice"), make_env("dataset", user=user))
    assert t.reward == 0.25
    with pytest.raises(ValueError, match="unknown user 'helpful'; valid: 'feedback'"):
        make_env("dataset", user="helpful")
    with pytest.raises(ValueError, match=r"unknown options \['attempts'\]; valid: \['details', 'discount'"):
        make_env("dataset", user={"kind": "feedback", "attempts": 2})
    with pytest.raises(ValueError, match="0 < discount <= 1"):
        make_env("dataset", user={"kind": "feedback", "discount": 0.0})
    with pytest.raises(ValueError, match="other than attempt, left, max_attempts"):
        make_env("dataset", user={"kind": "feedback", "message": "{tries} left"})
    with pytest.raises(ValueError, match="needs url"):
        make_env("dataset", user={"kind": "simulated"})
    with pytest.raises(ValueError, match="unknown options .'tempreature'."):
        make_env("dataset", user={"url": "http://127.0.0.1:9/v1", "tempreature": 0})
    with pytest.raises(ValueError, match="other than instruction, stop"):
        make_env("dataset", user={"url": "http://127.0.0.1:9/v1", "prompt": "{goal}"})
    with pytest.raises(ValueError, match="api_key_env 'NO_SUCH_KEY_VAR' is not set"):
        make_env("dataset", user={"url": "http://127.0.0.1:9/v1", "api_key_env": "NO_SUCH_KEY_VAR"})
    with pytest.raises(ValueError, match="no user"):
        make_env("inline", actions=[{"tool": "python", "start": "<code>", "end": "</code>",
                                     "result": "{result}"}], user="feedback")
    with pytest.raises(ValueError, match="a name or a table"):
        user_factory(3)
    for name in ("phonebook", "calculator", "sql"):  # every tool env takes a user
        assert make_env(name, user="feedback")._new_user is not None


def test_training_with_feedback(model_dir, tmp_path):
    """GRPO steps whose episodes get another attempt: the feedback is an observation (not trained)."""
    cfg = TrainConfig.from_dict({"model": model_dir, "run_dir": str(tmp_path / "run"), "env": "calculator",
                                 "env_options": {"user": {"kind": "feedback", "max_attempts": 2}},
                                 "sft_steps": 2, "sft_tasks": 8, "steps": 2, "groups_per_step": 2, "group_size": 2,
                                 "max_tokens": 12, "max_turns": 3, "eval_tasks": 2, "progress": False,
                                 "episode_deadline_s": 60.0})
    report = train(cfg)
    assert len(report["steps"]) == 2
    groups = [json.loads(line) for line in (tmp_path / "run" / "groups.jsonl").read_text().splitlines()]
    episodes = [t for g in groups for t in g["trajectories"]]
    assert len(episodes) == 8 and all(t["status"] in ("done", "max_turns", "max_context") for t in episodes)
    assert any(t["env_stats"].get("user_replies") for t in episodes)  # (the warm start is weak: some are wrong)


def test_the_warm_start_is_the_experts_alone(model_dir, tmp_path):
    """The expert's transcripts have no user in them (the expert solves the task): a simulator
    nobody serves is never asked, and the warm start is cached under the same key as without a user."""
    from rollwise.rl import _sft_cache_path
    base = {"model": model_dir, "env": "calculator", "sft_steps": 2, "sft_tasks": 8, "steps": 0, "eval_tasks": 0,
            "progress": False, "sft_cache": str(tmp_path / "cache")}
    user = {"user": {"url": "http://127.0.0.1:9/v1", "retries": 0}}
    cfg = TrainConfig.from_dict({**base, "run_dir": str(tmp_path / "run"), "env_options": user})
    report = train(cfg)
    assert report["sft"]["expert_success"] == 1.0
    assert _sft_cache_path(cfg) == _sft_cache_path(TrainConfig.from_dict({**base, "run_dir": str(tmp_path / "b")}))
    assert _sft_cache_path(cfg).exists()


@pytest.mark.parametrize("opens", [False, True])
def test_the_policy_plays_the_user(model_dir, opens):
    """Self-play: `kind = "policy"` has the episode's own generator (a real engine here) write the
    user's lines from the simulator's prompt, with the roles turned round; they are the agent's
    next messages, observations (not trained), until max_replies; seeded from the run's seed, so
    the same episode run again says the same."""
    from rollwise.agent.generator import RecordingGenerator
    from rollwise.engine.async_engine import AsyncEngine
    tok = Tokenizer(model_dir)
    engine = AsyncEngine(model_dir, max_num_seqs=4)
    try:
        runs = []
        for _ in range(2):
            gen = RecordingGenerator(engine)
            user = {"kind": "policy", "max_tokens": 6, "max_replies": 2, "temperature": 1.0, "opens": opens}
            t = asyncio.run(run_episode(gen, make_env("dataset", reward="contains", user=user), BOOKING,
                                        SamplingParams(max_tokens=6, seed=1)))
            runs.append([o.token_ids for _, o in gen.calls])
    finally:
        engine.shutdown()
    assert runs[0] == runs[1]
    assert t.status == "done", t.error
    prompts = [tok.decode(r.prompt_token_ids, skip_special_tokens=False) for r, _ in gen.calls]
    said = [tok.decode(o.token_ids) for _, o in gen.calls]
    users = [i for i, p in enumerate(prompts) if BOOKING["instruction"] in p]  # the simulator's requests
    agents = [i for i in range(len(prompts)) if i not in users]
    replied = int(t.env_stats.get("user_replies", 0))
    assert len(agents) == len(t.turns) == replied + 1 and replied >= 1
    assert replied + opens <= len(users) <= replied + opens + 1  # (+1: a last line that ended it)
    if opens:
        assert users[0] == 0 and "Hi! How can I help you today?" in prompts[0]
    for u in users:  # each user line is the agent's next user message, as it was written
        line = said[u].strip()
        later = [a for a in agents if a > u]
        if line and later:
            assert f"{USER_HEADER}\n{line}" in prompts[later[0]]
    loss = sum(t.loss_mask)
    assert loss == sum(len(o.token_ids) for i, (_, o) in enumerate(gen.calls) if i in agents)  # the agent's only


def test_a_user_the_policy_plays_is_checked():
    with pytest.raises(ValueError, match=r"user 'policy' is played by the run's own generator: \['url'\]"):
        make_env("dataset", user={"kind": "policy", "url": "http://127.0.0.1:9/v1"})
    with pytest.raises(ValueError, match="valid: 'feedback', 'policy'"):
        make_env("dataset", user={"kind": "parrot"})
    env = make_env("dataset", user={"kind": "policy", "opens": True})
    with pytest.raises(ValueError, match="needs the episode's generator"):
        asyncio.run(env.reset(BOOKING))
