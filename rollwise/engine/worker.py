"""vLLM's worker, as RL code reaches into it. A trainer written against vLLM syncs weights in one of
three ways, and each runs here as written:

- through the model, as TRL's colocated GRPO does:
  `llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(state.items())`
  (`.driver_worker.worker.model_runner...` too);
- by `llm.collective_rpc(fn)` with a function that takes the worker first, or `llm.apply_model(fn)`;
- by `llm.collective_rpc("method", args=...)` naming a method of a class given as the engine's
  `worker_extension_cls` (OpenRLHF's, SkyRL's and prime-rl's weight-sync classes: a process group
  to the trainer, or a file to read, then `self.model_runner.model.load_weights(...)`).

One worker: the engine's process. Its model is a view of the newest weights: reading passes through
to them, and `load_weights` writes through the engine (`WeightVersions.load_weights`), which keeps
the packed copies and the prefix cache right. Writing a parameter's data directly would bypass both.
"""
from __future__ import annotations

import hashlib

import torch

from rollwise.config import extension_class


class ModelView:
    """vLLM's model as a trainer writes to it: `load_weights(pairs) -> names`; anything else is the
    newest weights' own (parameters, config, modules), read as they are."""

    def __init__(self, engine) -> None:
        object.__setattr__(self, "_engine", engine)

    def load_weights(self, weights) -> set[str]:
        return self._engine.load_weights(weights)

    def __getattr__(self, name: str):
        return getattr(self._engine.runner.model, name)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError("the served model is changed through load_weights, not by setting attributes")

    def __repr__(self) -> str:
        return f"ModelView({type(self._engine.runner.model).__name__}, weights {self._engine.policy_version})"


class ModelRunner:
    """vLLM's `worker.model_runner`: its `model` and `get_model()`."""

    def __init__(self, engine) -> None:
        self.model = ModelView(engine)

    def get_model(self) -> ModelView:
        return self.model


class Executor:
    """vLLM's `llm_engine.model_executor`: one driver worker."""

    def __init__(self, worker: Worker) -> None:
        self.driver_worker = worker

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
                       ) -> list:
        return [self.driver_worker.execute_method(method, *args, **(kwargs or {}))]


class Worker:
    """vLLM's worker methods that RL code calls, on this engine. A `worker_extension_cls` is mixed
    in as vLLM mixes it (its methods may not shadow these)."""

    rank = local_rank = rpc_rank = 0

    def __init__(self, engine) -> None:
        self.engine = engine
        self.device = torch.device(engine.config.device)
        self.model_runner = ModelRunner(engine)
        self.executor = Executor(self)

    @property
    def worker(self) -> Worker:  # (vLLM's WorkerWrapperBase: driver_worker.worker is the worker)
        return self

    def execute_method(self, method, *args, **kwargs):
        """vLLM's run_method: a method of this worker by name, or a function called with it first."""
        if isinstance(method, str):
            fn = None if method.startswith("_") else getattr(self, method, None)
            if not callable(fn):
                raise ValueError(f"the worker has no method {method!r} (its own: {sorted(WORKER_METHODS)}; "
                                 "more from the engine's worker_extension_cls)")
            return fn(*args, **kwargs)
        if callable(method):
            return method(self, *args, **kwargs)
        raise ValueError(f"collective_rpc takes a method name or a function, got {type(method).__name__}")

    def get_model(self) -> ModelView:
        return self.model_runner.model

    def apply_model(self, fn):
        return fn(self.get_model())

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        """vLLM's: (re)load the weights from the model's directory (dummy: nothing to load)."""
        if not load_dummy_weights:
            self.reload_weights()

    def reload_weights(self, weights_iterator=None, weights_path: str | None = None,
                       is_checkpoint_format: bool = True) -> None:
        """vLLM 0.32's in-place reload: (name, tensor) pairs, else the checkpoint in `weights_path`
        (default: the model's directory), into the newest weights. Checkpoint (Hugging Face) names only."""
        from rollwise.engine.models.loader import load_state_dict
        if not is_checkpoint_format:
            raise ValueError("reload_weights takes weights under the checkpoint's names only here "
                             "(is_checkpoint_format=True)")
        if weights_iterator is None:
            weights_iterator = load_state_dict(weights_path or self.engine.config.model)
        self.engine.load_weights(weights_iterator)

    def compute_weight_checksums(self) -> dict[str, str]:
        """SHA-256 of each weight's bytes, by its Hugging Face name (vLLM's names its own fused ones)."""
        return {name: hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for name, t in self.engine.runner.model.hf_tensors().items()}

    def reset_weights(self) -> None:
        """vLLM's: every weight zeroed (a weight checker's reset before a sync it then checks)."""
        self.engine.load_weights({n: torch.zeros_like(t) for n, t in self.engine.runner.model.hf_tensors().items()})

    def check_health(self) -> None:
        return None


WORKER_METHODS = {n for n, v in vars(Worker).items() if callable(v) and not n.startswith("_")} - {"execute_method"}


def make_worker(engine) -> Worker:
    """The engine's worker: Worker, with the engine's `worker_extension_cls` mixed in."""
    name = engine.config.worker_extension_cls
    if not name:
        return Worker(engine)
    ext = extension_class(name)
    clash = sorted(a for a in dir(ext) if not a.startswith("__") and hasattr(Worker, a))
    if clash:  # (vLLM refuses these too)
        raise ValueError(f"worker_extension_cls {name} defines {clash}, which the worker has")
    return type(f"Worker[{ext.__name__}]", (Worker, ext), {})(engine)
