"""vLLM 0.32's weight transfer on the gloo backend (rollwise.engine.weight_transfer): a trainer
broadcasts every weight into an engine that joined its group; the engine takes them as one update at
finish_weight_update; out-of-order calls and bad requests are ValueErrors that change nothing."""
from __future__ import annotations

import asyncio
import datetime
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollwise import LLM, SamplingParams
from rollwise.engine.async_llm import AsyncLLM
from rollwise.engine.handshake import CalledOff, take_part
from rollwise.engine.weight_transfer import EngineClient, GlooTrainer, OutOfStep, _group
from rollwise.serve.process import free_port
from rollwise.types import WeightVersionSpan

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]


def _got(llm: LLM) -> list:
    return [(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, GREEDY)]


def test_a_trainer_broadcasts_its_weights_into_an_engine(model_dir, other_dir):
    llm = LLM(model_dir)
    before = _got(llm)
    expected = _got(LLM(other_dir))
    trainer = GlooTrainer([EngineClient(llm)], free_port())  # (the engine joins as rank 1, on a thread here)
    try:
        state = load_file(str(Path(other_dir) / "model.safetensors"))
        half = dict(list(state.items())[: len(state) // 2])
        trainer.send_weights(half, weight_version="half")  # a chunk is a subset: the rest stays
        assert llm.engine.policy_version == 1 and _got(llm) not in (before, expected)
        trainer.send_weights(state.items(), weight_version="step-1")
        assert llm.engine.policy_version == 2 and _got(llm) == expected
        assert llm.get_weight_version() == "step-1"
        assert llm.generate([[1, 2]], GREEDY)[0].outputs[0].weight_versions == [WeightVersionSpan("step-1", 0, 10)]
        trainer.send_weights(load_file(str(Path(model_dir) / "model.safetensors")))  # back; the label stays
        assert _got(llm) == before and llm.get_weight_version() == "step-1"
    finally:
        trainer.close()


def test_calls_out_of_order_and_bad_requests_change_nothing(model_dir):
    llm = LLM(model_dir, weight_transfer_config={"backend": "gloo"})  # (vLLM's argument; gloo is always on)
    for backend in ("nccl", "ipc", None):
        with pytest.raises(ValueError, match=r"backend must be one of \['gloo'\]"):
            LLM(model_dir, weight_transfer_config={"backend": backend})
    before = _got(llm)
    with pytest.raises(ValueError, match="init_weight_transfer_engine first"):
        llm.start_weight_update()
    with pytest.raises(ValueError, match="without a matching start"):
        llm.finish_weight_update()
    with pytest.raises(ValueError, match="before update_weights"):
        llm.update_weights({"update_info": {"names": [], "dtype_names": [], "shapes": []}})
    for bad in ({}, {"init_info": {"master_address": "127.0.0.1"}}, {"init_info": 5},
                {"init_info": {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 0, "world_size": 2}},
                {"init_info": {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 2,
                               "backend": "nccl"}},
                {"init_info": {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 2,
                               "packed": "yes"}},
                {"init_info": {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 2,
                               "packed": True, "packed_buffer_size_bytes": 0}},
                {"init_info": {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 2,
                               "timeout_s": 0}}):
        with pytest.raises(ValueError, match="init_info"):
            llm.init_weight_transfer_engine(bad)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="could not join the trainer's group"):  # (no trainer there within 1 s)
        llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": free_port(),
                                                       "rank_offset": 1, "world_size": 2, "timeout_s": 1}})
    assert time.monotonic() - t0 < 30
    llm.engine.receiver.group = object()  # (as if joined: the update's own checks, without a trainer)
    llm.start_weight_update()
    with pytest.raises(ValueError, match="under way"):
        llm.start_weight_update()
    for bad in ({"names": ["a"], "dtype_names": [], "shapes": []}, {"names": ["a"], "dtype_names": ["int8"],
                                                                     "shapes": [[2]]},
                {"names": ["a"], "dtype_names": ["float32"], "shapes": [[-1]]}, {"names": "a"}, [{"names": []}]):
        with pytest.raises(ValueError, match="update_info"):
            llm.update_weights({"update_info": bad})
    with pytest.raises(ValueError, match="during a weight update"):
        llm.shutdown_weight_transfer_engine()
    llm.finish_weight_update("nothing")  # nothing came: no new weights, only the label
    assert llm.engine.policy_version == 0 and llm.get_weight_version() == "nothing" and _got(llm) == before
    llm.shutdown_weight_transfer_engine()
    with pytest.raises(ValueError, match="init_weight_transfer_engine first"):
        llm.start_weight_update()


