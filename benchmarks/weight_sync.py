"""Weight sync: how long new weights take to reach a replica, side by side in one run on one model.

    python benchmarks/weight_sync.py [--smoke] [--repeats N] [--json PATH] [--model DIR]

In process (`LocalReplica`: tensors handed to the engine thread), and over HTTP to `rollwise serve`
on 127.0.0.1: streamed as safetensors bytes in the request body (the default, works across
machines) against the baseline of a temporary directory the server reads (same host or a shared
file system). Each update is timed from the trainer's tensors to the replica answering; the new
weights serve the next request (checked: the replica reports the version). Reports milliseconds
per update (median) and the weights' megabytes next to it.

Then a LoRA run's update (`--lora-rank`, adapters on every linear): the merged linears
(`lora_sync = "merged"`) against the adapter alone (`lora_sync = "adapter"`), in process and
streamed over HTTP to a `rollwise serve --enable-lora`.

Then two `rollwise serve` replicas at once: vLLM 0.32's weight transfer on the gloo backend (the
trainer broadcasts each tensor once to both; `rollwise.engine.weight_transfer.GlooTrainer`), and
SGLang's update from a process group (`rollwise.engine.group_transfer.GroupTrainer`, one broadcast a
tensor, and "flattened_bucket": one of all their bytes; and the group without the handshake before
its broadcasts, rollwise.engine.handshake, for what that costs, also on a bucket of one small
tensor), against streaming the safetensors bytes to both over HTTP at once, and against a temporary
directory for each; each timed until both hold the new version.

Then a run's update to its HTTP replicas through the router (`Router.update_weights`, what each
step of `rollwise train` with `replica_urls` waits on), by `replica_weights_via`: "broadcast" (one gloo
group of the router's process and every replica, rollwise/router/broadcast.py) against "file" and
"stream" (each replica its own request, all at once); 2 and 3 replicas, the sides taking turns.

Last, TRL's colocated sync through vLLM's model path (`llm.llm_engine.model_executor.driver_worker.
model_runner.model.load_weights([(name, tensor)])`, one tensor a call): each call packs again only the
linears it wrote, against the same calls packing the whole model again after each (as every update
was packed before), and one call with every tensor; the sides take turns.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

from rollwise.engine.async_engine import AsyncEngine  # noqa: E402
from rollwise.router.replica import HttpReplica, LocalReplica  # noqa: E402
from rollwise.serve.process import ServerProcess  # noqa: E402
from rollwise.types import GenerateRequest, SamplingParams  # noqa: E402
from rollwise.wire import AdapterWeights  # noqa: E402

from common import engine_model, write_json  # noqa: E402  (benchmarks/common.py)


async def time_updates(replica, weights: dict | AdapterWeights, repeats: int) -> list[float]:
    out = []
    for v in range(1, repeats + 1):
        t0 = time.perf_counter()
        assert await replica.update_weights(weights, v) == v
        out.append(time.perf_counter() - t0)
        got = await replica.generate(GenerateRequest(prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=1)))
        assert got.policy_version == v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--model", help="default: the engine benchmark's model (32M parameters), built once")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--only", choices=["model_path", "two_replicas", "fleet"],
                    help="that part alone (TRL's path, one tensor a call; the two replicas; a run's fleet)")
    args = ap.parse_args()
    model = engine_model("smoke" if args.smoke else "bench", args.model)
    if args.only in ("two_replicas", "fleet"):
        engine = AsyncEngine(model)
        weights = {k: v.detach().clone() for k, v in engine.engine.runner.model.hf_tensors().items()}
        engine.shutdown()
        mb = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
        out = {"model": model, "weights_mb": mb, "repeats": args.repeats}
        if args.only == "fleet":
            out["fleet"] = fleet_updates(model, weights, args.repeats, mb)
        else:
            out["two_replicas"] = to_two_replicas(model, weights, args.repeats)
        write_json(args.json, out)
        return
    if args.only:
        out = {"model": model, "model_path": one_tensor_a_call(model, args.repeats)}
        write_json(args.json, out)
        return
    engine = AsyncEngine(model)
    weights = {k: v.detach().clone() for k, v in engine.engine.runner.model.hf_tensors().items()}
    mb = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
    res = {}
    try:
        res["in_process"] = asyncio.run(time_updates(LocalReplica("local", engine), weights, args.repeats))
    finally:
        engine.shutdown()
    with ServerProcess(model) as server:
        for via in ("file", "stream"):
            async def go(via=via):
                replica = HttpReplica(server.url, weights_via=via)
                try:
                    return await time_updates(replica, weights, args.repeats)
                finally:
                    await replica.client.aclose()
            res[f"http_{via}"] = asyncio.run(go())
    out = {"model": model, "weights_mb": mb, "repeats": args.repeats,
           "ms": {k: 1000 * statistics.median(v) for k, v in res.items()}}
    print(f"model {model}: {mb:.1f} MB of weights, {args.repeats} updates each (median)")
    for k, ms in out["ms"].items():
        print(f"{k:<12}{ms:>9.1f} ms{mb / ms * 1000:>10.0f} MB/s")
    print(f"streamed vs temporary directory: {out['ms']['http_file'] / out['ms']['http_stream']:.2f}x")
    out["lora"] = lora_updates(model, args.lora_rank, args.repeats)
    out["two_replicas"] = to_two_replicas(model, weights, args.repeats)
    out["fleet"] = fleet_updates(model, weights, args.repeats, mb)
    out["model_path"] = one_tensor_a_call(model, args.repeats)
    write_json(args.json, out)


def lora_updates(model: str, rank: int, repeats: int) -> dict:
    """A LoRA run's per-step update: the merged linears against the adapter alone."""
    from rollwise.trainer.policy import PolicyModel
    policy = PolicyModel(model)
    policy.add_lora(rank, 2 * rank)
    sides = {"merged": policy.engine_weights(changed_only=True), "adapter": policy.adapter_weights()}
    size = {"merged": sum(t.nbytes for t in sides["merged"].values()) / 2**20, "adapter": sides["adapter"].nbytes / 2**20}
    ms: dict[str, float] = {}
    engine = AsyncEngine(model, enable_lora=True, max_lora_rank=rank)
    try:
        for side, w in sides.items():
            ms[f"in_process_{side}"] = 1000 * statistics.median(asyncio.run(
                time_updates(LocalReplica("local", engine), w, repeats)))
    finally:
        engine.shutdown()
    with ServerProcess(model, "--enable-lora", "--max-lora-rank", str(rank)) as server:
        for side, w in sides.items():
            async def go(w=w):
                replica = HttpReplica(server.url, weights_via="stream")
                try:
                    return await time_updates(replica, w, repeats)
                finally:
                    await replica.client.aclose()
            ms[f"http_stream_{side}"] = 1000 * statistics.median(asyncio.run(go()))
    print(f"\nLoRA rank {rank} on every linear: merged linears {size['merged']:.1f} MB, adapter {size['adapter']:.2f} MB")
    for where in ("in_process", "http_stream"):
        m, a = ms[f"{where}_merged"], ms[f"{where}_adapter"]
        print(f"{where:<12} merged {m:8.1f} ms   adapter {a:8.1f} ms   {m / a:.1f}x")
    return {"rank": rank, "mb": size, "ms": ms}


