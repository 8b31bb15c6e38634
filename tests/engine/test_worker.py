"""vLLM's ways in to the weights that RL trainers use (rollwise.engine.worker): the model path TRL's
colocated GRPO writes through, collective_rpc and apply_model, worker extensions (OpenRLHF's
process-group sync, here a real trainer process broadcasting over gloo; prime-rl's file sync), and
vLLM 0.32's weight labels (CompletionOutput.weight_versions)."""
from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollwise import LLM, SamplingParams
from rollwise.engine.async_llm import AsyncLLM
from rollwise.engine.llm_engine import LLMEngine
from rollwise.config import EngineConfig
from rollwise.serve.process import free_port
from rollwise.types import WeightVersionSpan

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [40, 41, 42]]


@pytest.fixture(scope="module")
def expected(other_dir):
    return [(o.token_ids, o.logprobs) for o in LLM(other_dir).generate(PROMPTS, GREEDY)]


def _got(llm: LLM) -> list:
    return [(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, GREEDY)]


def test_trl_colocate_path_loads_a_trainers_weights_one_tensor_a_call(model_dir, other_dir, expected):
    llm = LLM(model_dir)
    before = _got(llm)
    assert before != expected
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model  # TRL's path (and vLLM V1's below)
    assert llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.config is model.config
    state = load_file(str(Path(other_dir) / "model.safetensors"))
    for name, tensor in state.items():  # as TRL sends them: one at a time
        assert model.load_weights([(name, tensor)]) == {name}
    llm.reset_prefix_cache()
    assert _got(llm) == expected  # tokens and logprobs: the trainer's weights, every packed linear too
    model.load_weights(load_file(str(Path(model_dir) / "model.safetensors")).items())  # and back, all at once
    outs = llm.generate(PROMPTS, GREEDY)
    assert [(o.token_ids, o.logprobs) for o in outs] == before
    assert outs[0].num_cached_tokens == 0  # (no reset: what was cached under the other weights is not matched)
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([(next(iter(state)), torch.zeros(3))])
    with pytest.raises(ValueError, match="unexpected"):
        model.load_weights([("model.nope.weight", torch.zeros(3))])
    assert _got(llm) == before  # (nothing changed)


def test_one_tensor_a_call_after_the_weights_moved(model_dir, other_dir, expected):
    """The names' places and the packed linears' storages are kept between calls (a call builds the
    views of its tensors only). When the parameters move to new memory (here by hand; a level-2
    sleep and wake does it too), the calls after it still write and repack the right linears."""
    llm = LLM(model_dir)
    own = _got(llm)
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    mine, theirs = (load_file(str(Path(d) / "model.safetensors")) for d in (model_dir, other_dir))
    for name, tensor in theirs.items():
        model.load_weights([(name, tensor)])
    params = list(llm.llm_engine.runner.model.parameters())
    old = [p.data for p in params]  # (kept alive while they move: every new address differs)
    with torch.no_grad():
        for p in params:
            p.data = p.data.clone()
    assert not {t.untyped_storage().data_ptr() for t in old} & {p.untyped_storage().data_ptr() for p in params}
    del old
    for name, tensor in mine.items():
        model.load_weights([(name, tensor)])
    llm.reset_prefix_cache()
    assert _got(llm) == own
    llm.sleep(level=2)  # (its new memory may reuse the addresses it gave back)
    llm.wake_up()
    for name, tensor in theirs.items():  # (every weight: a level-2 sleep keeps none)
        model.load_weights([(name, tensor)])
    llm.reset_prefix_cache()
    assert _got(llm) == expected


def test_one_weight_of_a_fused_linear_is_packed_again_with_its_siblings(model_dir, other_dir, tmp_path):
    """q_proj alone lies in the fused q/k/v linear: its pack is rebuilt; the linears not written keep theirs."""
    name = "model.layers.1.self_attn.q_proj.weight"
    mixed = tmp_path / "mixed"
    shutil.copytree(model_dir, mixed)
    state = load_file(str(mixed / "model.safetensors"))
    state[name] = load_file(str(Path(other_dir) / "model.safetensors"))[name]
    save_file(state, str(mixed / "model.safetensors"))
    llm = LLM(model_dir)
    llm.apply_model(lambda model: model.load_weights([(name, state[name])]))
    assert _got(llm) == [(o.token_ids, o.logprobs) for o in LLM(str(mixed)).generate(PROMPTS, GREEDY)]