def test_an_engine_that_refuses_to_join_fails_the_trainer_at_once():
    class Refusing:
        def init_weight_transfer_engine(self, init_info):
            raise ValueError("no weight transfer here")

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="no weight transfer here"):
        GlooTrainer([Refusing()], free_port(), timeout=3)
    assert time.monotonic() - t0 < 2  # (not after the rendezvous' timeout)


class _Refusing(EngineClient):
    refuse: str | None = None  # "before": before the handshake; "midway": after it, taking no broadcast

    def update_weights(self, update_info: dict) -> None:
        if self.refuse == "before":
            raise ValueError("not taking updates now")
        if self.refuse == "midway":  # (as an engine gone after it said it takes the update)
            take_part(self.llm.engine.receiver.store, update_info["update_id"], 1, None, {})
            raise ValueError("gone midway")
        super().update_weights(update_info)


def test_an_update_an_engine_refuses_changes_nothing_and_the_group_goes_on(model_dir, other_dir):
    llm = LLM(model_dir)
    state = load_file(str(Path(other_dir) / "model.safetensors"))
    client = _Refusing(llm)
    trainer = GlooTrainer([client], free_port(), timeout=10)  # (the group's: a broadcast no one takes fails then)
    try:
        with pytest.raises(ValueError, match="'int8'"):  # refused here, before the engine is asked: in step
            trainer.send_weights({"model.norm.weight": torch.zeros(64, dtype=torch.int8)})
        trainer.send_weights(state, weight_version="v1")
        assert llm.engine.policy_version == 1 and llm.get_weight_version() == "v1"
        with pytest.raises(CalledOff, match="before any weight went.*unexpected weights"):  # the engine's check
            trainer.send_weights({"model.nope.weight": torch.zeros(3)})
        client.refuse = "before"
        with pytest.raises(CalledOff, match="before any weight went.*not taking updates now") as refused:
            trainer.send_weights(state, weight_version="v2")
        assert not isinstance(refused.value, OutOfStep) and not trainer.broken
        assert llm.engine.policy_version == 1 and llm.get_weight_version() == "v1"
        client.refuse = None
        trainer.send_weights(state, weight_version="v2")  # in step: the next update goes
        assert llm.engine.policy_version == 2 and llm.get_weight_version() == "v2"

        client.refuse = "midway"
        t0 = time.monotonic()
        with pytest.raises(OutOfStep, match="gone midway.*out of step"):
            trainer.send_weights(state)
        with pytest.raises(OutOfStep, match="gone midway"):  # and no more updates
            trainer.send_weights(state)
        assert time.monotonic() - t0 < 60
        assert llm.engine.policy_version == 2
    finally:
        if llm.engine.receiver.staged is not None:
            llm.finish_weight_update()
        trainer.close()


def test_an_engine_already_in_an_update_leaves_the_others_unstarted(model_dir, other_dir):
    one, two = LLM(model_dir), LLM(model_dir)
    state = load_file(str(Path(other_dir) / "model.safetensors"))
    trainer = GlooTrainer([EngineClient(one), EngineClient(two)], free_port(), timeout=30)
    try:
        two.start_weight_update()  # (another trainer's update under way on the second engine)
        with pytest.raises(ValueError, match="under way"):
            trainer.send_weights(state)
        assert one.engine.receiver.staged is None  # the first ended the update it had started
        two.finish_weight_update()
        trainer.send_weights(state, weight_version="v1")  # so the next goes to both
        assert [(llm.engine.policy_version, llm.get_weight_version()) for llm in (one, two)] == [(1, "v1")] * 2
    finally:
        trainer.close()


