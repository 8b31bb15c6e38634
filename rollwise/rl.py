"""Agentic RL end to end: SFT warm start on expert transcripts, then GRPO with rollouts on N replicas
behind the router, the bounded-staleness pipeline, and weight sync after every step.

    rollwise train CONFIG.toml        (keys: the fields of TrainConfig)
    rollwise demo [--quick]

The run directory holds `groups.jsonl` (every complete group, written as it completes),
`checkpoint.pt` (model, optimizer, policy version, data cursor; written after each step commits),
and `report/` (metrics.json and PNG curves). Starting again with the same run directory resumes:
complete groups no committed step used are trained on, none is generated twice (a config with another
env, env options, task file, seed or group size is refused there).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import random
import shutil
import time
from collections import Counter
from pathlib import Path

from rollwise.agent.episode import collect, stable_seed
from rollwise.agent.generator import ScriptedGenerator, expert_policy
from rollwise.rl_config import TrainConfig, env_factory, env_options, run_identity
from rollwise.rollout.task_sets import n_train_tasks, task_sets
from rollwise.rollout.fleet import fleet_metrics, make_router, shutdown
from rollwise.rollout.pipeline import GroupQueue, read_log
from rollwise.rollout.producer import PreRolloutFilter, produce, turn_params
from rollwise.rollout.report import Status, write_report
from rollwise.rollout.trackers import Trackers
from rollwise.rl_trainer import TrainerRanks, make_policy, rank_threads
from rollwise.types import SamplingParams
from rollwise.wire import AdapterWeights


def eval_episodes(router, make_env, tasks: list[dict], cfg: TrainConfig, temperature: float | None = None,
                  samples: int = 1, prefix: str = ""):
    """`samples` episodes per task (groups, as they complete), sampled at `temperature` (default: the
    rollouts' temperature, i.e. the policy being trained; 0 is greedy) with per-task seeds; task
    ids get `prefix`, which keeps their trajectories apart from training's on the router."""
    t = cfg.temperature if temperature is None else temperature
    params = turn_params(cfg, t, None if t == 0 else cfg.seed + 7)
    return collect(router, make_env, [dict(x, id=f"{prefix}{x['id']}") for x in tasks], params, group_size=samples,
                   max_concurrency=128, deadline_s=cfg.episode_deadline_s, retries=cfg.episode_retries,
                   retry_on=tuple(cfg.retry_statuses))


async def evaluate(router, make_env, tasks: list[dict], cfg: TrainConfig, temperature: float | None = None,
                   by_env: dict | None = None) -> float | None:
    """Success rate (reward 1) on `tasks`, one episode each (`eval_episodes`). None when there are
    no evaluation tasks. `by_env` (a dict): filled with the success per env of tasks that name
    theirs (a mix)."""
    if not tasks:
        return None
    wins: Counter = Counter()
    seen: Counter = Counter()
    async for g in eval_episodes(router, make_env, tasks, cfg, temperature, prefix="eval-"):
        for t in g:
            wins[t.task.get("env")] += t.reward >= 1.0
            seen[t.task.get("env")] += 1
    if by_env is not None:
        by_env.update({e: wins[e] / seen[e] for e in sorted(k for k in seen if k is not None)})
    return sum(wins.values()) / sum(seen.values())


async def expert_trajectories(tokenizer, make_env, tasks: list[dict], direct_fraction: float = 0.0,
                              seed: int = 0) -> list:
    """Episodes of the scripted expert, token-in-token-out exactly as RL episodes are built. In a
    `direct_fraction` of them (chosen by seed) the expert gives its final answer at once, without tools."""
    rng = random.Random(seed)
    direct = {str(t["id"]): t for t in tasks if rng.random() < direct_fraction}
    expert = expert_policy(make_env, tasks)

    def policy(req):
        if req.group_id in direct:  # the answer the expert would end with, straight away
            return make_env().expert(direct[req.group_id])[-1]
        return expert(req)
    gen = ScriptedGenerator(tokenizer, policy)
    out = []
    async for g in collect(gen, make_env, tasks, SamplingParams(max_tokens=512), group_size=1):
        out.extend(g)
    order = {str(t["id"]): i for i, t in enumerate(tasks)}
    return sorted(out, key=lambda t: order[str(t.task["id"])])  # task order, not completion order (reproducible)


# the RL loop -------------------------------------------------------------------------------------
def _sft_cache_path(cfg: TrainConfig) -> Path | None:
    if not cfg.sft_cache or cfg.sft_steps <= 0:
        return None
    # "v2": transcripts in task order (before, in completion order: warm starts were not reproducible)
    parts = ["v2", str(Path(cfg.model).resolve()), cfg.env, cfg.max_turns, cfg.sft_steps, cfg.sft_tasks,
             cfg.sft_lr, cfg.sft_batch, cfg.sft_direct_fraction, cfg.seed]
    # what else makes the transcripts (runs without these keep their keys: caches made before stay valid)
    options = env_options(cfg, user=False)  # (what the expert's transcripts are made with)
    if options:
        parts.append(json.dumps(options, sort_keys=True, default=str))
    if cfg.train_tasks_file:
        parts.append(hashlib.sha256(Path(cfg.train_tasks_file).read_bytes()).hexdigest())
    if cfg.sft_file:
        parts += ["sft_file", hashlib.sha256(Path(cfg.sft_file).read_bytes()).hexdigest()]
    default_micro = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == "micro_batch_tokens")
    if cfg.trainer_processes > 1 or cfg.micro_batch_tokens != default_micro:  # (the order of the warm start's sums)
        parts += ["ranks", cfg.trainer_processes, cfg.micro_batch_tokens]
    key = stable_seed(*parts)
    return Path(cfg.sft_cache) / f"sft-{key:016x}.pt"


