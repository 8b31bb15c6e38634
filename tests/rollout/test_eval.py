"""`rollwise eval`: a model on a config's held-out tasks, on real engines."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollwise.cli import main
from rollwise.evaluation import evaluate_model
from rollwise.rl import TrainConfig

EX = Path(__file__).parents[2] / "examples"


def _cfg(model_dir, tmp_path, **kw) -> TrainConfig:
    (tmp_path / "parity.py").write_text("def score(task, answer):\n    return float(len(answer) % 2 == 0)\n")
    return TrainConfig.from_dict({
        "model": model_dir, "env": "dataset", "env_options": {"reward": f"{tmp_path}/parity.py:score",
                                                             "prompt_key": "question"},
        "eval_tasks_file": str(EX / "units-eval.jsonl"), "eval_tasks": 6, "max_tokens": 9, "max_turns": 2,
        "max_num_seqs": 32, "progress": False, **kw})


def test_eval_scores_every_sample_and_writes_transcripts(model_dir, tmp_path):
    out = tmp_path / "episodes.jsonl"
    report = evaluate_model(_cfg(model_dir, tmp_path), samples=4, out=out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 24 and report["tasks"] == 6 and sum(report["statuses"].values()) == 24
    assert {r["task_id"] for r in rows} == {f"units-eval-{i}" for i in range(6)}
    by_task: dict = {}
    for r in rows:
        by_task.setdefault(r["task_id"], []).append(r["reward"])
        if r["status"] == "done":  # the user's reward, on the final answer's text
            assert r["reward"] == float(len(r["messages"][-1]["content"].strip()) % 2 == 0)
    assert report["success"] == pytest.approx(sum(r["reward"] for r in rows) / 24)
    assert report["pass@4"] == pytest.approx(sum(max(v) for v in by_task.values()) / 6)
    assert 0 < report["success"] < report["pass@4"] <= 1  # sampled: some right, some not
    # pass@2 from the 4 samples: the chance that 2 of them drawn hold a right one (Chen et al.'s estimator)
    pairs = {t: [max(v[i], v[j]) for i in range(4) for j in range(i + 1, 4)] for t, v in by_task.items()}
    assert report["pass@2"] == pytest.approx(sum(sum(p) / 6 for p in pairs.values()) / 6)
    assert report["success"] <= report["pass@2"] <= report["pass@4"] and "pass@1" not in report
    # tau-bench's pass^k: the chance that k samples drawn are all right; pass^4 asks all four
    assert report["pass^4"] == pytest.approx(sum(min(v) for v in by_task.values()) / 6)
    alls = {t: [min(v[i], v[j]) for i in range(4) for j in range(i + 1, 4)] for t, v in by_task.items()}
    assert report["pass^2"] == pytest.approx(sum(sum(p) / 6 for p in alls.values()) / 6)
    assert report["pass^4"] <= report["pass^2"] <= report["success"] and "pass^1" not in report
    assert report["generated_tokens"] == sum(r["generated_tokens"] for r in rows)
    keys = {k for r in rows for k in r["env_stats"]}  # the env's counts per episode (tool calls), averaged
    assert report["env_stats"] == {k: pytest.approx(sum(r["env_stats"].get(k, 0) for r in rows) / 24) for k in keys}


def test_greedy_eval_from_the_cli(model_dir, tmp_path, capsys):
    cfg = tmp_path / "eval.toml"
    cfg.write_text(f'model = "{model_dir}"\nenv = "calculator"\neval_tasks = 4\nmax_tokens = 8\nmax_turns = 2\n'
                   "progress = false\n")
    main(["eval", str(cfg), "--samples", "2", "--temperature", "0", "--out", str(tmp_path / "e.jsonl"),
          "--json", str(tmp_path / "e.json")])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "e.json").read_text()) and report["temperature"] == 0
    rows = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    for a, b in zip(rows[::2], rows[1::2]):  # greedy: a task's samples are the same episode
        assert a["task_id"] == b["task_id"] and a["messages"] == b["messages"]


def test_eval_without_tasks_is_a_value_error(model_dir, tmp_path):
    cfg = TrainConfig.from_dict({"model": model_dir, "env": "dataset", "train_tasks_file": str(EX / "units-train.jsonl"),
                                 "sft_steps": 0})
    with pytest.raises(ValueError, match="no evaluation tasks.*eval_tasks_file"):
        evaluate_model(cfg)
    with pytest.raises(ValueError, match="samples"):
        evaluate_model(_cfg(model_dir, tmp_path), samples=0)


def test_eval_reports_success_by_task_kind(model_dir, tmp_path):
    """Tasks that name a `kind` (the airline env's: book, cancel, change, credit) get success per kind."""
    cfg = TrainConfig.from_dict({"model": model_dir, "env": "airline", "eval_tasks": 12, "max_tokens": 8,
                                 "max_turns": 2, "max_num_seqs": 32, "progress": False})
    out = tmp_path / "airline.jsonl"
    report = evaluate_model(cfg, samples=2, out=out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = {r["kind"] for r in rows}
    assert len(rows) == 24 and kinds <= {"book", "cancel", "change", "credit"} and len(kinds) > 1
    assert report["success_by_kind"] == {k: pytest.approx(sum(r["reward"] >= 1 for r in rows if r["kind"] == k) /
                                                          sum(r["kind"] == k for r in rows)) for k in kinds}
    assert "success_by_env" not in report and "pass^2" in report