def to_two_replicas(model: str, weights: dict, repeats: int) -> dict:
    """Both replicas from the trainer's tensors to serving them: one gloo broadcast per tensor, against
    the safetensors stream to each over HTTP, both at once (the sides take turns)."""
    from rollwise.engine.group_transfer import GroupTrainer
    from rollwise.engine.weight_transfer import GlooTrainer, HTTPWeightSyncClient
    from rollwise.serve.process import free_port
    ms: dict[str, list[float]] = {"gloo_broadcast": [], "sglang_group": [], "sglang_flattened": [],
                                  "sglang_group_no_handshake": [], "http_stream_both": [], "http_file_both": [],
                                  "sglang_one_small": [], "sglang_one_small_no_handshake": []}
    with ServerProcess(model) as a, ServerProcess(model) as b:
        trainer = GlooTrainer([HTTPWeightSyncClient(a.url), HTTPWeightSyncClient(b.url)], free_port())
        sglang = GroupTrainer([a.url, b.url], free_port())

        async def send(v: int, via: str) -> None:
            replicas = [HttpReplica(s.url, weights_via=via) for s in (a, b)]
            try:
                assert await asyncio.gather(*(r.update_weights(weights, v) for r in replicas)) == [v, v]
            finally:
                for r in replicas:
                    await r.client.aclose()

        def versions() -> list[int]:
            return [httpx.get(s.url + "/health").json()["policy_version"] for s in (a, b)]

        for _ in range(repeats):
            v = versions()[0]
            t0 = time.perf_counter()
            trainer.send_weights(weights)
            ms["gloo_broadcast"].append(1000 * (time.perf_counter() - t0))
            assert versions() == [v + 1, v + 1]
            for k, flat in enumerate((False, True)):
                t0 = time.perf_counter()
                sglang.send_weights(weights, flattened=flat)
                ms["sglang_flattened" if flat else "sglang_group"].append(1000 * (time.perf_counter() - t0))
                assert versions() == [v + 2 + k] * 2
            sglang.handshake = False  # (the broadcasts at once, as before the handshake: what it costs)
            t0 = time.perf_counter()
            sglang.send_weights(weights)
            ms["sglang_group_no_handshake"].append(1000 * (time.perf_counter() - t0))
            sglang.handshake = True
            assert versions() == [v + 4] * 2
            for k, via in enumerate(("stream", "file")):
                t0 = time.perf_counter()
                asyncio.run(send(v + 5 + k, via))
                ms[f"http_{via}_both"].append(1000 * (time.perf_counter() - t0))
        small = dict([min(weights.items(), key=lambda kv: kv[1].nbytes)])  # (a bucket of one small tensor)
        for _ in range(10 * repeats):
            for hs in (True, False):
                sglang.handshake = hs
                t0 = time.perf_counter()
                sglang.send_weights(small)
                ms["sglang_one_small" + ("" if hs else "_no_handshake")].append(1000 * (time.perf_counter() - t0))
        trainer.close()
        sglang.close()
    out = {k: statistics.median(x) for k, x in ms.items()}
    g = out["gloo_broadcast"]
    print(f"\ntwo replicas: vLLM's gloo transfer {g:.1f} ms; SGLang's group {out['sglang_group']:.1f} ms "
          f"({out['sglang_group'] / g:.2f}x), flattened {out['sglang_flattened']:.1f} ms "
          f"({out['sglang_flattened'] / g:.2f}x), the group without the handshake before its broadcasts "
          f"{out['sglang_group_no_handshake']:.1f} ms ({out['sglang_group_no_handshake'] / out['sglang_group']:.2f}x "
          f"the group's); safetensors streamed to both {out['http_stream_both']:.1f} ms "
          f"({out['http_stream_both'] / g:.2f}x), through a directory each {out['http_file_both']:.1f} ms "
          f"({out['http_file_both'] / g:.2f}x); a bucket of one small tensor through the group "
          f"{out['sglang_one_small']:.2f} ms, without the handshake {out['sglang_one_small_no_handshake']:.2f} ms")
    return out


