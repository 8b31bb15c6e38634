"""vLLM 0.32's weight routes on `rollwise serve`: /collective_rpc (a worker extension's method by
name), /weight_info and /update_weight_version (CompletionOutput's weight labels), /weight_checker,
/get_world_size and /abort_requests; bad bodies are 400s and the server keeps serving."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from rollwise.serve.process import ServerProcess

EXT = str(Path(__file__).parents[1] / "engine")  # sync_ext.py: the test extensions


@pytest.fixture(scope="module")
def client(model_dir, monkeypatch_module):
    monkeypatch_module.setenv("PYTHONPATH", os.pathsep.join([EXT, *sys.path]))
    with ServerProcess(model_dir, "--worker-extension-cls", "sync_ext.FileSync", "--max-model-len", "256") as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            yield c


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _greedy(client: httpx.Client) -> list[int]:
    r = client.post("/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": {
        "temperature": 0, "max_tokens": 8, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


def test_a_trainer_syncs_through_the_extension_and_checks_the_weights(client, model_dir, other_dir):
    before = _greedy(client)
    base = client.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
    assert client.post("/weight_checker", json={"action": "compare", "baseline": base}).json() == \
        {"match": True, "mismatches": []}
    r = client.post("/collective_rpc", json={"method": "update_weights_from_path",
                                             "args": [str(Path(other_dir) / "model.safetensors")]})
    assert r.status_code == 200 and r.json()["results"][0].endswith(" weights"), r.text
    assert _greedy(client) != before
    got = client.post("/weight_checker", json={"action": "compare", "baseline": base}).json()
    a, b = (load_file(str(Path(d) / "model.safetensors")) for d in (model_dir, other_dir))
    assert not got["match"] and got["mismatches"] == sorted(k for k in a if not torch.equal(a[k], b[k]))
    assert client.post("/weight_checker", json={"action": "reset"}).json() == {"status": "reset"}
    assert client.post("/collective_rpc", json={"method": "reload_weights"}).json() == {"results": [None]}
    assert client.post("/weight_checker", json={"action": "compare", "baseline": base}).json()["match"]
    assert _greedy(client) == before


def test_weight_labels_and_the_small_routes(client):
    # ("default" before any label: test_server's fresh app; this module's server may have been relabelled
    # by another test on it already, in whatever order the workers took them)
    assert isinstance(client.get("/weight_info").json()["weight_version"], str)
    r = client.post("/update_weight_version", json={"new_version": "step-3"})
    assert r.json() == {"success": True, "new_version": "step-3"}
    assert client.get("/weight_info").json() == {"weight_version": "step-3"}
    assert client.get("/get_world_size").json() == {"world_size": 1}
    assert client.post("/abort_requests", json={}).json() == {"status": "aborted", "aborted": 0}
    assert client.post("/abort_requests", json={"request_ids": ["x"]}).json()["aborted"] == 1  # (as vLLM counts)


@pytest.mark.parametrize("path,body", [
    ("/collective_rpc", {"method": "nope"}),
    ("/collective_rpc", {"method": "_worker"}),
    ("/collective_rpc", {"method": "update_weights_from_path", "args": [1, 2, 3]}),  # too many arguments
    ("/collective_rpc", {"method": "update_weights_from_path", "args": ["/nonexistent.safetensors"]}),
    ("/collective_rpc", {"args": []}),
    ("/collective_rpc", {"method": "reload_weights", "args": 5}),
    ("/update_weight_version", {"new_version": ""}),
    ("/update_weight_version", {}),
    ("/weight_checker", {"action": "compare"}),  # no baseline
    ("/weight_checker", {"action": "explode"}),
    ("/init_weight_transfer_engine", {}),
    ("/init_weight_transfer_engine", {"init_info": {}}),
    ("/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0,
                                                    "world_size": 2}}),  # rank 0 is the trainer's
    ("/start_weight_update", None),  # (no transfer joined)
    ("/finish_weight_update", {}),  # (no update started)
    ("/finish_weight_update", {"weight_version": 5}),
    ("/update_weights", {"update_info": {"names": ["a"], "dtype_names": ["float32"]}}),
    ("/update_weights", {"update_info": {"names": [], "dtype_names": [], "shapes": []}}),  # (no update started)
    ("/update_weights", [1, 2]),
])
def test_bad_bodies_are_400s(client, path, body):
    r = client.post(path, json=body)
    assert r.status_code == 400 and "error" in r.json(), (path, body, r.text)
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("path", ["/collective_rpc", "/update_weight_version", "/weight_checker"])
def test_junk_in_every_field_is_a_400(client, junk_failures, path):
    assert junk_failures(client, path) == []

