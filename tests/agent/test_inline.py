"""Tools called inside the model's message (env `inline`, and `search_r1`, Search-R1's protocol):
each turn cut at an action's end, the tool's result written into the same assistant message
(`Continue`), token-in-token-out; answers in tags or at the message's end."""
from __future__ import annotations

import asyncio
import json

import pytest

from rollwise.agent.envs import load_tasks, make_env
from rollwise.agent.envs.dataset import final_answer
from rollwise.agent.envs.search_r1 import REMINDER
from rollwise.agent.episode import ChatRenderer, run_episode
from rollwise.agent.generator import RecordingGenerator, ScriptedGenerator
from rollwise.engine.tokenizer import Tokenizer
from rollwise.types import SamplingParams

DOCS = [{"id": "1", "title": "Ana Smith", "text": "Ana Smith is a chemist who founded Maple Motors."},
        {"id": "2", "title": "Maple Motors", "text": "Maple Motors is a car maker based in Vintry."},
        {"id": "3", "title": "Ben Smith", "text": "Ben Smith is a pilot."}]
TASK = {"id": "q", "question": "Where is the company Ana Smith founded based?", "golden_answers": ["Vintry"]}


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLWISE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "wiki.jsonl"
    rows = [{"id": d["id"], "contents": f'"{d["title"]}"\n{d["text"]}'} for d in DOCS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"corpus": str(path), "top_k": 1}


def test_final_answer_is_the_last_answer_block_else_the_reply_without_its_reasoning():
    assert final_answer("<think>maybe 3</think> <answer> Paris </answer> x <answer>Lyon</answer>") == "Lyon"
    assert final_answer("<think>it is 3, or 4</think>\n\nIt is 5.") == "It is 5."
    assert final_answer("<think>unfinished 3") == "" and final_answer(" plain 7 ") == "plain 7"
    # the dataset env's rules score it: verl's search_r1 reward reads the tags, its gsm8k one the last number
    async def score(reward, answer, want):
        env = make_env("dataset", reward=reward)
        await env.reset({"id": "t", "prompt": "?", "answer": want})
        return (await env.step(answer))[1]
    assert asyncio.run(score("em", "<think>Lyon?</think><answer> the Paris </answer>", ["Paris"])) == 1.0
    assert asyncio.run(score("em", "<think>no</think> Paris", "Paris")) == 1.0
    assert asyncio.run(score("number", "<think>2 + 2 = 4, then 9</think> 72", 72)) == 1.0
    assert asyncio.run(score("number", "<think>72</think> 71", 72)) == 0.0


def _episode(model_dir, env, script, task=TASK, max_tokens=64):
    tok = Tokenizer(model_dir)
    gen = RecordingGenerator(ScriptedGenerator(tok, lambda req: script[req.turn]))
    traj = asyncio.run(run_episode(gen, env, task, SamplingParams(max_tokens=max_tokens)))
    return tok, gen.calls, traj