def _check_resume(cfg: TrainConfig, state: dict) -> None:
    was = state.get("identity")
    if was is None:  # a checkpoint from before runs were identified
        return
    now = run_identity(cfg)
    changed = sorted(k for k in now if was.get(k) != now[k])
    if changed:
        raise ValueError(f"{cfg.run_dir} holds a run with other {', '.join(changed)} ("
                         + "; ".join(f"{k}: {was.get(k)} there, {now[k]} here" for k in changed)
                         + "): set another run_dir, or remove that one to start over")


def _save_checkpoint(path: Path, trainer, consumed: list[int], history: list[dict], extra: dict) -> None:
    trainer.save_checkpoint(str(path), {"consumed": consumed, "history": history, **extra})  # (atomic)


async def warm_start(cfg: TrainConfig, policy, ranks, tokenizer, sft_tasks: list[dict], report: dict, status):
    """The SFT warm start on the trainer's ranks (or its cached result), then the trainer on it."""
    import torch
    cached = _sft_cache_path(cfg)
    if cached is not None and cached.exists():
        policy.model.load_state_dict(torch.load(cached, weights_only=True))  # (ranks.trainer() hands it on)
        report["sft"] = {"steps": cfg.sft_steps, "cached": str(cached)}
        status.done(f"SFT warm start: reusing {cached}")
    elif cfg.sft_steps > 0:
        env = env_factory(cfg)()
        if cfg.sft_file:  # a teacher's conversations, tokenized as episodes are
            from rollwise.trainer.sft_data import transcripts
            demos = transcripts(cfg.sft_file, tokenizer, getattr(env, "parser", "hermes"),
                                getattr(policy.model.config, "max_position_embeddings", None))
        elif not callable(getattr(env, "expert", None)):
            raise ValueError(f"env {cfg.env!r} has no expert(task) to warm-start from: set sft_file, or sft_steps = 0")
        else:
            demos = await expert_trajectories(tokenizer, env_factory(cfg, user=False), sft_tasks,
                                              cfg.sft_direct_fraction, cfg.seed)
        t0 = time.perf_counter()
        losses = ranks.sft(demos, lambda s, loss: status.line(f"SFT step {s + 1}/{cfg.sft_steps} loss {loss:.3f}"))
        report["sft"] = {"steps": cfg.sft_steps, "loss_first": losses[0], "loss_last": losses[-1],
                         "seconds": time.perf_counter() - t0, "examples": len(demos),
                         "direct_answers": sum(t.num_turns == 1 for t in demos),
                         "expert_success": sum(t.reward >= 1.0 for t in demos) / max(1, len(demos)),
                         "contexts": sum(len(t.sequences()) for t in demos), "ranks": cfg.trainer_processes,
                         "source": cfg.sft_file or "expert"}
        status.done(f"SFT: {cfg.sft_steps} steps on {len(demos)} transcripts in {report['sft']['seconds']:.0f}s, "
                    f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")  # runs sharing the cache may write it at once
            torch.save(policy.model.state_dict(), tmp)
            os.replace(tmp, cached)
    if cfg.lora_rank and cfg.sft_steps > 0:  # the weights the adapter is trained on
        policy.save(str(Path(cfg.run_dir) / "warm-start-model"))
    return ranks.trainer()  # the KL reference (if any) is the warm-started model


def train(cfg: TrainConfig) -> dict:
    return asyncio.run(_train(cfg))


async def _train(cfg: TrainConfig) -> dict:
    import torch

    from rollwise.engine.tokenizer import Tokenizer
    from rollwise.engine.model_runner import set_threads
    from rollwise.trainer.advantages import informative

    torch.manual_seed(cfg.seed)
    run = Path(cfg.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    ckpt_path, log_path = run / "checkpoint.pt", run / "groups.jsonl"
    tokenizer = Tokenizer(cfg.model)
    make_env = env_factory(cfg)
    train_tasks, sft_tasks, eval_tasks = task_sets(cfg, n_train_tasks(cfg))
    if not train_tasks and (cfg.steps > 0 or not cfg.sft_file):  # (steps = 0 on a file: the warm start alone)
        raise ValueError(f"env {cfg.env!r} has no sample_tasks(n, seed): set train_tasks_file")
    policy = make_policy(cfg, trains=not cfg.trainer_apart)
    if cfg.routing_replay != "off" and not getattr(policy.model.config, "num_experts", 0):
        raise ValueError(f"routing_replay = {cfg.routing_replay!r} needs a model with experts (qwen3_moe); "
                         f"{cfg.model} is {policy.model.config.model_type}")
    report: dict = {"config": dataclasses.asdict(cfg), "steps": []}
    state = torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None
    if state is not None:
        _check_resume(cfg, state)
    status = Status(cfg.progress)

    ranks = TrainerRanks(cfg, policy)  # (the warm start runs on the trainer's ranks too)
    try:
        if state is None:
            trainer = await warm_start(cfg, policy, ranks, tokenizer, sft_tasks, report, status)
        else:
            trainer = ranks.trainer()
            trainer.load_checkpoint(str(ckpt_path), state)  # (other trainer processes load the file)
    except BaseException:
        ranks.close()
        raise
    if state is None:  # a fresh run: the warm start is evaluated below
        history: list[dict] = []
        consumed: list[int] = []  # groups trained on, by seq
        skipped: list[int] = []  # groups taken and not trained on (dynamic sampling)
        sft_success = None
    else:
        history, consumed, skipped = state["history"], state["consumed"], state.get("skipped", [])
        report.update(state.get("report", {}))
        sft_success = state.get("sft_success")
        status.line(f"resumed at policy version {trainer.version} ({len(consumed)} groups trained on)")
        status.done()

    identity = run_identity(cfg)
    trackers = Trackers(cfg.loggers, run, dataclasses.asdict(cfg), cfg.tracker_project)
    try:
        router = make_router(cfg, tokenizer)
    except BaseException:
        trackers.close()
        ranks.close()
        raise
    try:
        if cfg.deterministic and cfg.replica_urls:  # groups are pinned to versions up to k old
            for r in router.replicas.values():
                kept = (await r.info()).get("keep_weight_versions", 1)
                if kept < cfg.weight_versions:
                    raise ValueError(f"replica {r.name} keeps {kept} weight version(s); a deterministic run at "
                                     f"max_staleness={cfg.max_staleness} needs `rollwise serve ... "
                                     f"--keep-weight-versions {cfg.weight_versions}`")
        if cfg.true_on_policy and cfg.replica_urls:  # their logprobs must be the engine's bits whatever the batch
            for r in router.replicas.values():
                if (await r.info()).get("batch_invariant") is not True:
                    raise ValueError(f"replica {r.name} is not batch-invariant; true_on_policy needs servers "
                                     "started with `rollwise serve ... --batch-invariant`")
        # every replica serves the trainer's weights, labelled with the trainer's version (RL steps done)
        if cfg.lora_sync == "adapter":  # the weights the adapter trains on, then the adapter on them
            await router.update_weights(policy.base_weights(), trainer.version)
            await router.update_weights(policy.adapter_weights(), trainer.version)
        else:
            await router.update_weights(policy.engine_weights(), trainer.version)
        if sft_success is None and eval_tasks:
            status.line("evaluating the SFT model ...")
            report["sft_success_by_env"] = {}
            sft_success = await evaluate(router, make_env, eval_tasks, cfg, by_env=report["sft_success_by_env"])
            sft_greedy = await evaluate(router, make_env, eval_tasks, cfg, temperature=0.0)
            report["sft_greedy_success"] = sft_greedy
            trackers.log({"eval_success": sft_success, "eval_greedy_success": sft_greedy}, 0)
            status.done(f"SFT model: success {sft_success:.3f} (greedy {sft_greedy:.3f}) on {len(eval_tasks)} held-out tasks")
        logged = read_log(log_path, repair=True)
        used = set(consumed) | set(skipped)
        left = [g for g in logged if g.seq not in used]  # complete before a crash, not taken
        queue = GroupQueue(cfg.groups_per_step, cfg.max_staleness, version=trainer.version,
                           admitted=max([g.seq + 1 for g in logged] + [trainer.version * cfg.groups_per_step]),
                           log_path=log_path, lockstep=cfg.deterministic, skipped=len(skipped))
        queue.restore(left)
        def teaches(trajs) -> bool:  # (dynamic sampling's and the pre-rollout filter's judgement)
            return informative(trajs, cfg.advantage, cfg.step_advantage_weight, cfg.gamma, cfg.gigpo_mode,
                               cfg.gigpo_similarity)
        skips = None  # GRESO's pre-rollout filter (producer.py), its decisions kept beside the log
        if cfg.pre_rollout_explore < 1 or cfg.pre_rollout_target > 0:
            skips = PreRolloutFilter(len(train_tasks), cfg.pre_rollout_explore, cfg.seed, run / "pre_rollout.jsonl",
                                     cfg.pre_rollout_target, teaches)
            skips.restore({g.task_index: skips.outcome(g.trajectories) for g in logged},
                          (state or {}).get("pre_rollout_explore"))
        done_tasks = {g.task_index for g in logged} | (skips.skipped if skips else set())  # never run twice
        producer = asyncio.create_task(produce(cfg, queue, router, make_env, train_tasks, 0, done_tasks, skips)
                                       if train_tasks else asyncio.sleep(0))
        bar = status.bar(cfg.steps, initial=len(history))
        steps_log = run / "steps.jsonl"  # one line per step as it happens (`tail -f`); rewritten from the checkpoint
        steps_log.write_text("".join(json.dumps(h, default=str) + "\n" for h in history))
        t_run = time.perf_counter()
        stream, n_threads = cfg.streamed, rank_threads(cfg)
        max_skips = cfg.max_skipped_groups or 4 * cfg.groups_per_step

        def training(fn, *a):  # the trainer's work, on a worker thread with its own torch threads
            set_threads(n_threads)
            return fn(*a)
        while len(history) < cfg.steps:
            batch, dropped, wait_s, train_s = [], [], 0.0, 0.0  # trainer idle (waiting for groups), trainer working
            if stream:
                trainer.begin()
            while len(batch) < cfg.groups_per_step:
                t0 = time.perf_counter()
                new: list = []
                g = await queue.next_group(len(batch))
                while True:  # every group that arrived meanwhile: one pass
                    if cfg.dynamic_sampling and len(dropped) < max_skips and not teaches(g.trajectories):
                        await queue.skip(g)
                        dropped.append(g)
                    else:
                        new.append(g)
                    if not queue.has_next(len(batch) + len(new)):
                        break
                    g = await queue.next_group(len(batch) + len(new))
                batch += new
                t1 = time.perf_counter()
                wait_s += t1 - t0
                if stream and new:
                    await asyncio.to_thread(training, trainer.add, [g.trajectories for g in new],
                                            len(batch) >= cfg.groups_per_step)
                    train_s += time.perf_counter() - t1
            t2 = time.perf_counter()  # (sleep mode: idle replicas give their memory to the trainer meanwhile)
            slept = await router.sleep(cfg.replica_sleep) if cfg.replica_sleep and not queue.in_flight else []
            m = await asyncio.to_thread(training, trainer.finish) if stream else \
                await asyncio.to_thread(training, trainer.step, [g.trajectories for g in batch])
            await router.wake_up(slept)
            t3 = time.perf_counter()
            train_s += t3 - t2
            tail_s = t3 - t1  # from the batch's last group to new weights: training not hidden by rollouts
            # (with LoRA: the merged linears alone, or the adapter alone)
            weights = await asyncio.to_thread(policy.adapter_weights) if cfg.lora_sync == "adapter" else \
                await asyncio.to_thread(policy.engine_weights, cfg.replica_sleep < 2)  # (copies: the agents go on)
            await router.update_weights(weights, trainer.version, cfg.partial_rollout)
            sync_s = time.perf_counter() - t3  # weights to every replica
            if skips is not None:  # (GRESO's adaptive explore, before the version admits groups)
                m.update(skips.adapt(trainer.version, [g.trajectories for g in batch + dropped]))
            await queue.commit(trainer.version)
            consumed += [g.seq for g in batch]
            skipped += [g.seq for g in dropped]
            if cfg.eval_every and eval_tasks and (len(history) + 1) % cfg.eval_every == 0:
                t4 = time.perf_counter()  # the weights just synced, on the held-out tasks (rollouts go on meanwhile)
                m.update(eval_success=await evaluate(router, make_env, eval_tasks, cfg),
                         eval_s=time.perf_counter() - t4)
            lm = fleet_metrics(router)
            m.update(step=len(history), wait_s=wait_s, train_s=train_s, tail_s=tail_s, sync_s=sync_s,
                     sync_mb=(weights.nbytes if isinstance(weights, AdapterWeights) else
                              sum(w.nbytes for w in weights.values())) / 2**20,
                     wall_s=time.perf_counter() - t_run,
                     group_versions=[g.version for g in batch], skipped_groups=len(dropped), **lm,
                     **({"replicas_slept": len(slept)} if cfg.replica_sleep else {}))
            if skips is not None:  # tasks skipped before their rollouts since the last step
                m["pre_rollout_skipped"] = skips.take_count()
            history.append(m)
            # (on a thread: the agents and replicas go on meanwhile; the trainer waits, so the state holds still)
            await asyncio.to_thread(_save_checkpoint, ckpt_path, trainer, consumed, history,
                                    {"sft_success": sft_success, "skipped": skipped, "identity": identity,
                                     "pre_rollout_explore": skips.by_version if skips is not None else None,
                                     "report": {k: v for k, v in report.items()
                                                if k in ("sft", "sft_greedy_success", "sft_success_by_env")}})
            with open(steps_log, "a") as f:
                f.write(json.dumps(m, default=str) + "\n")
            trackers.log(m, len(history))  # (step n's metrics under n + 1: the SFT model's evaluation is 0)
            if cfg.save_every and len(history) % cfg.save_every == 0:  # rollouts go on meanwhile
                await asyncio.to_thread(_save_model, policy, run / "models", len(history), cfg.keep_saved)
            if len(history) % 10 == 0:  # the curves so far (drawn on a thread, as the checkpoint)
                await asyncio.to_thread(write_report, run / "report", {**report, "steps": list(history),
                                                                      "sft_success": sft_success})
            bar.update(m)
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        rl_success = None
        if eval_tasks:
            status.line("evaluating the RL model ...")
            report["rl_success_by_env"] = {}
            rl_success = await evaluate(router, make_env, eval_tasks, cfg, by_env=report["rl_success_by_env"])
            report["rl_greedy_success"] = await evaluate(router, make_env, eval_tasks, cfg, temperature=0.0)
            status.done(f"RL model: success {rl_success:.3f} (greedy {report['rl_greedy_success']:.3f})")
        if rl_success is not None:
            trackers.log({"eval_success": rl_success, "eval_greedy_success": report["rl_greedy_success"]},
                         len(history))
    finally:
        trackers.close()
        await router.close()
        shutdown(router)
        ranks.close()
    report.update(steps=history, sft_success=sft_success, rl_success=rl_success, eval_tasks=len(eval_tasks),
                  queue=queue.stats, policy_version=trainer.version)
    write_report(run / "report", report)
    policy.save(str(run / "final-model"))
    if policy.lora is not None:
        base = run / "warm-start-model" if cfg.sft_steps > 0 else Path(cfg.model).resolve()
        policy.save_adapter(str(run / "final-adapter"), str(base))
    return report


def _save_model(policy, root: Path, step: int, keep: int) -> None:
    """The policy as a model directory, root/step-N (written aside, then renamed into place), and only
    the last `keep` of them (0: all)."""
    tmp, final = root / f".step-{step}.tmp", root / f"step-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save(str(tmp))
    shutil.rmtree(final, ignore_errors=True)  # (a resumed run that saved this step before)
    os.replace(tmp, final)
    saved = sorted((int(d.name.removeprefix("step-")), d) for d in root.glob("step-*") if d.name[5:].isdigit())
    for _, d in saved[:-keep] if keep else []:
        shutil.rmtree(d)
