"""The handshake before an update's broadcasts (rollwise.engine.handshake), on a real TCP store with
receivers on threads: every receiver takes the update and the trainer says go; one refuses and the
others are told the update is off; one that never answers calls it off at the trainer's timeout,
and a receiver that comes later finds it off too."""
from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from rollwise.engine.handshake import HANDSHAKE, CalledOff, agree, forget, take_part
from rollwise.engine.weight_transfer import listening_store
from rollwise.serve.process import free_port


@pytest.fixture
def stores():
    port, wait = free_port(), datetime.timedelta(seconds=20)
    trainer = listening_store("127.0.0.1", port, 4, wait, wait_for_workers=False)
    yield trainer, [dist.TCPStore("127.0.0.1", port, 4, is_master=False, timeout=wait) for _ in range(3)]


def _refuse(why: str):
    def check(shapes=None):
        raise ValueError(why)
    return check


def test_every_receiver_takes_the_update_then_the_trainer_says_go(stores):
    trainer, receivers = stores
    with ThreadPoolExecutor(3) as pool:
        replies = [pool.submit(take_part, s, 1, r, None, {}) for r, s in enumerate(receivers, 1)]
        agree(trainer, 1, [1, 2, 3], replies, timeout=20)
        assert [r.result(timeout=20) for r in replies] == [None] * 3  # (each now takes the broadcasts)
    forget(trainer, 1, [1, 2, 3])
    assert not trainer.check([f"{HANDSHAKE}/1/go"]) and not trainer.check([f"{HANDSHAKE}/1/ready/2"])


def test_one_refusal_calls_the_update_off_for_every_receiver(stores):
    trainer, receivers = stores
    checks = [None, _refuse("weights are asleep"), None]
    with ThreadPoolExecutor(3) as pool:
        replies = [pool.submit(take_part, s, 7, r, c, {"model.norm.weight": [64]})
                   for (r, s), c in zip(enumerate(receivers, 1), checks)]
        with pytest.raises(CalledOff, match=r"before any weight went \(weights are asleep\); the group is in step"):
            agree(trainer, 7, [1, 2, 3], replies, timeout=20)
        assert all(r.done() for r in replies)  # (the trainer waited for every reply)
        errors = [str(r.exception()) for r in replies]
    assert errors[1] == "weights are asleep"
    assert errors[0] == errors[2] == "the trainer called the update off: a receiver refused it (weights are asleep)"


def test_a_failed_reply_calls_it_off_and_a_silent_receiver_times_out(stores):
    trainer, receivers = stores
    with ThreadPoolExecutor(3) as pool:
        gone = pool.submit(_refuse("HTTP 401: a bearer API key is required"))  # (a reply that never took part)
        waiting = pool.submit(take_part, receivers[1], 2, 2, None, {})
        with pytest.raises(CalledOff, match="HTTP 401"):
            agree(trainer, 2, [1, 2], [gone, waiting], timeout=20)
        with pytest.raises(ValueError, match="called the update off"):
            waiting.result(timeout=20)

        silent = pool.submit(lambda: None)  # (answers its request, never the handshake)
        with pytest.raises(CalledOff, match=r"ranks \[3\] did not answer within 0.3 s"):
            agree(trainer, 3, [3], [silent], timeout=0.3)
        with pytest.raises(ValueError, match=r"called the update off: ranks \[3\] did not answer"):
            take_part(receivers[2], 3, 3, None, {})  # (it came late: the update is off)