def test_search_results_are_written_into_the_models_message_token_in_token_out(model_dir, corpus):
    env = make_env("search_r1", search=corpus, max_turns=4)
    script = ["<think>Who is she?</think>\n<search> Ana Smith </search> and more text",
              "<think>Maple Motors.</think><search>Maple Motors</search>",
              "<answer> Vintry </answer>\nTrailing"]
    tok, calls, traj = _episode(model_dir, env, script)
    assert traj.status == "done" and traj.reward == 1.0 and traj.num_turns == 3
    # each turn stops at the end of its action (the scripted text after it is not generated) ...
    assert all({"</search>", "</answer>"} <= set(req.params.stop) for req, _ in calls)
    outs = [tok.decode(out.token_ids) for _, out in calls]
    assert outs == [script[0][:script[0].index("</search>") + 9], script[1], "<answer> Vintry </answer>"]
    assert tok.eos_token_id not in [t for _, out in calls for t in out.token_ids]  # no end of turn
    # ... and the next turn reads everything so far: its prompt is the trajectory's tokens up to it
    info = [f"\n\n<information>Doc 1(Title: {t}) {d}</information>\n\n"
            for t, d in (("Ana Smith", DOCS[0]["text"]), ("Maple Motors", DOCS[1]["text"]))]
    prompt = ChatRenderer(tok).prompt_ids([{"role": "user", "content": env.instructions.format(
        question=TASK["question"])}], None)
    pieces = [prompt, calls[0][1].token_ids, tok.encode(info[0], add_special_tokens=False), calls[1][1].token_ids,
              tok.encode(info[1], add_special_tokens=False), calls[2][1].token_ids]
    assert traj.token_ids == [t for p in pieces for t in p]
    assert [req.prompt_token_ids for req, _ in calls] == [
        [t for p in pieces[:k] for t in p] for k in (1, 3, 5)]
    assert traj.loss_mask == [m for p, m in zip(pieces, (0, 1, 0, 1, 0, 1)) for _ in p]  # results not trained on
    assert [t.num_observation for t in traj.turns] == [len(pieces[2]), len(pieces[4]), 0]
    # the transcript: one user message and one assistant message, the results inside it
    assert [m["role"] for m in traj.messages] == ["user", "assistant"]
    assert traj.messages[1]["content"] == outs[0] + info[0] + outs[1] + info[1] + outs[2]
    assert traj.env_stats == {"calls": 2.0, "call_errors": 0.0, "answered": 1.0}  # (the step metrics' env_*)


def test_a_turn_cut_off_is_reminded_and_a_message_ended_without_an_answer_scores_zero(model_dir, corpus):
    env = make_env("search_r1", search=corpus, max_turns=4)
    rambling = "let me think " * 40
    tok, calls, traj = _episode(model_dir, env, [rambling, "<answer>Vintry</answer>"], max_tokens=16)
    assert calls[0][1].finish_reason == "length" and traj.reward == 1.0 and traj.status == "done"
    assert traj.env_stats == {"cut_off": 1.0, "answered": 1.0}
    assert traj.messages[1]["content"] == tok.decode(calls[0][1].token_ids) + REMINDER + "<answer>Vintry</answer>"
    # an end-of-turn token without an answer ends the episode, unrewarded, even if it names the answer
    tok, calls, traj = _episode(model_dir, make_env("search_r1", search=corpus), ["It is Vintry."])
    assert traj.status == "done" and traj.reward == 0.0 and traj.num_turns == 1
    # a wrong answer, and a search past max_turns: no reward
    assert _episode(model_dir, make_env("search_r1", search=corpus), ["<answer>Dunmore</answer>"])[2].reward == 0.0
    traj = _episode(model_dir, make_env("search_r1", search=corpus, max_turns=1), ["<search>x</search>"])[2]
    assert traj.status == "max_turns" and traj.reward == 0.0