def test_collective_rpc_runs_functions_and_worker_methods(model_dir, other_dir):
    llm = LLM(model_dir)
    assert llm.collective_rpc(lambda w, a, b=0: (w.rank, w.device.type, a + b), args=(2,), kwargs={"b": 3}) \
        == [(0, "cpu", 5)]
    assert llm.apply_model(lambda m: sum(p.numel() for p in m.parameters())) == \
        [sum(p.numel() for p in llm.engine.runner.model.parameters())]
    sums = llm.collective_rpc("compute_weight_checksums")[0]
    assert set(sums) == set(load_file(str(Path(model_dir) / "model.safetensors")))
    assert llm.llm_engine.collective_rpc("compute_weight_checksums") == [sums]
    before = _got(llm)
    llm.collective_rpc("reset_weights")  # (vLLM's weight checker: zeros, then a sync to check)
    zeroed = llm.collective_rpc("compute_weight_checksums")[0]
    assert all(zeroed[k] != sums[k] for k in sums) and _got(llm) != before
    llm.collective_rpc("reload_weights")  # the model's own checkpoint again
    assert llm.collective_rpc("compute_weight_checksums")[0] == sums and _got(llm) == before
    llm.collective_rpc("reload_weights", kwargs={"weights_path": other_dir})  # (vLLM 0.32's arguments)
    other = llm.collective_rpc("compute_weight_checksums")[0]
    assert other != sums
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
    assert llm.collective_rpc("compute_weight_checksums")[0] == sums
    with pytest.raises(ValueError, match="checkpoint"):
        llm.collective_rpc("reload_weights", kwargs={"weights_path": other_dir, "is_checkpoint_format": False})
    assert llm.collective_rpc("compute_weight_checksums")[0] == sums
    for bad in ("nope", "_worker", "rank", 5):
        with pytest.raises(ValueError, match="method"):
            llm.collective_rpc(bad)


def test_a_worker_extension_syncs_from_a_trainer_process_over_gloo(model_dir, other_dir, expected, tmp_path):
    """OpenRLHF's way: the trainer (another process, rank 0) broadcasts each weight; the engine's worker
    (rank 1) receives it in the extension's `update_weight`, called by name through collective_rpc."""
    sys.path.insert(0, str(Path(__file__).parent))  # (sync_ext, as vLLM imports an extension by its name)
    llm = LLM(model_dir, worker_extension_cls="sync_ext.GlooSync")
    port = free_port()
    trainer = tmp_path / "trainer.py"
    trainer.write_text(textwrap.dedent(f"""
        import datetime, torch.distributed as dist
        from safetensors.torch import load_file
        timeout = datetime.timedelta(seconds=60)
        store = dist.TCPStore("127.0.0.1", {port}, 2, is_master=True, timeout=timeout)
        group = dist.ProcessGroupGloo(store, 0, 2, timeout)
        for name, tensor in sorted(load_file({str(Path(other_dir) / "model.safetensors")!r}).items()):
            group.broadcast(tensor, 0).wait()
        del group, store  # (gloo's threads joined before the interpreter exits: else it may abort)
        """))
    proc = subprocess.Popen([sys.executable, str(trainer)])
    try:
        llm.collective_rpc("init_process_group", args=("127.0.0.1", port, 1, 2))
        meta = load_file(str(Path(other_dir) / "model.safetensors"))
        for name, t in sorted(meta.items()):  # (the trainer tells names, dtypes and shapes; here from the file)
            llm.collective_rpc("update_weight", args=(name, str(t.dtype).removeprefix("torch."), list(t.shape)))
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert _got(llm) == expected


