"""The airline env (tau-bench's kind of task): tools that write a per-episode database, and a reward
that compares the database at the end with the one the gold actions leave."""
from __future__ import annotations

import asyncio

import pytest

from rollwise.agent.envs import make_env
from rollwise.agent.envs.airline_db import build_db, state


def _run(task, replies: list[str], env=None) -> tuple[float | None, list[str]]:
    """The episode's reward (None: not ended) and the tool results it saw."""
    async def go():
        e = env or make_env("airline")
        await e.reset(task)
        seen = []
        try:
            for m in replies:
                obs, reward, done, _ = await e.step(m)
                seen.append(obs if isinstance(obs, str) else "\n".join(m["content"] for m in obs))
                if done:
                    return reward, seen
            return None, seen
        finally:
            await e.close()
    return asyncio.run(go())


def _by_kind(tasks, kind, allowed):
    return next(t for t in tasks if t["kind"] == kind and bool(t["gold"]) == allowed)


def test_the_expert_solves_every_kind_and_doing_nothing_solves_only_refusals():
    env = make_env("airline")
    tasks = env.sample_tasks(60, seed=3)
    assert {(t["kind"], bool(t["gold"])) for t in tasks} >= {
        ("book", True), ("book", False), ("cancel", True), ("cancel", False), ("change", True), ("change", False),
        ("credit", False)}
    before = {t["id"]: state(build_db(t)) for t in tasks}
    for t in tasks:
        assert _run(t, env.expert(t))[0] == 1.0, t
        nothing = _run(t, ["Sorry, I cannot help with that."])[0]
        assert nothing == (1.0 if not t["gold"] and t["kind"] != "credit" else 0.0), t
    assert {t["id"]: state(build_db(t)) for t in tasks} == before  # episodes wrote to copies only


def test_a_write_against_the_policy_or_a_second_write_scores_zero():
    env = make_env("airline")
    tasks = env.sample_tasks(80, seed=4)
    refused = _by_kind(tasks, "cancel", False)  # basic economy, or a departed flight
    rid = refused["expert"][1][1]["reservation_id"]
    reward, seen = _run(refused, [env.call_text("cancel_reservation", reservation_id=rid), "Done."])
    assert '"refunded"' in seen[0] and reward == 0.0  # the tool let it through; the policy did not
    book = _by_kind(tasks, "book", True)
    twice = env.expert(book)[:-1] + [env.call_text("book_reservation", **book["gold"][0][1]), book["reply"]]
    reward, seen = _run(book, twice)
    if "error" not in seen[-2]:  # (the seats or the credit may not allow a second one)
        assert reward == 0.0
    credit = _by_kind(tasks, "credit", False)
    assert _run(credit, env.expert(credit)[:-1] + [f"You have {credit['answer'] + 10} left."])[0] == 0.0
    said = f"As of 2024-05-15 you have ${credit['answer']:,}.00."
    assert _run(credit, env.expert(credit)[:-1] + [said])[0] == 1.0  # the number anywhere, however written


def test_tool_errors_come_back_to_the_model_and_episodes_do_not_share_a_database():
    env = make_env("airline")
    task = _by_kind(env.sample_tasks(40, seed=5), "book", True)
    args = task["gold"][0][1]
    _, seen = _run(task, [env.call_text("get_user", user_id="nobody"),
                          env.call_text("book_reservation", **{**args, "cabin": "first"}),
                          env.call_text("book_reservation", **{**args, "passengers": 9}),
                          env.call_text("book_reservation", **{**args, "flight": "HAT000"})])
    assert "user 'nobody' not found" in seen[0]
    assert "cabin must be one of ['basic_economy', 'economy', 'business']" in seen[1]
    assert "passengers must be 1 to 5" in seen[2] and "not found" in seen[3]

    async def two_at_once():  # the same task in two episodes: each books on its own copy
        a, b = make_env("airline"), make_env("airline")
        await a.reset(task)
        await b.reset(task)
        call = env.call_text("book_reservation", **args)
        await a.step(call)
        second = await b.step(call)
        paths = [a.db, b.db]
        assert paths[0] != paths[1] and state(paths[0]) == state(paths[1]) != state(build_db(task))
        await a.close()
        await b.close()
        return second, paths
    second, paths = asyncio.run(two_at_once())
    assert "error" not in str(second[0]) and not any(p.exists() for p in paths)  # and the copies went at close


def test_gold_states_are_kept_for_recent_tasks_only(monkeypatch):
    from rollwise.agent.envs import airline
    monkeypatch.setattr(airline, "GOLD_KEPT", 2)
    monkeypatch.setattr(airline, "_GOLD", airline.OrderedDict())
    tasks = make_env("airline").sample_tasks(3, seed=6)
    first = [airline.gold_state(t) for t in tasks]
    assert list(airline._GOLD) == [t["id"] for t in tasks[1:]]
    assert [airline.gold_state(t) for t in tasks] == first  # recomputed alike


