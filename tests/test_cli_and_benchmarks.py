"""The command line and the benchmarks, run as a user runs them (subprocesses, tiny settings)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollwise.omp import passive_env, spin_env

ROOT = Path(__file__).resolve().parents[1]
ENV = passive_env()


def run(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env or ENV, capture_output=True, text=True,
                          timeout=timeout)


def smoke(tmp_path: Path, script: str, *args: str, **kw) -> dict:
    """`script --smoke *args --json PATH`, which must succeed; its JSON result."""
    out = tmp_path / f"{Path(script).stem}.json"
    r = run(script, "--smoke", *args, "--json", str(out), **kw)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("chosen, policy", [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
                                             ({"GOMP_SPINCOUNT": "300000"}, None)])
def test_cli_omp_wait_policy_passive_unless_chosen(chosen, policy):
    # the CLI makes idle OpenMP threads sleep before torch loads, unless the user chose a policy or
    # a spin count (a process with its cores to itself decodes faster with a bounded spin)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = "import os, sys, rollwise.cli; print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], env={**env, **chosen}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(policy), "False"]  # and torch is not loaded yet when it is decided


def test_passive_and_spin_envs():
    # libgomp lets an explicit GOMP_SPINCOUNT override OMP_WAIT_POLICY=PASSIVE, so passive drops it
    env = passive_env({"GOMP_SPINCOUNT": "300000", "OMP_WAIT_POLICY": "ACTIVE", "PATH": "/bin"})
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "PATH": "/bin"}
    assert spin_env(1000, env) == {"GOMP_SPINCOUNT": "1000", "PATH": "/bin"}
    with pytest.raises(ValueError, match="spin_count"):
        spin_env(0)


def test_make_model_and_generate(tmp_path):
    r = run("-m", "rollwise.cli", "make-model", str(tmp_path / "m"), "--family", "qwen2", "--layers", "1",
            "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--vocab", "600")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["vocab_size"] == 600
    r = run("-m", "rollwise.cli", "generate", str(tmp_path / "m"), "--prompt", "hello", "--prompt", "agent",
            "--max-tokens", "5", "--chat")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("--- req-") == 2 and "tok/s" in r.stdout
    r = run("-m", "rollwise.cli", "generate", str(tmp_path / "m"), "--prompt", "hello", "--max-tokens", "5",
            "--sampling", '{"logit_bias": {"7": 100}, "ignore_eos": true}')
    assert r.returncode == 0, r.stderr
    assert "5 tokens, length" in r.stdout
    bad = run("-m", "rollwise.cli", "generate", str(tmp_path / "m"), "--prompt", "x", "--sampling", '{"top_q": 1}')
    assert bad.returncode == 2 and "unknown sampling fields ['top_q']" in bad.stderr
    bad = run("-m", "rollwise.cli", "make-model", str(tmp_path / "x"), "--hidden", "30", "--heads", "4")
    assert bad.returncode == 2 and "must divide" in bad.stderr
    r = run("-m", "rollwise.cli", "make-model", str(tmp_path / "moe"), "--family", "qwen3_moe", "--layers", "1",
            "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--vocab", "600", "--experts", "4",
            "--experts-per-token", "2", "--moe-intermediate", "16")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (
        "qwen3_moe", 4, 2, 16)
    r = run("-m", "rollwise.cli", "generate", str(tmp_path / "moe"), "--prompt", "hello", "--max-tokens", "5",
            "--enable-return-routed-experts", "--sampling", '{"return_routed_experts": true, "ignore_eos": true}')
    assert r.returncode == 0 and "5 tokens, length" in r.stdout, r.stderr


def test_processes_sharing_a_model_cache_build_it_once_and_read_it_whole(tmp_path):
    # three processes ask for the same cached model at once (tests in parallel, two benchmarks): each gets
    # the complete model, and no build directory is left behind
    code = ("import sys; from rollwise.make_model import cached_model; "
            "print(cached_model(sys.argv[1], layers=1, hidden=32, heads=2, kv_heads=1, vocab=600))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "m")], cwd=ROOT, env=ENV, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    while any(p.poll() is None for p in procs):  # whoever sees its config sees all of it
        if (tmp_path / "m" / "config.json").exists():
            assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
                x.name for x in (tmp_path / "m").iterdir()}
        time.sleep(0.002)
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outs]
    assert {out.strip() for out, _ in outs} == {str(tmp_path / "m")}
    assert [x.name for x in tmp_path.iterdir()] == ["m"]
    from rollwise.engine.tokenizer import Tokenizer
    from rollwise.make_model import cached_model
    assert Tokenizer(str(tmp_path / "m")).encode("hello")  # whole: its tokenizer loads
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {x.name for x in (tmp_path / "m").iterdir()}
    assert list((tmp_path / "m").glob("*.safetensors"))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="busy is there without a config.json"):  # it is left alone
        cached_model(tmp_path / "busy", layers=1, hidden=32, heads=2, kv_heads=1, vocab=600)
    assert [x.name for x in (tmp_path / "busy").iterdir()] == ["notes.txt"]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["busy", "m"]


def test_settle_waits_for_a_busy_child_process():
    # side-by-side timings wait for the servers to go idle: a process whose child burns a core for
    # 1.2 s is waited for about that long; an idle one for one window
    import importlib.util
    spec = importlib.util.spec_from_file_location("benchmarks_common", ROOT / "benchmarks" / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    settle = common.settle
    busy = subprocess.Popen(["sh", "-c", "timeout 1.2 sh -c 'while :; do :; done'; sleep 60"])
    idle = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.1)
        waited = settle([busy.pid], window=0.2)
        assert 0.8 < waited < 5
        assert settle([idle.pid], window=0.2) < 0.5
        assert settle([busy.pid, idle.pid], window=0.2) < 0.5  # the child is done now
    finally:
        busy.kill(), idle.kill(), busy.wait(), idle.wait()


def test_engine_benchmark_smoke(tmp_path):
    out = tmp_path / "engine.json"
    r = run("benchmarks/engine.py", "--smoke", "--model", str(tmp_path / "model"), "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["rollwise"]["decode"]) == {"1", "2"}
    pr = res["rollwise"]["prefix_reuse"]
    assert pr["on"]["prefill_tokens_per_run"] < pr["off"]["prefill_tokens_per_run"]
    assert pr["on"]["decode_tokens"] == pr["off"]["decode_tokens"]
    assert "prefix reuse" in r.stdout
    # the same work in-process and over HTTP: every request generates its 4 tokens
    assert [res["rollwise"]["decode"]["2"]["tokens"], res["transformers"]["decode"]["2"]["tokens"],
            res["rollwise_http"]["2"]["tokens"]] == [8, 8, 8]
    assert res["servers_omp"] == "OMP_WAIT_POLICY=PASSIVE"
    assert res["http_prefill"]["rollwise_http"]["2x40"]["prompt_tokens"] == 80 and "prefill over HTTP" in r.stdout
    # the native kernels and the torch path: same tokens, the full count, in every case
    nk = res["native_kernels"]
    assert set(nk) == {"b1_ctx16", "b2_ctx16", "b2_ctx48", "prefill_2x80"} and "native kernels" in r.stdout
    assert all(c["same_tokens"] for c in nk.values())
    assert all(c["decode_tokens"] == 4 * c["batch"] for k, c in nk.items() if k.startswith("b"))
    assert nk["prefill_2x80"]["prefill_tokens"] == 160
    # the attention's tiles in lanes against pair by pair: the same tokens (the smoke model's head size
    # 16 takes the loop kernel, so here only the plumbing is checked)
    la = res["attention_lanes"]["prefill_2x80"]
    assert la["same_tokens"] and la["prefill_tokens"] == 160 and "lanes s" in r.stdout
    # the kernel table alone: the same cases, nothing else measured
    r = run("benchmarks/engine.py", "--smoke", "--kernels-only", "--model", str(tmp_path / "model"), "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    alone = json.loads(out.read_text())
    assert set(alone["native_kernels"]) == set(nk) and set(alone["attention_lanes"]) == {"prefill_2x80"}
    assert "rollwise" not in alone and "rollwise_http" not in alone
    assert alone["head_dim"] == res["head_dim"] and "native kernels" in r.stdout
    assert run("benchmarks/engine.py", "--server-spin", "0").returncode == 2


def test_omp_wait_benchmark_smoke(tmp_path):
    out = tmp_path / "omp.json"
    r = run("benchmarks/omp_wait.py", "--smoke", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert set(res["runs"]) == {"passive/1", "passive/2", "spin/1", "spin/2"}
    assert [len(v) for v in res["runs"].values()] == [1, 2, 1, 2]
    for outs in res["runs"].values():  # the same work in every run: 1 and 2 requests of 4 tokens
        assert all(o["decode"]["1"]["tokens"] == 4 and o["decode"]["2"]["tokens"] == 8 for o in outs)
    assert "GOMP_SPINCOUNT=300000" in r.stdout and "OMP_WAIT_POLICY=PASSIVE" in r.stdout
    assert run("benchmarks/omp_wait.py", "--spin-count", "0").returncode == 2


def test_allocator_benchmark_smoke(tmp_path):
    out = tmp_path / "alloc.json"
    r = run("benchmarks/allocator.py", "--smoke", "--json", str(out))
    assert r.returncode == 0, r.stderr
    case = json.loads(out.read_text())["cases"]["2x40"]
    for side in ("settled", "glibc_defaults"):  # the same work on both sides, its faults counted
        assert case[side]["prompt_tokens"] == 80 and case[side]["page_faults"] > 0 and len(case[side]["runs"]) == 1
    assert case["ratio"] > 0 and "settled / glibc defaults" in r.stdout


def test_vml_race_benchmark_smoke(tmp_path):
    out = tmp_path / "vml.json"
    r = run("benchmarks/vml_race.py", "--smoke", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert {a: v["starts"] for a, v in res["arms"].items()} == {"cold": 2, "settled": 2}
    assert res["arms"]["settled"]["raced"] == 0  # (settled first: no first call left to race)
    assert 6.0 < res["usual_loss"] < 8.0  # (an untrained model's NLL on a 1,024-token vocabulary: ~ln 1024)
    assert run("benchmarks/vml_race.py", "--starts", "0").returncode == 2


def test_spec_engine_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/spec_engine.py", "--model", str(tmp_path / "model"), "--methods", "suffix,ngram",
                "--lookup", "1:3")["concurrency"]
    assert set(res) == {"1", "2"}
    for row in res.values():
        assert row["off"]["generated_tokens"] == row["adaptive"]["generated_tokens"]  # same work
        assert row["off"]["generated_tokens"] == row["ngram adaptive"]["generated_tokens"]
        assert row["off_tok_s"] > 0 and row["spec_tok_s"] > 0
        ngram = row["ngram adaptive"]
        assert ngram["accepted_by_source"]["ngram"] == ngram["accepted"] and ngram["accepted_by_source"]["request"] == 0


def test_repetition_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/repetition.py", "--model", str(tmp_path / "model"), "--prompts", "2",
                "--samples", "2", "--repeats", "1", "--temperature", "0")
    assert res["plain"]["tokens"] == 4 * 64 and res["plain"]["ended_by_rule"] == 0 and res["plain"]["checks"] == 0
    # greedy, the tiny model loops: the rule ends samples early, on the plain run's tokens, having checked
    # every token but the last of a sample that ran to max_tokens
    ended = res["rule"]["ended_by_rule"]
    assert ended > 0 and res["same_tokens_up_to_the_cut"] == 4 and res["rule"]["tokens"] < res["plain"]["tokens"]
    assert res["rule"]["checks"] == res["rule"]["tokens"] - (4 - ended)


def test_stop_strings_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/stop_strings.py", "--model", str(tmp_path / "model"), "--batch", "2",
                "--repeats", "1")
    assert res["plain"]["tokens"] == res["stop"]["tokens"] == 2 * 64  # the same work both ways
    # (plain: each output decoded once, for its text; with stop strings the checks' windows besides)
    assert res["plain"]["decoded_per_token"] == 1.0 < res["stop"]["decoded_per_token"] and res["ratio"] > 0


def test_stream_decode_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/stream_decode.py", "--model", str(tmp_path / "model"))
    assert res["served"]["tokens"] == res["served"]["chunks"] == 200  # (it checked both ways gave the text)
    (length, r), = res["agent_text"].items()
    assert int(length) == r["tokens"] == 500 and r["whole_decode_s"] > 0 and r["engine_copy_s"] > 0
    (length, r), = res["chat_text"].items()  # (it checked both ways gave the same reasoning and content)
    assert int(length) == 500 and r["tokens"] > 500 and r["reasoning_chars"] > 0 and r["content_chars"] > 0


def test_grad_checkpoint_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/grad_checkpoint.py", "--model", str(tmp_path / "model"), "--repeats", "1",
                "--sides", "plain,checkpointed,head_chunks", "--head-chunk", "16")
    assert res["plain"]["tokens"] == res["checkpointed"]["tokens"] == res["head_chunks"]["tokens"] > 0  # (the same)
    assert res["ratio"]["kept_bytes"] < 0.6 and res["ratio"]["seconds"] > 0
    assert res["ratios"]["head_chunks"]["kept_bytes"] < 0.9 and res["settings"]["head_chunk"] == 16


@pytest.mark.parametrize("phase", [[], ["--sft"]], ids=["grpo", "sft"])
def test_train_dp_benchmark_smoke(tmp_path, phase):
    res = smoke(tmp_path, "benchmarks/train_dp.py", "--model", str(tmp_path / "model"), *phase)["configs"]
    assert set(res) == {"1", "2"} and res["1"]["trained_tokens_per_step"] == res["2"]["trained_tokens_per_step"] > 0
    assert res["2"]["ranks_same_bits"] and res["2"]["max_weight_diff"] < 1e-4 and res["2"]["speedup"] > 0


def test_sft_file_benchmark_smoke(tmp_path):
    """The warm start on the tau-bench conversations: trains, and reports held-out NLL both sides."""
    res = smoke(tmp_path, "benchmarks/sft_file.py", "--model", str(tmp_path / "model"), "--plot", str(tmp_path / "p.png"))
    assert res["train_assistant_tokens"] > 0 and res["held_out_conversations"] == 2 and len(res["losses"]) == 2
    assert 0 < res["held_out_nll_after"] < res["held_out_nll_before"] and (tmp_path / "p.png").stat().st_size > 5000


def test_replica_sleep_benchmark_smoke(tmp_path):
    """Each level in a process of its own: asleep, the replicas' pools are out of memory while the trainer trains."""
    res = smoke(tmp_path, "benchmarks/replica_sleep.py", "--model-dir", str(tmp_path / "model"), "--steps", "2",
                "--levels", "0,2", "--plot", str(tmp_path / "p.png"))
    awake, asleep = res["levels"]["0"], res["levels"]["2"]
    assert awake["replicas_slept"] == [0, 0] and asleep["replicas_slept"] == [2, 2]
    assert awake["kv_resident_gib"][-1] > 0 and asleep["kv_resident_gib"] == [0.0, 0.0]
    assert awake["generated_tokens"] == asleep["generated_tokens"] > 0 and (tmp_path / "p.png").stat().st_size > 5000