def test_weights_that_stop_coming_drop_the_update_and_leave_the_group(model_dir, other_dir):
    """A trainer that sends one weight of many and then nothing: the engine's receive ends at its
    group's timeout, takes none of what came (a later finish_weight_update has nothing to apply) and
    leaves the group, which is out of step; the engine goes on serving its weights."""
    llm = LLM(model_dir)
    before = llm.generate([PROMPTS[0]], GREEDY)[0].token_ids
    state = load_file(str(Path(other_dir) / "model.safetensors"))
    info = {"names": list(state), "dtype_names": ["float32"] * len(state),
            "shapes": [list(t.shape) for t in state.values()]}
    port, held = free_port(), []

    def trainer() -> None:
        _, group = _group("127.0.0.1", port, 0, 2, datetime.timedelta(seconds=60))
        group.broadcast(next(iter(state.values())), 0).wait()
        held.append(group)  # (kept open: the engine waits for the rest until its own timeout)

    sender = threading.Thread(target=trainer)
    sender.start()
    llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                                                   "rank_offset": 1, "world_size": 2, "timeout_s": 2}})
    llm.start_weight_update()
    with pytest.raises(ValueError, match="did not come.*dropped, nothing changed.*init_weight_transfer_engine again"):
        llm.update_weights({"update_info": info})
    sender.join(30)
    with pytest.raises(ValueError, match="without a matching start_weight_update"):
        llm.finish_weight_update()  # (before: the one weight that came, taken as an update)
    with pytest.raises(ValueError, match="no weight transfer"):
        llm.start_weight_update()
    assert llm.engine.policy_version == 0 and llm.generate([PROMPTS[0]], GREEDY)[0].token_ids == before


def test_async_llm_receives_off_the_engine_thread(model_dir, other_dir):
    """AsyncLLM's weight transfer calls (vLLM 0.32's), a request served while an update is open."""
    state = load_file(str(Path(other_dir) / "model.safetensors"))
    expected = LLM(other_dir).generate([PROMPTS[0]], GREEDY)[0].token_ids
    port = free_port()
    info = {"names": list(state), "dtype_names": ["float32"] * len(state),
            "shapes": [list(t.shape) for t in state.values()]}

    def trainer() -> None:
        _, group = _group("127.0.0.1", port, 0, 2, datetime.timedelta(seconds=60))
        for t in state.values():
            group.broadcast(t, 0).wait()

    async def run():
        engine = AsyncLLM(model_dir)
        try:
            sender = threading.Thread(target=trainer)
            sender.start()
            await engine.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                                                                    "rank_offset": 1, "world_size": 2}})
            await engine.start_weight_update()
            receiving = asyncio.ensure_future(engine.update_weights({"update_info": info}))
            served = [o async for o in engine.generate(PROMPTS[1], GREEDY, "meanwhile")][-1]
            await receiving
            sender.join()
            assert served.finished and len(served.outputs[0].token_ids) == 10
            await engine.finish_weight_update("v1")
            final = [o async for o in engine.generate(PROMPTS[0], GREEDY, "after")][-1]
            assert final.outputs[0].token_ids == expected and await engine.get_weight_version() == "v1"
            await engine.shutdown_weight_transfer_engine()
        finally:
            engine.shutdown()
    asyncio.run(run())


def test_packed_and_one_by_one_transfers_give_the_same_weights(model_dir, other_dir):
    """Packed (the weights' bytes in buffers of a given size, several weights and dtypes in one, a weight
    larger than the buffer alone) and one weight a broadcast land the same weights."""
    state = load_file(str(Path(other_dir) / "model.safetensors"))
    mixed = {k: v.bfloat16() if i % 2 else v for i, (k, v) in enumerate(state.items())}
    sums = []
    for packed, size in ((False, 1), (True, 3000), (True, 1 << 30)):
        llm = LLM(model_dir)
        trainer = GlooTrainer([EngineClient(llm)], free_port(), packed=packed, packed_buffer_size_bytes=size)
        try:
            trainer.send_weights(mixed)
        finally:
            trainer.close()
        sums.append(llm.collective_rpc("compute_weight_checksums")[0])
    assert sums[0] == sums[1] == sums[2]
    plain = LLM(model_dir)
    plain.llm_engine.load_weights(mixed)  # (the same tensors straight in)
    assert plain.collective_rpc("compute_weight_checksums")[0] == sums[0]