def fleet_updates(model: str, weights: dict, repeats: int, mb: float) -> dict:
    """A run's update through the router to 2 and 3 HTTP replicas, by replica_weights_via (taking turns)."""
    from contextlib import ExitStack

    from rollwise.router.broadcast import FleetBroadcast
    from rollwise.router.router import Router
    out: dict = {}
    with ExitStack() as stack:
        servers = [stack.enter_context(ServerProcess(model, threads=1)) for _ in range(3)]
        for n in (2, 3):
            async def go(n=n) -> dict[str, list[float]]:
                urls = [s.url for s in servers[:n]]
                routers = {via: Router([HttpReplica(u, weights_via=via) for u in urls], "round_robin")
                           for via in ("file", "stream")}
                routers["broadcast"] = Router([HttpReplica(u) for u in urls], "round_robin")
                routers["broadcast"].broadcast = FleetBroadcast()
                version = httpx.get(urls[0] + "/health").json()["policy_version"]
                ms: dict[str, list[float]] = {via: [] for via in routers}
                await routers["broadcast"].update_weights(weights, version + 1)  # (the group is built once)
                version += 1
                for _ in range(repeats):
                    for via, router in routers.items():
                        version += 1
                        t0 = time.perf_counter()
                        assert await router.update_weights(weights, version) == {u: version for u in urls}
                        ms[via].append(1000 * (time.perf_counter() - t0))
                assert routers["broadcast"].broadcast.stats["fallbacks"] == 0
                for router in routers.values():
                    await router.close()
                return ms
            ms = asyncio.run(go())
            out[n] = {via: statistics.median(x) for via, x in ms.items()}
            b = out[n]["broadcast"]
            print(f"\nthe run's update to {n} HTTP replicas ({mb:.0f} MB each): broadcast {b:.1f} ms, file "
                  f"{out[n]['file']:.1f} ms ({out[n]['file'] / b:.2f}x), stream {out[n]['stream']:.1f} ms "
                  f"({out[n]['stream'] / b:.2f}x)")
    return out


