"""SGLang's weight update from a process group (rollwise.engine.group_transfer) on `rollwise serve`: a
trainer joins two servers into its group (/init_weights_update_group, ranks 1 and 2) and broadcasts
weights into them (/update_weights_from_distributed: one broadcast a weight, or SGLang's
"flattened_bucket", mixed dtypes in one); each update is a weight update of the server's; bad
requests are 400s with SGLang's {"success": false, "message"}, and the group and the server go on.
Also SGLang's offline Engine's methods, the trainer in a subprocess, as AReaL's and slime's are."""
from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from rollwise import LLM, SamplingParams
from rollwise.engine.group_transfer import GroupTrainer
from rollwise.engine.handshake import CalledOff
from rollwise.engine.weight_transfer import OutOfStep
from rollwise.serve.process import ServerProcess, free_port

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def servers(model_dir):
    args = ("--max-model-len", "256")
    with ServerProcess(model_dir, *args) as a, ServerProcess(model_dir, *args) as b:
        yield [a.url, b.url]


def _greedy(url: str) -> tuple[list[int], int]:
    r = httpx.post(url + "/generate", json={"input_ids": PROMPT, "sampling_params": {
        "temperature": 0, "max_tokens": 8, "ignore_eos": True}}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["token_ids"], r.json()["policy_version"]


def _expected(model: str) -> list[int]:
    out = LLM(model).generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return out[0].outputs[0].token_ids


def test_a_trainer_broadcasts_weights_into_two_servers(servers, model_dir, other_dir):
    before, expected = _expected(model_dir), _expected(other_dir)
    assert [_greedy(u)[0] for u in servers] == [before, before] and before != expected
    trainer = GroupTrainer(servers, free_port())
    try:
        other = load_file(str(Path(other_dir) / "model.safetensors"))
        names = sorted(other)
        first = {n: other[n] for n in names[: len(names) // 2]}
        replies = trainer.send_weights(first, weight_version="7")  # a bucket: the rest stays
        assert all(r["success"] for r in replies), replies
        assert {tuple(_greedy(u)[0]) for u in servers} - {tuple(before), tuple(expected)}
        rest = {n: other[n] for n in names[len(names) // 2:]}
        trainer.send_weights(rest, weight_version="7", flattened=True)  # the same version: written into it
        assert [_greedy(u) for u in servers] == [(expected, 7)] * 2
        name = "model.layers.0.input_layernorm.weight"
        for u in servers:
            r = httpx.post(u + "/get_weights_by_name", json={"name": name, "truncate_size": 3})
            assert r.json() == other[name][:3].tolist()

        mine = load_file(str(Path(model_dir) / "model.safetensors"))
        mixed = {n: (t.to(torch.bfloat16) if n == name else t) for n, t in mine.items()}  # one bucket, two dtypes
        trainer.send_weights(mixed, flattened=True)
        for u in servers:
            r = httpx.post(u + "/get_weights_by_name", json={"name": name, "truncate_size": 4})
            assert r.json() == mixed[name][:4].float().tolist()
            assert _greedy(u)[1] == 8  # (no version given: the next one)
        trainer.send_weights(mine)
        assert [_greedy(u)[0] for u in servers] == [before, before]

        with pytest.raises(ValueError, match="unexpected weights"):  # taken off the group, then refused
            trainer.send_weights({"model.nope.weight": torch.zeros(3)})
        trainer.send_weights({name: mine[name]})  # the group goes on
        again = httpx.post(servers[0] + "/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 3})
        assert again.status_code == 400 and "joined already" in again.json()["message"]
    finally:
        trainer.close()
    assert [_greedy(u)[0] for u in servers] == [before, before]
    trainer = GroupTrainer(servers[:1], free_port())  # after a destroy the name can be joined again
    try:
        trainer.send_weights(load_file(str(Path(other_dir) / "model.safetensors")))
        assert _greedy(servers[0])[0] == expected
    finally:
        trainer.close()
    httpx.post(servers[0] + "/update_weights_from_disk", json={"model_path": model_dir})


def test_an_update_a_server_refuses_goes_to_none_and_the_group_stays_in_step(servers, model_dir, other_dir):
    mine, other = (load_file(str(Path(d) / "model.safetensors")) for d in (model_dir, other_dir))
    trainer = GroupTrainer(servers, free_port(), group_name="refusing", timeout=10)
    try:
        assert trainer.handshake  # (both servers said so as they joined)
        with pytest.raises(ValueError, match="'int8'"):  # refused here, before any server is asked
            trainer.send_weights({"model.norm.weight": torch.zeros(64, dtype=torch.int8)})
        assert all(r["success"] for r in trainer.send_weights(mine, weight_version="3"))
        r = httpx.post(servers[1] + "/release_memory_occupation", json={"tags": ["weights"]}, timeout=60)
        assert r.json()["success"], r.text  # (its weights asleep: that server refuses an update)
        with pytest.raises(CalledOff, match="before any weight went.*weights are asleep") as refused:
            trainer.send_weights(other, weight_version="4")
        assert not isinstance(refused.value, OutOfStep) and not trainer.broken
        assert _greedy(servers[0]) == (_expected(model_dir), 3)  # the other server did not take it
        assert httpx.post(servers[1] + "/resume_memory_occupation", json={"tags": ["weights"]}).json()["success"]
        with pytest.raises(CalledOff, match="before any weight went.*shape"):  # a shape the model has not
            trainer.send_weights({"model.norm.weight": torch.zeros(3)})
        assert all(r["success"] for r in trainer.send_weights(other, weight_version="4"))  # the group goes on (and
        # the woken server, its weights given back, takes every one)
        assert [_greedy(u) for u in servers] == [(_expected(other_dir), 4)] * 2

        r = httpx.post(servers[1] + "/destroy_weights_update_group", json={"group_name": "refusing"})
        assert r.json()["success"]  # (an operator's, say: that server refuses the next update before receiving)
        with pytest.raises(CalledOff, match="before any weight went.*no group 'refusing' joined"):
            trainer.send_weights(mine)
        assert not trainer.broken
        assert [_greedy(u)[1] for u in servers] == [4, 4]
        r = httpx.post(servers[0] + "/destroy_weights_update_group", json={"group_name": "refusing"})
        assert r.json()["success"], r.text  # (at once: the other server is not left receiving)
    finally:
        trainer.close(strict=False)
    trainer = GroupTrainer(servers, free_port(), group_name="refusing")  # both join again
    try:
        assert all(r["success"] for r in trainer.send_weights(mine))
    finally:
        trainer.close()


def test_a_refused_update_aborts_no_request(servers):
    """abort_all_requests aborts what is in flight just before the update: an update refused first
    (here: no such group) leaves the requests running."""
    url = servers[0]
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        going = pool.submit(httpx.post, url + "/generate", json=body, timeout=60)
        for _ in range(200):
            running = [x for x in httpx.get(url + "/metrics").text.splitlines()
                       if x.startswith("vllm:num_requests_running{")]
            if float(running[0].split()[-1]) >= 1:
                break
            time.sleep(0.01)
        r = httpx.post(url + "/update_weights_from_distributed", json={
            "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "none",
            "abort_all_requests": True}, timeout=60)
        assert r.status_code == 400 and "no group 'none' joined" in r.json()["message"], r.text
        got = going.result().json()
    assert got["meta_info"]["finish_reason"]["type"] == "length" and len(got["output_ids"]) == 240


def test_weights_that_do_not_come_are_a_400_and_the_server_goes_on(servers):
    import datetime

    import torch.distributed as dist

    from rollwise.engine.group_transfer import torch_group
    port, url = free_port(), servers[1]
    joined: list = []
    t = threading.Thread(target=lambda: joined.append(torch_group("127.0.0.1", port, 2, 0, "slow",
                                                                  datetime.timedelta(seconds=30))[0]))
    t.start()
    r = httpx.post(url + "/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": port,
                                                            "rank_offset": 1, "world_size": 2, "group_name": "slow",
                                                            "timeout_s": 3}, timeout=60)
    t.join(30)
    assert r.json()["success"] and joined, r.text
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "slow"}
    r = httpx.post(url + "/update_weights_from_distributed", json=body, timeout=60)  # (the trainer sends nothing)
    assert r.status_code == 400 and "did not come" in r.json()["message"], r.text
    assert _greedy(url)[0]  # still serving
    r = httpx.post(url + "/update_weights_from_distributed", json=body, timeout=60)  # out of step: left at once
    assert r.status_code == 400 and "was left: destroy it" in r.json()["message"], r.text
    assert httpx.post(url + "/destroy_weights_update_group", json={"group_name": "slow"}).json()["success"]
    dist.destroy_process_group(joined[0])


@pytest.mark.parametrize("path, body, message", [
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1,
                                    "world_size": 2, "backend": "nccl"}, "'gloo'"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 0,
                                    "world_size": 2}, "0 < rank_offset < world_size"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]]},
     "init_weights_update_group first"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]],
                                          "group_name": "g2"}, "no group 'g2'"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["int4"], "shapes": [[2]]}, "a dtype in"),
    ("/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[2]]},
     "lists of one length"),
    ("/destroy_weights_update_group", {"group_name": "g2"}, "no group 'g2'"),
])
def test_bad_requests_are_sglang_400s(servers, path, body, message):
    r = httpx.post(servers[1] + path, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["success"] is False and message in r.json()["message"], r.text
    assert _greedy(servers[1])[0]  # still serving


@pytest.mark.parametrize("path, body", [
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1,
                                    "world_size": 2, "rank": 1}),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]],
                                          "load_format": "npz"}),
    ("/get_weights_by_name", {"name": "model.nope"}),
    ("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 0}),
])
def test_malformed_bodies_are_400s(servers, path, body):
    r = httpx.post(servers[1] + path, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"], r.text


TRAINER = """
import sys, torch, torch.distributed as dist
from safetensors.torch import load_file
from rollwise.engine.group_transfer import torch_group
port, path = int(sys.argv[1]), sys.argv[2]
group, _ = torch_group("127.0.0.1", port, 2, 0, "weight_update_group")
for t in load_file(path).values():
    dist.broadcast(t.contiguous(), src=0, group=group)
sys.stdin.readline()  # (the engine has them: then the group goes)
dist.destroy_process_group(group)
"""


def test_sglang_engine_takes_weights_from_a_trainer_process(model_dir, other_dir):
    from rollwise.serve.sglang_engine import Engine
    other = str(Path(other_dir) / "model.safetensors")
    state = load_file(other)
    with Engine(model_path=model_dir, random_seed=0) as engine:
        assert engine.init_weights_update_group("127.0.0.1", 1, 0, 2)[0] is False  # (rank 0 is the trainer's)
        port = free_port()
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(port), other], stdin=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        joined: list = []
        t = threading.Thread(target=lambda: joined.append(engine.init_weights_update_group("127.0.0.1", port, 1, 2)))
        t.start()
        t.join(120)
        assert joined and joined[0][0], joined
        ok, message = engine.update_weights_from_distributed(list(state), [t.dtype for t in state.values()],
                                                             [t.shape for t in state.values()])
        assert ok, message
        _, err = trainer.communicate("done\n", timeout=60)
        assert trainer.returncode == 0, err[-3000:]
        got = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                 "ignore_eos": True})
        assert got["output_ids"] == _expected(other_dir)
        name = "model.embed_tokens.weight"
        assert engine.get_weights_by_name(name, 2) == state[name][:2].tolist()
        assert engine.destroy_weights_update_group() == (True, "Destroyed group 'weight_update_group'.")
        assert engine.destroy_weights_update_group()[0] is False
