"""SFT transcripts from a file (rollwise/trainer/sft_data.py): a teacher's conversations tokenized as
the episode loop tokenizes an episode, trained on the assistant's tokens alone."""
from __future__ import annotations

import asyncio
import json

import pytest

from rollwise.agent.envs.calculator import CalculatorEnv
from rollwise.engine.tokenizer import Tokenizer
from rollwise.rl import expert_trajectories
from rollwise.trainer.sft_data import transcripts


def _expert(model_dir: str, n: int) -> tuple[list, list[dict]]:
    """The calculator expert's episodes (tool calls, tool results) and their tools' schemas."""
    tasks = CalculatorEnv().sample_tasks(n, seed=4)
    trajs = asyncio.run(expert_trajectories(Tokenizer(model_dir), CalculatorEnv, tasks))
    env = CalculatorEnv()
    asyncio.run(env.reset(tasks[0]))
    return trajs, [t.schema for t in env.tools]


def test_a_conversation_file_gives_the_episodes_tokens(model_dir, tmp_path):
    """The expert's episodes written as chat messages (with their tools) come back as the same token
    ids and loss masks the episode loop built: the warm start sees the rollouts' layout."""
    trajs, tools = _expert(model_dir, 3)
    assert all(t.num_turns >= 2 for t in trajs)  # (a tool call, its result, the answer)
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"id": t.trajectory_id, "messages": t.messages, "tools": tools}) + "\n"
                            for t in trajs))
    got = transcripts(str(path), Tokenizer(model_dir))
    assert len(got) == len(trajs) == 3
    for t, g in zip(trajs, got):
        assert g.token_ids == t.token_ids and g.loss_mask == t.loss_mask and sum(g.loss_mask) > 0
    short = transcripts(str(path), Tokenizer(model_dir), max_tokens=len(trajs[0].token_ids) - 5)
    assert short[0].token_ids == trajs[0].token_ids[:-5] and short[0].loss_mask == trajs[0].loss_mask[:-5]


def test_tool_calls_prompt_response_pairs_and_bad_records(model_dir, tmp_path):
    tok = Tokenizer(model_dir)
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    records = [
        {"id": "calls", "messages": [{"role": "user", "content": "1 + 2?"},
                                     {"role": "assistant", "content": "", "tool_calls": [call]},
                                     {"role": "tool", "tool_call_id": "c1", "content": "3"},
                                     {"role": "assistant", "content": "3"},
                                     {"role": "user", "content": "thanks"}]},  # (after the last reply: dropped)
        {"id": "pair", "prompt": "Say hi.", "response": "hi"},
    ]
    path = tmp_path / "sft.json"
    path.write_text(json.dumps(records))
    calls, pair = transcripts(str(path), tok)
    generated = [tok.decode([i for i, m in zip(calls.token_ids, calls.loss_mask) if m], skip_special_tokens=False)]
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in generated[0]
    assert "3" in generated[0] and "thanks" not in tok.decode(calls.token_ids, skip_special_tokens=False)
    assert tok.decode(calls.token_ids, skip_special_tokens=False).count("<tool_response>") == 1  # (not trained)
    assert calls.token_ids[-1] == tok.eos_token_id and calls.loss_mask[-1] == 1
    assert tok.decode([i for i, m in zip(pair.token_ids, pair.loss_mask) if m]) == "hi"
    assert "Say hi." in tok.decode(pair.token_ids)
    parts = lambda *xs: [{"type": "text", "text": x} for x in xs]  # noqa: E731  (OpenAI's content parts)
    path.write_text(json.dumps([{"id": "parts", "messages": [{"role": "user", "content": parts("1 + ", "2?")},
                                                             {"role": "assistant", "content": parts("3")}]},
                                {"id": "plain", "messages": [{"role": "user", "content": "1 + \n2?"},
                                                             {"role": "assistant", "content": "3"}]}]))
    joined, plain = transcripts(str(path), tok)
    assert joined.token_ids == plain.token_ids and joined.loss_mask == plain.loss_mask
    broken = dict(call, function={"name": "add", "arguments": "{a: 1"})
    for bad, message in (({"id": "x", "text": "hi"}, "has no 'messages', 'turns' or 'prompt' \\+ 'response'"),
                         ({"id": "y", "messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
                         ({"id": "z", "messages": [{"role": "user", "content": "hi"},
                                                   {"role": "assistant", "tool_calls": [broken]}]},
                          "tool call 'add': its arguments are not JSON"),
                         ({"id": "w", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
                                                   {"role": "assistant", "content": "a cat"}]},
                          "record 'w': a user message's content is neither text nor a list of text parts")):
        path.write_text(json.dumps([bad]))
        with pytest.raises(ValueError, match=message):
            transcripts(str(path), tok)


def test_a_run_warm_starts_on_a_file(model_dir, tmp_path, monkeypatch):
    """`sft_file`: `rollwise train` warm-starts on the file's conversations, then trains."""
    from rollwise.rl import train
    from rollwise.rl_config import TrainConfig
    trajs, tools = _expert(model_dir, 4)
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"messages": t.messages, "tools": tools}) + "\n" for t in trajs))
    report = train(TrainConfig.from_dict(dict(
        model=model_dir, run_dir=str(tmp_path / "run"), env="calculator", sft_file=str(path), sft_steps=3,
        sft_batch=2, steps=1, groups_per_step=2, group_size=2, max_tokens=12, max_turns=2, eval_tasks=0,
        progress=False)))
    assert report["sft"]["examples"] == 4 and report["sft"]["steps"] == 3 and report["sft"]["loss_first"] > 0
    assert report["sft"]["source"] == str(path)
    assert report["policy_version"] == 1


def test_steps_0_on_a_file_is_the_warm_start_alone(model_dir, tmp_path):
    """An env with no tasks of its own (the dataset env, no task file): `steps = 0` with `sft_file`
    trains the warm start alone and saves it; without the file, the run still asks for tasks."""
    from safetensors.torch import load_file

    from rollwise.rl import train
    from rollwise.rl_config import TrainConfig
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i} + {i}?", "response": str(2 * i)}) + "\n" for i in range(6)))
    base = dict(model=model_dir, env="dataset", sft_steps=3, sft_batch=2, steps=0, progress=False)
    report = train(TrainConfig.from_dict(dict(base, run_dir=str(tmp_path / "run"), sft_file=str(path))))
    assert report["sft"]["examples"] == 6 and report["policy_version"] == 0 and report["steps"] == []
    saved = load_file(str(tmp_path / "run" / "final-model" / "model.safetensors"))
    start = load_file(f"{model_dir}/model.safetensors")
    assert max(float((saved[k] - start[k]).abs().max()) for k in start) > 0  # (the warm start's weights)
    with pytest.raises(ValueError, match="set train_tasks_file"):
        train(TrainConfig.from_dict(dict(base, run_dir=str(tmp_path / "other"))))
