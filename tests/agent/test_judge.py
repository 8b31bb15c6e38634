"""An LLM judge as the reward (`reward = "judge"`): requests to a real HTTP server on 127.0.0.1,
the grade read from its reply, retries, the bound on requests in flight, and a judge that fails."""
from __future__ import annotations

import asyncio
import re

import pytest

from rollwise.agent.envs import make_env
from rollwise.agent.episode import run_attempts, run_episode
from rollwise.agent.generator import ScriptedGenerator
from rollwise.agent.judge import JudgeConfig, JudgeError, parse_score
from rollwise.engine.tokenizer import Tokenizer
from rollwise.types import SamplingParams
from tests.agent.servers import ChatServer


class JudgeServer(ChatServer):
    """A chat-completions server that grades as a judge model would be asked to: 10 when the
    reference is in the answer, else 2; it fails its first `fail` requests (HTTP 500)."""

    def __init__(self, fail: int = 0, delay: float = 0.0, reply: str | None = None) -> None:
        def grade(body):
            text = body["messages"][0]["content"]
            answer = re.search(r"<answer>\n(.*)\n</answer>", text, re.S).group(1)
            reference = re.search(r"Reference answer: (.*)\n", text).group(1)
            return reply if reply is not None else f"Reasoning.\nSCORE: {10 if reference in answer else 2}"
        super().__init__(grade, "grader", fail, delay)


def _answering(tok, text):
    return ScriptedGenerator(tok, lambda req: text)


TASK = {"id": "q1", "prompt": "What is the capital of France?", "answer": "Paris"}


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_the_judge_grades_each_answer_against_the_reference(model_dir, monkeypatch, api):
    """On chat completions, or Anthropic's Messages API (its key header, a max_tokens always)."""
    tok = Tokenizer(model_dir)
    monkeypatch.setenv("JUDGE_KEY", "sk-judge")
    with JudgeServer() as server:
        opts = {"reward": "judge", "judge": {"url": server.url, "api_key_env": "JUDGE_KEY", "api": api}}

        async def go(text):
            return await run_episode(_answering(tok, text), make_env("dataset", **opts), TASK, SamplingParams())
        right, wrong = asyncio.run(go("It is Paris.")), asyncio.run(go("Lyon, I think."))
    assert right.status == wrong.status == "done" and right.reward == 1.0 and wrong.reward == pytest.approx(0.2)
    key, body = server.requests[0]
    assert key == ("Bearer sk-judge" if api == "chat" else "sk-judge") and body["model"] == "grader"
    assert body["temperature"] == 0.0 and body["max_tokens"] == 512 and "system" not in body
    prompt = body["messages"][0]["content"]
    assert "What is the capital of France?" in prompt and "Reference answer: Paris" in prompt
    assert "<answer>\nIt is Paris.\n</answer>" in prompt and "SCORE: N" in prompt


def test_a_failing_judge_is_retried_then_the_episode_errs_and_is_rerun(model_dir):
    tok = Tokenizer(model_dir)
    with JudgeServer(fail=2) as server:  # two 500s, then grades: within retries = 2
        env = make_env("dataset", reward="judge", judge={"url": server.url, "model": "grader", "backoff_s": 0.01})
        t = asyncio.run(run_episode(_answering(tok, "Paris"), env, TASK, SamplingParams()))
        assert t.status == "done" and t.reward == 1.0 and len(server.requests) == 3
    with JudgeServer(fail=3) as server:  # one more than the judge retries: the episode errs, then reruns
        opts = {"reward": "judge", "judge": {"url": server.url, "model": "grader", "retries": 2, "backoff_s": 0.01}}
        t = asyncio.run(run_episode(_answering(tok, "Paris"), make_env("dataset", **opts), TASK, SamplingParams()))
        assert t.status == "error" and "JudgeError" in t.error and "failed 3 times" in t.error
        server.fail = 3
        t = asyncio.run(run_attempts(_answering(tok, "Paris"), lambda: make_env("dataset", **opts), TASK,
                                     SamplingParams(), retries=1))
        assert t.status == "done" and t.reward == 1.0 and len(t.retried) == 1
    with JudgeServer(reply="I cannot grade this.") as server:  # no score: the judge failed, not the policy
        env = make_env("dataset", reward="judge", judge={"url": server.url, "retries": 0})
        t = asyncio.run(run_episode(_answering(tok, "Paris"), env, TASK, SamplingParams()))
        assert t.status == "error" and "no 'SCORE: N' line" in t.error