def test_a_simulated_customer_who_opens_plays_the_tasks_instruction(model_dir):
    """tau-bench's set-up: a chat-completions server plays the customer from the task's `instruction`
    and speaks first; the agent's tools write the database, and the episode scores it once the
    customer ends the conversation."""
    from rollwise.agent.episode import run_episode
    from rollwise.agent.generator import ScriptedGenerator
    from rollwise.engine.tokenizer import Tokenizer
    from rollwise.types import SamplingParams
    from tests.agent.servers import ChatServer

    env = make_env("airline")
    task = _by_kind(env.sample_tasks(60, seed=7), "cancel", True)
    agent = iter(env.expert(task))  # the calls, then the reply (each a turn of the model)
    lines = [task["request"]]
    with ChatServer(lambda body: lines.pop(0) if lines else "###STOP###", "customer") as server:
        episode_env = make_env("airline", user={"url": server.url, "opens": True})
        t = asyncio.run(run_episode(ScriptedGenerator(Tokenizer(model_dir), lambda request: next(agent)),
                                    episode_env, task, SamplingParams(max_tokens=64)))
    assert t.status == "done" and t.reward == 1.0, (t.status, t.error, t.messages)
    system = server.requests[0][1]["messages"][0]["content"]
    assert task["instruction"] in system  # the customer's goal, which the agent never sees
    assert all(task["instruction"] not in m["content"] for m in t.messages)
    assert t.messages[1] == {"role": "user", "content": task["request"]}  # the customer's opening line


def test_a_rebooking_is_both_writes_or_neither_and_the_refund_pays_for_the_new_flight():
    """kinds = ["rebook"]: cancel a reservation and book another flight with its refund, or change
    nothing. The expert's cancel-then-book scores 1; either write alone scores 0; where the credit
    covers the fare only with the refund, booking before cancelling fails in the tool."""
    import sqlite3
    with pytest.raises(ValueError, match="kinds must be a non-empty list of .*'rebook'"):
        make_env("airline", kinds=["upgrade"])
    env = make_env("airline", kinds=["rebook"])
    tasks = env.sample_tasks(120, seed=8)
    assert {t["kind"] for t in tasks} == {"rebook"} and 0 < sum(bool(t["gold"]) for t in tasks) < len(tasks)
    needs_refund = []
    for t in tasks:
        assert _run(t, env.expert(t))[0] == 1.0, t
        assert _run(t, ["Sorry, I cannot help with that."])[0] == float(not t["gold"]), t
        if t["gold"]:
            cancel, book = t["gold"]
            assert [cancel[0], book[0]] == ["cancel_reservation", "book_reservation"]
            assert _run(t, [env.call_text(cancel[0], **cancel[1]), "Done."])[0] == 0.0  # half of it
            con = sqlite3.connect(build_db(t))
            credit = con.execute("SELECT credit FROM users WHERE id = ?", (book[1]["user_id"],)).fetchone()[0]
            fare = con.execute(f"SELECT price_{book[1]['cabin']} FROM flights WHERE number = ? AND date = ?",
                               (book[1]["flight"], book[1]["date"])).fetchone()[0]
            con.close()
            if fare * book[1]["passengers"] > credit:
                needs_refund.append(t)
    assert needs_refund
    t = needs_refund[0]
    cancel, book = t["gold"]
    reward, seen = _run(t, [env.call_text(book[0], **book[1]), env.call_text(cancel[0], **cancel[1]),
                            env.call_text(book[0], **book[1]), "Done: cancelled and booked."])
    assert "does not cover" in seen[0] and '"refunded"' in seen[1] and '"paid"' in seen[2] and reward == 1.0


def test_with_confirm_a_write_before_the_customers_yes_scores_zero(model_dir):
    """`confirm = true`: tau-bench's rule that a write waits for the customer's explicit yes, with a
    scripted customer (yes to a question, the end at any other reply). The expert asks before it
    writes and solves every kind; the same writes unasked leave the right database and score 0;
    the warm start's transcripts hold the question and the yes."""
    from rollwise.agent.envs.airline import ConfirmingCustomer
    from rollwise.engine.tokenizer import Tokenizer
    from rollwise.rl import expert_trajectories
    with pytest.raises(ValueError, match="confirm must be true or false"):
        make_env("airline", confirm="yes")
    assert type(make_env("airline", confirm=True)._new_user()) is ConfirmingCustomer
    assert type(make_env("airline", confirm=True, user="feedback")._new_user()).__name__ == "FeedbackUser"  # kept
    env = make_env("airline", confirm=True, kinds=["book", "cancel", "change", "credit", "rebook"])
    plain = make_env("airline", kinds=["book", "cancel", "change", "credit", "rebook"])
    tasks = env.sample_tasks(60, seed=9)
    assert {t["kind"] for t in tasks if t["gold"]} == {"book", "cancel", "change", "rebook"}
    for t in tasks:
        assert _run(t, env.expert(t), make_env("airline", confirm=True))[0] == 1.0, t
        unasked = _run(t, plain.expert(t), make_env("airline", confirm=True))[0]
        assert unasked == (0.0 if t["gold"] else 1.0), t  # (refusals and credit questions need no yes)
    t = next(t for t in tasks if t["kind"] == "rebook" and t["gold"])
    reward, seen = _run(t, env.expert(t), make_env("airline", confirm=True))
    asked = env.expert(t).index(next(m for m in env.expert(t) if m.endswith("Shall I go ahead?")))
    assert seen[asked] == ConfirmingCustomer.YES and reward == 1.0  # the customer's answer, then both writes
    demos = asyncio.run(expert_trajectories(Tokenizer(model_dir), lambda: make_env("airline", confirm=True), [t]))
    said = [m["content"] for m in demos[0].messages if m["role"] == "user"]
    assert demos[0].reward == 1.0 and said[-1] == ConfirmingCustomer.YES and "Ask me before" in said[0]