def test_pre_rollout_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/pre_rollout.py", "--model", str(tmp_path / "model"), "--target", "0.25")
    base, filt, adaptive = res["dynamic_sampling"], res["pre_rollout_filter"], res["adaptive"]
    assert base["trained_groups"] == filt["trained_groups"] == adaptive["trained_groups"] > 0
    assert base["skipped_before_running"] == 0
    assert filt["skipped_before_running"] > 0  # (the untrained model's rewards are all 0: nothing teaches)
    # (every group hard: its explore moves down, the easy one's up, a step at a time)
    assert adaptive["p_hard_last"] < 0.5 < adaptive["p_easy_last"] and res["ratio_adaptive"]["episodes"] > 0


def test_bench_spec_cli_smoke(tmp_path):
    from rollwise.make_model import make_model
    model = make_model(tmp_path / "tok", layers=1, hidden=32, heads=2, kv_heads=1, vocab=600)
    out = tmp_path / "b.json"
    r = run("-m", "rollwise.cli", "bench", "spec", "--tokenizer", str(model), "--limit", "4", "--group-size", "2",
            "--no-arctic", "--lookup", "1:3", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    assert set(res) == {"rollwise/chain", "rollwise+group/chain", "rollwise/tree", "rollwise+group/tree",
                        "ngram 1:3/chain"}
    assert all(v["mean_accepted_per_step"] > 0 for v in res.values())
    assert res["rollwise/chain"]["tokens"] == res["rollwise+group/tree"]["tokens"] == res["ngram 1:3/chain"]["tokens"]


def test_agent_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/agent.py")
    assert res["loop_overhead_us_per_turn"] > 0
    for side in ("fake", "engine"):
        assert all(v["solved"] == 1.0 and v["episodes"] > 0 for v in res[side].values())


def test_agent_gateway_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/agent_gateway.py", "--sides", "env,agent,responses,server")
    for gen in ("instant", "engine"):
        for r in res[gen].values():
            assert r["same_token_ids"] and r["server_over_env_time"] > 0
            assert r["env"]["solved"] == r["agent"]["solved"] == r["responses"]["solved"] == r["server"]["solved"] == 1.0
            assert r["agent"]["turns"] == r["responses"]["turns"] == r["server"]["turns"] == r["env"]["turns"] > 0


def test_mcp_tools_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/mcp_tools.py")  # (every side returned the in-process results)
    assert res["calls"] == 32 and set(res["connect_s"]) == {"stdio", "http"}
    for row in res["concurrency"].values():
        assert set(row) == {"in_process", "stdio", "http"} and all(r["calls_per_s"] > 0 for r in row.values())


def test_reward_model_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/reward_model.py")  # (both sides gave the same scores)
    assert res["answers"] == 12 and res["forwards"] == {"one_at_a_time": 12, "batched": 1}


def test_sandbox_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/sandbox.py")
    assert len(res["cases"]) >= 2 and all(v["sandbox_ms"] > 0 and v["bare_ms"] > 0 for v in res["cases"].values())


def test_routing_replay_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/routing_replay.py")
    fp32, bf16 = res["dtypes"]["float32"], res["dtypes"]["bfloat16"]
    assert fp32["replay"]["routing_mismatch"] == 0 and fp32["off"]["mean_abs_logprob_diff"] < 1e-3
    assert bf16["off"]["tokens"] > 0 and 0 <= bf16["replay"]["routing_mismatch"] < 0.5
    assert res["cost"]["ratio"] > 0


def test_batch_invariance_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/batch_invariance.py")
    inv, default = res["drift"]["invariant"], res["drift"]["default"]
    assert inv["logprobs_differ"] == 0 and inv["tokens_differ"] == 0 and inv["max_abs_dlogprob"] == 0.0
    assert inv["generated_tokens"] == default["generated_tokens"] > 0  # the same work both ways
    for per_model in res["cost"].values():
        assert {"decode batch 1", "decode batch 64", "prefill 8 x 512"} <= set(per_model)
        assert all(v["ratio"] > 0 and v["tokens"] > 0 for v in per_model.values())


def test_linear_policy_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/linear_policy.py")
    models = res["models"]
    assert len(models) == 2 and all(set(v) == {"1", "2", "3", "8", "32"} for v in models.values())
    assert all(set(b["measured_over"]) == {"mkl", "onednn"} and b["tokens"] > 0 for v in models.values()
               for b in v.values())
    assert set(res["policies"]) == {"mkl", "onednn", "measured"}


def test_attention_threads_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/attention_threads.py")
    assert [(r["batch"], r["prompt"]) for r in res["runs"]] == [(1, 16), (4, 16)]
    assert all(r["same_tokens"] and r["decode_tokens"] == 4 * r["batch"] and r["ratio"] > 0 for r in res["runs"])
    assert 2048 <= res["parallel_pairs"] <= 65536 and res["old"] == 65536


def test_sampler_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/sampler.py")
    assert [(r["batch"], r["vocab"]) for r in res["alone"]] == [(1, 1024), (4, 1024)]
    assert [r["batch"] for r in res["engine"]] == [r["batch"] for r in res["engine_greedy"]] == [1, 4]
    assert all(r["same_tokens"] and r["ratio"] > 0 for r in res["alone"] + res["engine"] + res["engine_greedy"])
    assert all(r["decode_tokens"] == 4 * r["batch"] for r in res["engine"] + res["engine_greedy"])


def test_priority_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/priority.py")
    fcfs, prio = res["fcfs"], res["priority"]
    assert fcfs["generated_tokens"] == prio["generated_tokens"] == 12 * 24 + 4 * 16  # equal work
    # (in engine steps, not seconds: the scheduling, not the machine's speed)
    assert prio["urgent_mean_steps"] < fcfs["urgent_mean_steps"]


def test_prefix_hash_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/prefix_hash.py")
    assert res["same_tokens_and_hits"] and set(res["hash_us_per_1k_tokens"]) == {"sha256", "builtin"}
    e = res["engine"]
    assert e["sha256"]["cached_tokens"] == e["builtin"]["cached_tokens"] == 2 * 2 * 64  # the siblings' prefix hits
    assert e["sha256"]["generated_tokens"] == e["builtin"]["generated_tokens"] == 6 * 8


def test_pause_modes_benchmark_smoke(tmp_path):
    m = smoke(tmp_path, "benchmarks/pause_modes.py")["modes"]
    assert {o["tokens"] for o in m.values()} == {(4 + 2) * 16}  # equal work in every mode
    assert {k: o["peak_weight_copies"] for k, o in m.items()} == {"none": 2, "abort": 1, "wait": 1, "keep": 2,
                                                                  "retract": 1}
    assert (m["wait"]["old_weights_tokens"], m["wait"]["new_weights_tokens"]) == (4 * 16, 2 * 16)  # late ones held
    assert m["retract"]["new_weights_tokens"] > 2 * 16 and m["retract"]["prefill_tokens"] > m["wait"]["prefill_tokens"]


def test_gpu_check_runs_its_checks_on_the_cpu(tmp_path):
    # the script a session lent a GPU runs; here on the CPU, where every check must hold
    res = smoke(tmp_path, "benchmarks/gpu_check.py", "--device", "cpu")
    for name in ("dense", "moe"):
        c = res["correctness"][name]
        assert c["same_greedy_tokens"] == c["prompts"] == 4 and c["max_logprob_diff"] < 1e-4, (name, c)
        assert c["spec_lossless"] and c["spec_accepted"] > 0 and c["seeded_repeatable"], (name, c)
    assert set(res["speed"]["decode"]) == {"1", "2"} and res["speed"]["prefill"]["tokens"] == 64


def test_top_p_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/top_p.py")
    assert len(res["alone"]) == 2 * 3 * 2 and [r["batch"] for r in res["engine"]] == [1, 4]
    assert all(r["ratio"] > 0 and 1 <= r["kept_median"] <= 1024 for r in res["alone"])
    assert all(r["same_kept"] for r in res["alone"] if r["spread"] == 8)  # (flat rows: the edge may round apart)
    assert all(r["same_tokens"] and r["decode_tokens"] == 4 * r["batch"] for r in res["engine"])


def test_router_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/router.py", "--policies", "verl,rollwise")
    a, b = res["policies"]["verl"], res["policies"]["rollwise"]
    assert (a["turns"], a["decode_tokens"]) == (b["turns"], b["decode_tokens"]) and a["turns"] > 0
    assert a["prefill_tokens"] > 0 and set(res["decision_us"]) == {"verl", "rollwise"}


def test_router_benchmark_swe_workload_smoke(tmp_path):
    out = tmp_path / "router.json"
    trace = tmp_path / "trace"
    r = run("benchmarks/router.py", "--smoke", "--workload", "swe", "--policies", "verl,rollwise", "--json", str(out),
            "--trace", str(trace))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["policies"]
    assert res["verl"]["generated_tokens"] == res["rollwise"]["generated_tokens"] > 0  # counted by the replicas
    # --trace: each policy's replicas recorded their steps apart, and the simulator's profile fits on them
    steps = [line for f in (trace / "verl").glob("steps-*.jsonl") for line in f.read_text().splitlines()]
    assert len(list((trace / "verl").glob("steps-*.jsonl"))) == 2 and len(steps) == res["verl"]["steps"]
    assert list((trace / "rollwise").glob("steps-*.jsonl"))
    prof = tmp_path / "fitted.toml"
    r = run("-m", "rollwise.sim.fit", "router-bench-model", "--trace", str(trace / "verl"), "--trace",
            str(trace / "rollwise"), "--out", str(prof))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[coef]" in prof.read_text() and "--loss seconds" in prof.read_text()


def test_pipeline_benchmark_smoke(tmp_path):
    out, png = tmp_path / "pipeline.json", tmp_path / "pipeline.png"
    r = run("benchmarks/pipeline.py", "--smoke", "--json", str(out), "--plot", str(png), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert png.stat().st_size > 1000
    res = json.loads(out.read_text())["configs"]
    assert set(res) == {"sync_batch", "sync", "async_k1", "async_k1_partial", "async_k2", "lockstep_k1"}
    assert res["async_k1_partial"]["partial_rollout"] and not res["async_k1"]["partial_rollout"]
    assert res["sync"]["stream_trainer"] and not res["sync_batch"]["stream_trainer"]
    assert res["sync"]["max_staleness_seen"] == res["sync_batch"]["max_staleness_seen"] == 0
    assert res["async_k2"]["max_staleness_seen"] <= 2
    assert res["lockstep_k1"]["max_staleness_seen"] == 1
    assert len({v["trajectories_per_step"] for v in res.values()}) == 1  # equal work per step


def test_pipeline_benchmark_whitened_smoke(tmp_path):
    """--advantage with a whitened estimator adds the configurations whose pass waits for the batch."""
    out = tmp_path / "pipeline.json"
    r = run("benchmarks/pipeline.py", "--smoke", "--advantage", "reinforce_plus_plus_baseline", "--configs",
            "async_k1,async_k1_after", "--repeats", "2", "--json", str(out), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["advantage"] == "reinforce_plus_plus_baseline" and set(res["configs"]) == {"async_k1", "async_k1_after"}
    assert "async_k1: each group's pass as it arrives vs after the batch" in r.stdout
    assert all(c["trained_trajectories"] > 0 and len(c["runs_step_s"]) == 2 for c in res["configs"].values())
    assert all(c["step_s"] in c["runs_step_s"] for c in res["configs"].values())  # a run's, the median's


def test_pipeline_benchmark_compares_each_configuration_with_a_key(tmp_path):
    """--compare KEY=VALUE: each configuration also runs with it (here the trainer apart), beside it."""
    out = tmp_path / "pipeline.json"
    r = run("benchmarks/pipeline.py", "--smoke", "--configs", "sync", "--compare", "trainer_apart=true",
            "--json", str(out), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["configs"]
    assert set(res) == {"sync", "sync+trainer_apart=true"}
    assert res["sync"]["trajectories"] == res["sync+trainer_apart=true"]["trajectories"] > 0  # (the same work)
    assert res["sync+trainer_apart=true"]["speedup_vs_without"] > 0 and "x per step vs without" in r.stdout


def test_demo_smoke(tmp_path):
    """The demo's run, here with the trainer apart valuing logprobs with the engine's kernels."""
    r = run("-m", "rollwise.cli", "demo", "--smoke", "--run-dir", str(tmp_path / "run"), "--set",
            "replica_batch_invariant=true", "--set", "true_on_policy=true", "--set", "trainer_apart=true", timeout=900,
            env=dict(ENV, ROLLWISE_CACHE=str(tmp_path / "cache")))
    assert r.returncode == 0, r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    sft, rl = (float(x.split("=")[1]) for x in last.split())
    assert last.startswith("sft_success=") and 0 <= sft <= 1 and 0 <= rl <= 1
    assert (tmp_path / "run" / "report" / "curves.png").exists()
    config = json.loads((tmp_path / "run" / "report" / "metrics.json").read_text())["config"]
    assert config["true_on_policy"] and config["replica_batch_invariant"] and config["trainer_apart"]


def test_war_sweep_smoke_and_validation(tmp_path):
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    r = run("benchmarks/war_sweep.py", "--smoke", "--json", str(out), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    row = res["loads"]["2"]
    assert set(row) == {"baseline", "spec_only", "sched_only", "war", "rollwise"}
    assert len({(c["turns"], c["decode_tokens"]) for c in row.values()}) == 1  # equal work
    assert all({"makespan_s", "decode_tokens", "prefill_tokens"} <= set(c) for c in row.values())
    assert png.stat().st_size > 10_000
    r = run("benchmarks/war_sweep.py", "--validate", "--json", str(tmp_path / "v.json"))
    assert r.returncode == 0, r.stderr
    v = json.loads((tmp_path / "v.json").read_text())
    assert set(v["makespan"]) >= {"verl", "rollwise"} and all(m["sim_s"] > 0 for m in v["makespan"].values())


def test_war_sweep_tool_scales(tmp_path):
    out, png = tmp_path / "tools.json", tmp_path / "tools.png"
    r = run("benchmarks/war_sweep.py", "--smoke", "--tool-scales", "1,0", "--json", str(out), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())["scales"]
    assert set(res) == {"1", "0"} and res["0"]["tool_bound_s"]["2"] == 0 < res["1"]["tool_bound_s"]["2"]
    rows = [res[s]["loads"]["2"] for s in ("1", "0")]
    assert len({(c["turns"], c["decode_tokens"]) for row in rows for c in row.values()}) == 1  # same work at every scale
    assert rows[1]["baseline"]["makespan_s"] < rows[0]["baseline"]["makespan_s"]  # no tool time at x0
    assert "| x1 (0.2-10 s) |" in r.stdout and png.stat().st_size > 10_000


def test_sim_cli(tmp_path):
    cfg = tmp_path / "sim.toml"
    cfg.write_text('profile = "h100-qwen3-8b-tp1"\nreplicas = 2\nloads = [1]\nturns = [2, 3]\ncontext = [128, 256]\n'
                   'configs = ["baseline", "rollwise"]\n')
    r = run("-m", "rollwise.cli", "sim", "--config", str(cfg), "--set", "obs_median=32", "--json",
            str(tmp_path / "s.json"), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "| 1 |" in r.stdout and "rollwise speedup per load" in r.stdout
    r = run("-m", "rollwise.cli", "sim", "--set", "configs=['nope']", timeout=120)
    assert r.returncode == 2 and "valid" in r.stderr


def test_weight_sync_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/weight_sync.py", "--repeats", "2", "--model", str(tmp_path / "model"))
    assert set(res["ms"]) == {"in_process", "http_file", "http_stream"} and all(v > 0 for v in res["ms"].values())
    two = res["two_replicas"]  # (each arm checks both replicas serve its version)
    assert set(two) == {"gloo_broadcast", "sglang_group", "sglang_flattened", "sglang_group_no_handshake",
                        "http_stream_both", "http_file_both", "sglang_one_small", "sglang_one_small_no_handshake"}
    assert all(v > 0 for v in two.values())


def test_startup_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/startup.py", "--model", str(tmp_path / "model"))
    med, inproc = res["median"], res["median"]["in_process"]
    assert set(med) == {"rollwise", "route", "in_process"} and res["weights_mb"] > 0  # (no peers in smoke)
    for start in (med["rollwise"], med["route"]):
        assert 0 < start["ready_s"] < start["first_reply_s"] and start["cpu_to_ready_s"] > 0 < start["resident_mb"]
    assert med["route"]["resident_mb"] < med["rollwise"]["resident_mb"]  # (the route loads no torch)
    assert inproc["import_torch_s"] > 0 and inproc["llm_s"] > 0
    assert run("benchmarks/startup.py", "--repeats", "0").returncode == 2


def test_http_server_benchmark_smoke(tmp_path):
    loads = smoke(tmp_path, "benchmarks/http_server.py")["loads"]  # (each side's replies checked: 200s)
    assert [loads["stream_chunks"][side]["events"] for side in ("now", "middleware", "asyncio", "before")] == [16] * 4
    assert loads["small_requests"]["now"]["events"] == 20 and loads["small_requests"]["asyncio"]["ratio_per_s"] > 0


def test_structured_benchmark_smoke(tmp_path):
    rows = smoke(tmp_path, "benchmarks/structured.py")["batches"]
    assert all(row["plain"]["tokens"] == row["json_schema"]["tokens"] > 0 and row["ratio"] > 0 for row in rows.values())


def test_advantages_benchmark_smoke(tmp_path):
    png = tmp_path / "advantages.png"
    runs = smoke(tmp_path, "benchmarks/advantages.py", "--seeds", "0", "--advantages", "grpo,gigpo,gae", "--plot",
                 str(png), "--set", "reward_kl_coef=0.01", timeout=900,
                 env=dict(ENV, ROLLWISE_CACHE=str(tmp_path / "cache")))["runs"]
    assert png.stat().st_size > 1000
    assert [x["advantage"] for x in runs] == ["grpo", "gigpo", "gae"] and all(len(x["curve"]) == 3 for x in runs)
    assert all(e is None or e > 0 for x in runs for e in x["entropy"])  # (a step that trained nothing: not NaN)
    # every group's first turns start from its prompt: gigpo always finds step groups, grpo never looks
    assert runs[1]["anchored_turns"] > 0 and runs[0]["anchored_turns"] == 0
    # only gae has a critic, whose explained variance is at most 1
    assert runs[0]["explained_var"] is None and runs[2]["explained_var"] <= 1.0
    assert all(x["reward_kl_coef"][0] == 0.01 and len(x["reward_kl"]) == 2 for x in runs)  # --set: KL in the reward


def test_search_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/search.py")  # (it checks that every side returns the same hits)
    assert res["documents"] > 0 and set(res["levels"]) == {"1", "8"}
    assert all(row["per_query_qps"] > 0 and row["shared_qps"] > 0 for row in res["levels"].values())
    assert res["one_request"]["server_qps"] > 0 and res["one_request"]["ratio"] > 0
    g = res["groups"]  # 4 groups of 8: each group's first query goes out once when joined
    assert g["searches"] == 96 and g["not_joined_sent"] == 96 and g["joined_sent"] <= 96 - 4 * 7


def test_math_reward_benchmark_smoke(tmp_path):
    r = run("benchmarks/math_reward.py", "--smoke", "--json", str(tmp_path / "m.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    levels = json.loads((tmp_path / "m.json").read_text())["levels"]
    assert set(levels) == {"0.0", "0.2"} and levels["0.2"]["adversarial"] > 0 == levels["0.0"]["adversarial"]
    assert all(v["as_intended"] == 12 and v["inline_s"] > 0 and v["pool_s"] > 0 for v in levels.values())
    assert "Timeout during comparison" not in r.stderr  # a timed-out comparison scores 0 quietly


def test_salt_drafting_benchmark_smoke(tmp_path):
    res = smoke(tmp_path, "benchmarks/salt_drafting.py")
    runs = res["runs"]
    assert {r["tokens"] for r in runs.values()} == {res["response_tokens"]}  # the same turns replayed each way
    counts = ("steps", "tokens", "accepted", "drafted")
    assert [runs["per_salt/1"][k] for k in counts] == [runs["shared"][k] for k in counts]  # one salt: one tree
    acc = {k: r["mean_accepted_per_step"] for k, r in runs.items()}
    assert acc["none"] < acc["per_salt/2"] < acc["shared"]