def test_a_file_sync_extension_and_bad_extensions(model_dir, other_dir, expected):
    sys.path.insert(0, str(Path(__file__).parent))
    llm = LLM(model_dir, worker_extension_cls="sync_ext.FileSync")
    n = len(load_file(str(Path(other_dir) / "model.safetensors")))
    assert llm.collective_rpc("update_weights_from_path", args=(str(Path(other_dir) / "model.safetensors"),)) \
        == [f"{n} weights"]
    assert _got(llm) == expected
    with pytest.raises(ValueError, match="get_model"):  # shadows the worker's own (vLLM refuses it too)
        LLM(model_dir, worker_extension_cls="sync_ext.Clashing")
    for bad in ("Nope", "sync_ext.Nope", "no_such_module.X", "sync_ext.torch"):
        with pytest.raises(ValueError, match="worker_extension_cls"):
            LLM(model_dir, worker_extension_cls=bad)


def test_weight_versions_label_each_span_of_output_tokens(model_dir):
    engine = LLMEngine(EngineConfig(model=model_dir))
    assert engine.get_weight_version() == "default"
    a = engine.add_request([1, 2, 3], GREEDY)
    engine.step()  # a: prefill and its first token
    engine.step()
    seen = len(engine.seqs[a].output_token_ids)
    engine.set_weight_version("step-1")
    engine.set_weight_version("step-2")  # (twice before another token: one span)
    b = engine.add_request([4, 5, 6], GREEDY)
    outs = {}
    while engine.has_unfinished:
        for out in engine.step():
            assert out.weight_versions is None or out.finished
            outs[out.request_id] = out
    assert outs[a].weight_versions == [WeightVersionSpan("default", 0, seen), WeightVersionSpan("step-2", seen, 12)]
    assert outs[b].weight_versions == [WeightVersionSpan("step-2", 0, 12)]
    assert outs[a].outputs[0].weight_versions == outs[a].weight_versions
    with pytest.raises(ValueError, match="non-empty string"):
        engine.set_weight_version("")
    llm = LLM(model_dir)
    llm.update_weight_version("v7")
    assert llm.get_weight_version() == "v7"
    assert llm.generate([[1, 2]], GREEDY)[0].outputs[0].weight_versions == [WeightVersionSpan("v7", 0, 12)]


def test_async_llm_collective_rpc_on_the_engine_thread(model_dir):
    async def run():
        engine = AsyncLLM(model_dir)
        try:
            assert await engine.collective_rpc(lambda w: threading.current_thread().name) == ["rollwise-engine"]
            with pytest.raises(TimeoutError):
                await engine.collective_rpc(lambda w: time.sleep(1.0), timeout=0.05)
            assert len((await engine.collective_rpc("compute_weight_checksums"))[0]) > 0
            assert (await engine.apply_model(lambda m: type(m).__name__)) == ["ModelView"]
            await engine.update_weight_version("v1")
            assert await engine.get_weight_version() == "v1"
            final = None
            async for out in engine.generate([1, 2, 3], GREEDY, "r"):
                final = out
            assert final.outputs[0].weight_versions == [WeightVersionSpan("v1", 0, 12)]
        finally:
            engine.shutdown()
    asyncio.run(run())


def test_the_vllm_weight_sync_example_runs_as_written(model_dir):
    """examples/vllm_weight_sync.py, written against vLLM's offline engine, runs on rollwise by its import
    alone; its own asserts check the engine went back to its first tokens after each sync."""
    got = subprocess.run([sys.executable, "examples/vllm_weight_sync.py", model_dir], capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    lines = got.stdout.splitlines()
    assert sum("weight_versions [('step-1', 0, 8)]" in x for x in lines) == 2
    assert lines[-1].startswith("TRL's path: [[") and "extension: ['loaded']" in lines
    stepped = [x.split(" -> ")[1].split(" weight_versions")[0] for x in lines if x.startswith("after the trainer's")]
    assert lines[-1] == f"TRL's path: [{', '.join(stepped)}]"  # (the same weights by either path: the same tokens)