def one_tensor_a_call(model: str, repeats: int) -> dict:
    """TRL's colocated sync: every weight through the model path, one tensor a call (only the linears
    written are packed again, only the tensors sent get views), against the whole model packed again
    after each call, against each call building every weight's view and scanning every module (as
    before 2026-12-06), and all at once."""
    from rollwise import LLM
    from rollwise.engine.models.linear import Linear
    from rollwise.engine.models.llama import CausalLM
    from rollwise.engine.models.moe import Experts
    llm = LLM(model)
    path = llm.llm_engine.model_executor.driver_worker.model_runner.model
    weights = {k: v.detach().clone() for k, v in llm.engine.runner.model.hf_tensors().items()}
    greedy = SamplingParams(temperature=0, max_tokens=8)
    before = llm.generate([[5, 6, 7]], greedy)[0].token_ids
    pack = CausalLM.prepack

    def sync(per_tensor: bool) -> float:
        t0 = time.perf_counter()
        if per_tensor:
            for item in weights.items():
                path.load_weights([item])
        else:
            path.load_weights(weights.items())
        return 1000 * (time.perf_counter() - t0)

    def scanned(self, written=None):  # every module's storages looked at, as before
        for m in self.modules():
            if isinstance(m, (Linear, Experts)) and any(p.untyped_storage().data_ptr() in written
                                                        for p in m.parameters(recurse=False)):
                m.repack()

    view, shapes = CausalLM.hf_view, CausalLM.hf_shapes
    ms: dict[str, list[float]] = {"one_tensor_a_call": [], "every_view_built_each_call": [],
                                  "whole_model_packed_each_call": [], "all_at_once": []}
    for _ in range(repeats):
        ms["one_tensor_a_call"].append(sync(True))
        CausalLM.prepack = lambda self, written=None: pack(self)  # (every linear, whatever was written)
        try:
            ms["whole_model_packed_each_call"].append(sync(True))
        finally:
            CausalLM.prepack = pack
        CausalLM.hf_view = lambda self, name: self.hf_tensors()[name]
        CausalLM.hf_shapes = lambda self: {k: tuple(v.shape) for k, v in self.hf_tensors().items()}
        CausalLM.prepack = scanned
        try:
            ms["every_view_built_each_call"].append(sync(True))
        finally:
            CausalLM.hf_view, CausalLM.hf_shapes, CausalLM.prepack = view, shapes, pack
        ms["all_at_once"].append(sync(False))
    assert llm.generate([[5, 6, 7]], greedy)[0].token_ids == before  # (the same weights: the same tokens)
    out = {"tensors": len(weights), "ms": {k: statistics.median(v) for k, v in ms.items()}}
    m = out["ms"]
    whole, one = m["whole_model_packed_each_call"], m["one_tensor_a_call"]
    views = m["every_view_built_each_call"]
    print(f"\nthe model path, {len(weights)} tensors one a call: {one:.1f} ms, every view built each call "
          f"{views:.1f} ms ({views / one:.2f}x), whole model packed after each {whole:.1f} ms ({whole / one:.1f}x); "
          f"all in one call {m['all_at_once']:.1f} ms")
    return out


if __name__ == "__main__":
    main()