def test_search_r1s_data_files_and_rewards(model_dir, corpus, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    # Search-R1's processed layout: its prompt (instructions included, no system message), targets
    prompt = [{"role": "user", "content": "Answer ... Question: Where is Maple Motors?"}]
    rows = [{"data_source": "nq", "prompt": prompt,
             "ability": "fact-reasoning", "reward_model": {"style": "rule", "ground_truth": {"target": ["Vintry"]}},
             "extra_info": {"split": "train", "index": 0}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    task = load_tasks(tmp_path / "train.parquet")[0]
    (tmp_path / "r.py").write_text(  # a verl reward file: it gets the whole message, information included
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float('<information>' in solution_str and ground_truth['target'][0] in solution_str)}\n")
    script = ["<search>Maple Motors</search>", "<answer>Vintry</answer>"]
    for reward in ("em", "auto", "f1", f"{tmp_path}/r.py:compute_score"):
        env = make_env("search_r1", search=corpus, reward=reward)
        traj = _episode(model_dir, env, script, task)[2]
        assert traj.reward == 1.0 and traj.messages[0] == rows[0]["prompt"][0], reward
    f1 = make_env("search_r1", search=corpus, reward="f1")
    assert _episode(model_dir, f1, ["<answer>Vintry town</answer>"], task)[2].reward == pytest.approx(2 / 3)
    # a question of ours gets the env's instructions; other instructions must have {question}
    env = make_env("search_r1", search=corpus, instructions="Q: {question} Use <search> and <answer>.")
    want = f"Q: {TASK['question']} Use <search> and <answer>."
    assert asyncio.run(env.reset(TASK)) == [{"role": "user", "content": want}]
    assert env.answer_of(TASK) == ["Vintry"]
    with pytest.raises(ValueError, match="needs search"):
        make_env("search_r1")
    with pytest.raises(ValueError, match="has one tool"):
        make_env("search_r1", search=corpus, tools=["python"])
    with pytest.raises(ValueError, match="must have a \\{question\\} field"):
        make_env("search_r1", search=corpus, instructions="no field")


def test_example_corpus_in_search_r1s_layout_is_solved_by_the_experts_tagged_transcripts(tmp_path, monkeypatch,
                                                                                          model_dir):
    """examples/search_corpus.py --protocol search_r1 (one corpus, searched in process here, through
    `rollwise retrieve` in a run): the expert's transcripts, played token-in-token-out as the warm
    start plays them, answer every question."""
    import subprocess
    import sys
    from pathlib import Path

    from rollwise.rl import TrainConfig, expert_trajectories
    ex = Path(__file__).parents[2] / "examples"
    subprocess.run([sys.executable, str(ex / "search_corpus.py"), str(tmp_path), "--protocol", "search_r1"], check=True,
                   capture_output=True)
    tasks = load_tasks(tmp_path / "train.jsonl") + load_tasks(tmp_path / "eval.jsonl")
    assert len(tasks) == 128 and all(set(t) == {"id", "question", "golden_answers", "solution"} for t in tasks)
    monkeypatch.setenv("ROLLWISE_CACHE", str(tmp_path / "cache"))
    cfg = TrainConfig.from_toml(ex / "train-search-r1.toml", model="unused")
    opts = {**cfg.env_options, "search": {"corpus": str(tmp_path / "corpus.jsonl"), "top_k": 3}}
    assert cfg.env == "search_r1" and cfg.env_options["search"] == {"task_docs": "docs", "top_k": 3}
    demos = asyncio.run(expert_trajectories(Tokenizer(model_dir), lambda: make_env(cfg.env, max_turns=cfg.max_turns,
                                                                                     **opts), tasks))
    assert [t.reward for t in demos] == [1.0] * 128 and all(t.num_turns == 3 for t in demos)
    assert all(t.messages[1]["content"].count("<information>Doc 1(Title: ") == 2 for t in demos)


RETOOL = {"tool": "python", "start": "<code>", "end": "</code>", "result": "<interpreter>{result}</interpreter>"}


def test_inline_code_runs_in_the_sandbox_and_the_message_end_is_scored(model_dir):
    """ReTool's layout (<code> ... </code> -> <interpreter> ... </interpreter>) and ToRL's (a ```python
    block, then ```output): the program runs in the sandbox, its output is written into the message,
    and the message's end scores it (the math rules read its last number / \\boxed{})."""
    env = make_env("inline", actions=[RETOOL], reward="number", instructions="Solve: {question} Answer in \\boxed{}.")
    task = {"id": "m", "question": "What is 6 * 7 + 2 ** 10?", "answer": 1066}
    script = ["Let me compute. <code>\n```python\nprint(6 * 7 + 2 ** 10)\n```\n</code> more",
              " So the answer is \\boxed{1066}."]
    tok, calls, traj = _episode(model_dir, env, script, task)
    assert traj.status == "done" and traj.reward == 1.0 and traj.num_turns == 2
    assert calls[0][0].params.stop == ["</code>"] and tok.decode(calls[0][1].token_ids).endswith("</code>")
    first = script[0][:script[0].index("</code>") + 7]
    assert traj.messages[1]["content"] == (first + "<interpreter>1066</interpreter>"
                                           + script[1])
    assert traj.messages[0] == {"role": "user", "content": f"Solve: {task['question']} Answer in \\boxed{{}}."}
    # a program's error comes back as its result; a wrong final answer scores 0
    traj = _episode(model_dir, env, ["<code>print(1/0)</code>", "It is \\boxed{3}."], task)[2]
    assert "ZeroDivisionError" in traj.messages[1]["content"] and traj.reward == 0.0
    assert traj.env_stats == {"calls": 1.0, "call_errors": 0.0}  # (the program failed, not the tool)
    # ToRL: the model opens the output block itself and the env closes it
    torl = make_env("inline", reward="number", actions=[  # (a result template may hold other braces)
        {"tool": "python", "start": "```python", "end": "```output", "result": "\n{result}\n```\n{}"}])
    text = "```python\nprint(sum(range(5)))\n```\n```output"
    traj = _episode(model_dir, torl, [text, "Hence 10."], {"id": "s", "prompt": "Sum 0..4", "answer": 10})[2]
    assert traj.reward == 1.0 and traj.messages[1]["content"] == text + "\n10\n```\n{}Hence 10."


def test_inline_actions_are_checked(tmp_path, corpus):
    (tmp_path / "tools.py").write_text("def upper(text: str) -> str:\n    return text.upper()\n"
                                       "def two(a: str, b: str) -> str:\n    return a + b\n")
    env = make_env("inline", actions=[{"tool": f"{tmp_path}/tools.py:upper", "start": "<up>", "end": "</up>",
                                       "result": "[{result}]"}], reward="contains")
    async def go():
        await env.reset({"id": "u", "prompt": "shout", "answer": "HI"})
        first = await env.step("x <up> hi </up>")
        env.finish_reason = "length"
        return first, await env.step("</up> stray"), await env.step("then")
    (w1, r1, d1, _), (w2, _, d2, _), (w3, _, _, _) = asyncio.run(go())
    assert w1 == "[HI]" and not d1 and "without <up> before it" in w2 and not d2 and w3 == ""  # cut off: goes on
    bad = [({"actions": []}, "at least one"), ({"actions": [{"tool": "python", "start": "<c>"}]}, "lacks \\['end'\\]"),
           ({"actions": [{**RETOOL, "result": "no field"}]}, "must have a \\{result\\} field"),
           ({"actions": [{**RETOOL, "color": 1}]}, "unknown action keys \\['color'\\]"),
           ({"actions": [RETOOL, RETOOL]}, "must differ"),
           ({"actions": [{"tool": f"{tmp_path}/tools.py:two", "start": "<t>", "end": "</t>"}]}, "takes one text"),
           ({"actions": [{"tool": "search", "start": "<s>", "end": "</s>"}]}, "needs search"),
           ({"actions": [RETOOL], "search": corpus}, "need a search action"),
           ({"actions": [RETOOL], "tools": ["python"]}, "tools are its actions'"),
           ({"actions": [RETOOL], "mcp": {"s": {"command": "x"}}}, "not tools or MCP servers"),
           ({"actions": [{**RETOOL, "tool": "nope"}]}, "unknown tool 'nope'")]
    for options, message in bad:
        with pytest.raises(ValueError, match=message):
            make_env("inline", **options)


def test_a_task_may_bring_its_own_documents(model_dir):
    """search = { task_docs = "docs" }: each task's own pages (dicts, or HotpotQA's [title, sentences]
    pairs), in the search_r1 env and as the dataset env's search tool; examples/task_files.py search_r1 writes
    the search env's questions that way and its expert transcripts answer them all."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path
    hotpot = {"id": "h", "question": "Where is Maple Motors based?", "golden_answers": ["Vintry"],
              "context": [["Maple Motors", ["Maple Motors is a car maker", " based in Vintry."]],
                          ["Ana Smith", ["Ana Smith is a chemist."]]]}
    env = make_env("search_r1", search={"task_docs": "context", "top_k": 1})
    tok, calls, traj = _episode(model_dir, env, ["<search> Maple Motors </search>", "<answer>Vintry</answer>"], hotpot)
    found = "<information>Doc 1(Title: Maple Motors) Maple Motors is a car maker based in Vintry.</information>"
    assert traj.reward == 1.0 and found in traj.messages[1]["content"]
    other = {**hotpot, "context": [["Maple Motors", "Maple Motors is based in Dunmore."]]}  # another task, its own
    traj = _episode(model_dir, env, ["<search>Maple</search>", "<answer>Vintry</answer>"], other)[2]
    assert "based in Dunmore" in traj.messages[1]["content"] and "Vintry." not in traj.messages[1]["content"]
    bare = {"id": "n", "question": "?", "golden_answers": ["x"]}
    no_docs = _episode(model_dir, env, ["<search>Maple</search>"], bare)[2]
    assert no_docs.status == "error" and "has no documents in 'context'" in no_docs.error
    ds = make_env("dataset", reward="em", tools=["search"], search={"task_docs": "context"}, prompt_key="question")
    call = '<tool_call>{"name": "search", "arguments": {"query": "Ana"}}</tool_call>'
    traj = _episode(model_dir, ds, [call, "Vintry"], {**hotpot, "answer": "Vintry"})[2]
    assert traj.reward == 1.0 and "Ana Smith is a chemist." in traj.messages[3]["content"]
    with pytest.raises(ValueError, match="one of corpus .* or task_docs .*; got \\['corpus', 'task_docs'\\]"):
        make_env("search_r1", search={"task_docs": "docs", "corpus": "x.jsonl"})
    with pytest.raises(ValueError, match="unknown search options \\['index'\\] with task_docs; valid: top_k"):
        make_env("search_r1", search={"task_docs": "docs", "index": "x.sqlite"})
    with tempfile.TemporaryDirectory() as d:
        ex = Path(__file__).parents[2] / "examples"
        subprocess.run([sys.executable, str(ex / "task_files.py"), "search_r1", d, "--train", "40", "--eval", "8"],
                       check=True, capture_output=True)
        train, held = load_tasks(Path(d) / "train.jsonl"), load_tasks(Path(d) / "eval.jsonl")
    assert len(train) == 40 and len(held) == 8 and not {t["question"] for t in train} & {t["question"] for t in held}
    env = lambda: make_env("search_r1", search={"task_docs": "docs", "top_k": 3})  # noqa: E731
    from rollwise.rl import expert_trajectories
    demos = asyncio.run(expert_trajectories(Tokenizer(model_dir), env, train + held))
    assert [t.reward for t in demos] == [1.0] * 48 and all(t.num_turns == 3 for t in demos)


def test_example_code_tasks_in_retools_layout_are_solved_by_the_experts_programs(model_dir, tmp_path):
    """examples/task_files.py retool and examples/train-code-inline.toml: the expert's programs run in the
    sandbox inside the message, and their answers score 1; every turn fits the config's max_tokens."""
    import subprocess
    import sys
    from pathlib import Path

    from rollwise.rl import TrainConfig, expert_trajectories
    ex = Path(__file__).parents[2] / "examples"
    subprocess.run([sys.executable, str(ex / "task_files.py"), "retool", str(tmp_path), "--train", "20", "--eval", "5"],
                   check=True, capture_output=True)
    tasks = load_tasks(tmp_path / "train.jsonl") + load_tasks(tmp_path / "eval.jsonl")
    cfg = TrainConfig.from_toml(ex / "train-code-inline.toml", model="unused")
    demos = asyncio.run(expert_trajectories(Tokenizer(model_dir), lambda: make_env(
        cfg.env, max_turns=cfg.max_turns, **cfg.env_options), tasks))
    assert [t.reward for t in demos] == [1.0] * 25 and all(t.num_turns == 2 for t in demos)
    assert all(f"<interpreter>{t.task['answer']}</interpreter>" in t.messages[1]["content"] for t in demos)
    assert max(r.num_generated for t in demos for r in t.turns) <= cfg.max_tokens
    assert len({t.task["question"].split()[1] for t in demos}) > 1  # several of the env's question families
