"""Where each service runs: ``rollout.device`` / ``train.device`` resolved against this machine.

``auto`` is CUDA when ``torch.cuda.is_available()``, else the CPU. A CUDA device that is not
there (no CUDA, or an index beyond the visible GPUs) is refused with one line naming the key, so
that a GPU config never silently trains on the CPU. The dtype of each service follows its device
(:func:`schemas.config.resolve_dtype`: ``model.dtype: auto`` is bf16 on CUDA, fp32 on the CPU).
"""

from __future__ import annotations

from schemas.config import ConfigError, RunConfig, resolve_dtype


def resolve_device(spec: str, key: str = "device") -> str:
    """A concrete torch device for ``spec`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``); ``ConfigError``
    naming ``key`` when this machine does not have it."""
    import torch

    if spec == "cpu":
        return "cpu"
    has_cuda = torch.cuda.is_available()
    if spec == "auto":
        return "cuda:0" if has_cuda else "cpu"
    if not has_cuda:
        raise ConfigError(f"config: {key}={spec!r} but this machine has no CUDA device "
                          "(torch.cuda.is_available() is False); use 'auto' or 'cpu'")
    index = int(spec.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(f"config: {key}={spec!r} but this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return f"cuda:{index}"


def placement(cfg: RunConfig) -> dict[str, tuple[str, str]]:
    """``{"rollout": (device, dtype), "trainer": (device, dtype)}`` for this machine (checks both)."""
    rollout = resolve_device(cfg.rollout.device, "rollout.device")
    trainer = resolve_device(cfg.train.device, "train.device")
    release = cfg.rollout.release_between_steps
    if release != "off" and rollout != trainer:
        raise ConfigError(f"config: rollout.release_between_steps={release} shares one device, but rollout.device="
                          f"{cfg.rollout.device!r} is {rollout} and train.device={cfg.train.device!r} is {trainer}; "
                          "put both on one device or set it to off")
    return {
        "rollout": (rollout, resolve_dtype(cfg.model.dtype, rollout)),
        "trainer": (trainer, resolve_dtype(cfg.model.dtype, trainer)),
    }


def describe(cfg: RunConfig) -> str:
    """One line for ``rollstream run``: where the model services run and in which dtype."""
    where = placement(cfg)
    shared = " (one shared GPU)" if where["rollout"][0] == where["trainer"][0] != "cpu" else ""
    workers = f" ×{cfg.rollout.workers}" if cfg.rollout.workers > 1 else ""
    r, t = cfg.rollout, cfg.train
    if r.engine == "torch":
        rollout = f"rollout{workers} on {where['rollout'][0]} ({where['rollout'][1]})"
    else:  # the model runs in the servers: the worker is an HTTP client
        shared = ""
        rollout = f"rollout{workers} via {r.engine} servers ({', '.join(r.server_urls)})"
    trainer = f"trainer on {where['trainer'][0]} ({where['trainer'][1]})"
    if t.ranks > 1:
        split = f"TP {t.tensor_parallel} x DP {t.ranks // t.tensor_parallel}" if t.strategy == "megatron" else "data parallel"
        trainer = f"trainer {t.strategy} x{t.ranks} ranks ({split}) from {where['trainer'][0]} ({where['trainer'][1]})"
    line = f"devices: {rollout}, {trainer}{shared}"
    if any(d.judge for d in cfg.data.domains):
        judge = resolve_device(cfg.judge.device, "judge.device")
        judges = f" ×{cfg.judge.workers}" if cfg.judge.workers > 1 else ""
        line += f", judge{judges} on {judge} ({resolve_dtype(cfg.judge.dtype, judge)})"
    return line