def test_requests_in_flight_stay_under_the_judges_bound(model_dir):
    tok = Tokenizer(model_dir)
    with JudgeServer(delay=0.05) as server:
        opts = {"reward": "judge", "judge": {"url": server.url, "model": "grader", "max_concurrency": 3}}

        async def go():
            return await asyncio.gather(*(run_episode(_answering(tok, "Paris"), make_env("dataset", **opts),
                                                      dict(TASK, id=i), SamplingParams()) for i in range(12)))
        trajs = asyncio.run(go())
    assert all(t.reward == 1.0 for t in trajs) and server.max_in_flight == 3


def test_judge_scores_and_options_are_checked():
    assert parse_score("good\nSCORE: 7", 10) == pytest.approx(0.7)
    assert parse_score("SCORE: 3 at first... on reflection\n**SCORE:** 9", 10) == pytest.approx(0.9)
    assert parse_score("SCORE: 12", 10) == 1.0 and parse_score("score: 1", 4) == 0.25
    with pytest.raises(JudgeError):
        parse_score("a fine answer", 10)
    with pytest.raises(ValueError, match="url missing"):
        JudgeConfig.from_dict({"model": "m"})
    with pytest.raises(ValueError, match="unknown.*'temp'"):
        JudgeConfig.from_dict({"url": "http://x/v1", "temp": 0})
    with pytest.raises(ValueError, match="judge api 'gemini': valid are \\['chat', 'messages'\\]"):
        JudgeConfig.from_dict({"url": "http://x/v1", "api": "gemini"})
    with pytest.raises(ValueError, match="structured = true needs api = 'chat'"):
        JudgeConfig.from_dict({"url": "http://x/v1", "api": "messages", "structured": True})
    with pytest.raises(ValueError, match="other than question"):
        JudgeConfig.from_dict({"url": "http://x/v1", "prompt": "{task} {answer}"})
    with pytest.raises(ValueError, match="needs judge"):
        make_env("dataset", reward="judge")
    with pytest.raises(ValueError, match="api_key_env 'NO_SUCH_KEY_VAR' is not set"):
        env = make_env("dataset", reward="judge", judge={"url": "http://127.0.0.1:9/v1", "api_key_env": "NO_SUCH_KEY_VAR"})
        asyncio.run(env.score(TASK, "Paris"))


def test_a_model_on_rollwise_serve_judges_its_reply_held_to_the_format(model_dir):
    """A real judge server: `rollwise serve` on the test model (random weights). Asked with
    `structured = true`, its every reply is a line of reasons and a score line, so it always grades."""
    from rollwise.serve.process import ServerProcess
    tok = Tokenizer(model_dir)
    with ServerProcess(model_dir, "--max-num-seqs", "8") as server:
        opts = {"reward": "judge", "judge": {"url": f"{server.url}/v1", "structured": True, "max_tokens": 48,
                                             "retries": 0}}

        async def go():
            return await asyncio.gather(*(run_episode(_answering(tok, f"It is {city}."), make_env("dataset", **opts),
                                                      dict(TASK, id=city), SamplingParams())
                                          for city in ("Paris", "Lyon", "Nice", "Rome")))
        trajs = asyncio.run(go())
    for t in trajs:
        assert t.status == "done", t.error
        assert 0.0 <= t.reward <= 1.0 and round(t.reward * 10, 6).is_integer()
