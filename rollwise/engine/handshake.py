"""An update's handshake (rollwise's own), before its broadcasts: each receiver that the trainer gave
an update id checks the update and says in the group's store whether it takes it; the trainer
broadcasts once every one took it, else calls the update off. A refusal then leaves nobody waiting on
a broadcast (such a wait ends only at the group's timeout, the group out of step) and no receiver
with an update that another refused. Both trainers (weight_transfer, group_transfer) use it."""
from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from concurrent.futures import Future, wait

HANDSHAKE = "rollwise-update"  # (the keys' prefix in the group's store)
POLL = datetime.timedelta(milliseconds=20)  # how often the trainer looks at the replies while it waits


class CalledOff(ValueError):
    """An update called off in its handshake: no weight went, no receiver changed, the group in step."""


def refusal(replies: list[Future], default=None):
    """The first error among the `replies` that came, in their order; else `default`."""
    return next((r.exception() for r in replies if r.done() and r.exception() is not None), default)


def first_line(e: BaseException) -> str:
    """An error's first line (its type's name when it has no words)."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def take_part(store, update_id: int, rank: int, check: Callable[[dict], object] | None, shapes: dict) -> None:
    """A receiver's side of update `update_id`'s handshake: `check(shapes)`'s verdict ({name: shape};
    a ValueError or RuntimeError refuses the update; no check takes it) to the trainer, then the
    trainer's word. ValueError unless both say go: the receiver then takes the broadcasts."""
    try:
        if check is not None:
            check(shapes)
        verdict = ""
    except (ValueError, RuntimeError) as e:  # (the engine's EngineAsleep is a RuntimeError)
        verdict = str(e) or type(e).__name__
    store.set(f"{HANDSHAKE}/{update_id}/ready/{rank}", verdict)
    if verdict:
        raise ValueError(verdict)
    word = store.get(f"{HANDSHAKE}/{update_id}/go").decode()  # (waits up to the store's timeout)
    if word != "go":
        raise ValueError(f"the trainer called the update off: {word}")


def agree(store, update_id: int, ranks: list[int], replies: list[Future], timeout: float) -> None:
    """The trainer's side: returns once the receivers of `ranks` all took update `update_id` (they
    wait for its broadcasts now). Else, at the first refusal (a verdict, or a reply that failed) or
    after `timeout` seconds, calls it off, waits for every reply and raises `CalledOff`."""
    pending = {f"{HANDSHAKE}/{update_id}/ready/{r}": r for r in ranks}
    cause, deadline = None, time.monotonic() + timeout
    while pending and cause is None:
        try:  # (wakes as the last verdict comes; between waits, a reply that failed is a refusal too)
            store.wait(list(pending), POLL)
            came = list(pending)
        except RuntimeError:  # (torch's DistStoreError: not all there yet)
            came = [k for k in pending if store.check([k])]
        for key, verdict in zip(came, store.multi_get(came) if came else []):
            del pending[key]
            cause = cause or (ValueError(verdict.decode()) if verdict else None)
        cause = cause or refusal(replies)
        if pending and cause is None and time.monotonic() > deadline:
            cause = TimeoutError(f"ranks {sorted(pending.values())} did not answer within {timeout:g} s")
    if cause is None:
        store.set(f"{HANDSHAKE}/{update_id}/go", "go")
        return
    text = first_line(cause)
    word = text if isinstance(cause, TimeoutError) else f"a receiver refused it ({text})"
    store.set(f"{HANDSHAKE}/{update_id}/go", word)
    wait(replies)  # (each receiver that took part has the word at once)
    raise CalledOff(f"the update was called off before any weight went ({text}); the group is in step") from cause


def forget(store, update_id: int, ranks: list[int]) -> None:
    """The store's keys of update `update_id`'s handshake, once every receiver replied."""
    for key in [f"{HANDSHAKE}/{update_id}/go", *(f"{HANDSHAKE}/{update_id}/ready/{r}" for r in ranks)]:
        store.delete_key(key)