def _listening() -> dict[str, str]:
    """This process's listening TCP sockets: inode -> local address (/proc/net/tcp*, matched by inode)."""
    import os
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # (the listing's own descriptor, closed by now)
            pass
    mine = {link[8:-1] for link in links if link.startswith("socket:[")}
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in mine:  # LISTEN
                out[f[9]] = f[1].split(":")[0]
    return out


def test_the_trainers_group_listens_on_its_address_alone():
    """torch's TCP store listens on every interface; the trainer's store and gloo sockets for a group on
    127.0.0.1 listen there alone (on the loopback), so nothing off this host can join or read it."""
    from rollwise.trainer.data_parallel import Gloo, store
    before = _listening()  # (the sockets of servers other tests in this process started)
    group = _group("127.0.0.1", free_port(), 0, 1, datetime.timedelta(seconds=10))
    opened = [a for inode, a in _listening().items() if inode not in before]
    assert len(opened) >= 2 and set(opened) == {"0100007F"}, opened  # 127.0.0.1 (little-endian hex)
    del group
    before = _listening()
    comm = Gloo(0, 1, store(free_port(), 1, master=True))
    assert comm.gather({"a": [1, 2]}) == [{"a": [1, 2]}]
    opened = [a for inode, a in _listening().items() if inode not in before]
    assert len(opened) >= 2 and set(opened) == {"0100007F"}, opened
    comm.close()


def _outside_interface() -> str | None:
    """A network interface with an IPv4 address off the loopback (SIOCGIFADDR), if this machine has one."""
    import fcntl
    import socket
    import struct
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if not socket.inet_ntoa(raw[20:24]).startswith("127."):
            return name
    return None


def test_an_sglang_style_group_on_the_loopback_listens_there_alone(monkeypatch):
    """torch's group builder (SGLang's layout: group_transfer.torch_group) takes no gloo options, and
    gloo's default device listens on the address this host's name resolves to, or GLOO_SOCKET_IFNAME's:
    here an interface other hosts reach (where the machine has one). An engine's group on 127.0.0.1
    listens on the loopback alone, leaves the environment as it was, and takes a broadcast from a
    trainer whose device is gloo's default (as SGLang's trainers build theirs)."""
    import os
    import subprocess
    import sys

    import torch.distributed as dist

    from rollwise.engine.group_transfer import torch_group
    outside = _outside_interface()
    if outside is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", outside)
    port = free_port()
    trainer = subprocess.Popen([sys.executable, "-c", (
        "import contextlib, datetime, torch; import rollwise.engine.group_transfer as g\n"
        "g._device_on = lambda address: contextlib.nullcontext()  # (gloo's default device, as SGLang's trainers)\n"
        f"group, _ = g.torch_group('127.0.0.1', {port}, 2, 0, 'here', datetime.timedelta(seconds=60))\n"
        "group.broadcast(torch.arange(4.0), 0).wait()\n"
        "import sys, torch.distributed as dist; sys.stdin.readline(); dist.destroy_process_group(group)")],
        stdin=subprocess.PIPE, text=True)  # (its group goes once the engine has the broadcast, as a trainer's)
    try:
        before = _listening()
        group, _ = torch_group("127.0.0.1", port, 2, 1, "here", datetime.timedelta(seconds=60))
        opened = [a for inode, a in _listening().items() if inode not in before]
        assert opened and set(opened) == {"0100007F"}, opened  # 127.0.0.1 alone
        assert os.environ.get("GLOO_SOCKET_IFNAME") == outside
        got = torch.zeros(4)
        group.broadcast(got, 0).wait()
        assert got.tolist() == [0.0, 1.0, 2.0, 3.0]
        trainer.communicate("done\n", timeout=60)
        assert trainer.returncode == 0
        dist.destroy_process_group(group)
    finally:
        if trainer.poll() is None:
            trainer.kill()
