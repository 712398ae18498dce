"""Typed configuration: one frozen dataclass per component, loaded from TOML.

``load_config(path, overrides)`` reads a TOML file, applies ``section.key=value``
overrides, and returns a validated :class:`Config`. Every problem raises
:class:`~elastic_trainer.errors.ConfigError` naming the key, before any worker starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from . import contract
from .errors import ConfigError

# The closed sets of words a key takes (checked with its section, the message listing them).
DataFormat = Literal["memmap", "text", "tokens"]
TokenDtype = Literal["uint16", "uint32"]
MixedPrecision = Literal["auto", "fp32", "bf16"]
Device = Literal["auto", "cpu", "cuda"]
OnNonfinite = Literal["stop", "rollback", "replay"]
SaveMode = Literal["async", "sync"]
Writer = Literal["thread", "process"]


@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/demo"
    name: str = "elastic-trainer"

    def validate(self, cfg: Config) -> None:
        _require(bool(self.dir), "run.dir", "must not be empty")


@dataclass(frozen=True)
class ModelConfig:
    """The demo GPT (``factory = ""``) or a user factory ``"pkg.module:function"``.

    ``hf_config``: a local ``config.json`` (or a directory holding one) for the built-in
    Hugging Face factory ``elastic_trainer.models.hf:causal_lm`` (needs the ``hf`` extra).

    ``init_from``: pretrained weights for a fresh start, a local Hugging Face folder of
    ``*.safetensors`` files or one ``.safetensors`` file (see
    :mod:`elastic_trainer.models.pretrained`); a resume loads the checkpoint instead."""

    factory: str = ""
    shard_modules: list[str] = field(default_factory=list)
    hf_config: str = ""
    init_from: str = ""
    vocab_size: int = 256
    seq_len: int = 128
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    init_std: float = 0.02
    dropout: float = 0.0  # demo model: dropout probability in training (embeddings, attention, residuals)

    def validate(self, cfg: Config) -> None:
        for k in ("vocab_size", "seq_len", "dim", "n_layers", "n_heads", "mlp_ratio"):
            _require(getattr(self, k) > 0, f"model.{k}", f"must be > 0, got {getattr(self, k)}")
        _require(
            self.dim % self.n_heads == 0, "model.dim", f"{self.dim} is not divisible by model.n_heads={self.n_heads}"
        )
        _require(self.init_std > 0, "model.init_std", "must be > 0")
        _require(0.0 <= self.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {self.dropout}")
        _require(
            not (self.dropout and self.hf_config),
            "model.dropout",
            "is for the demo model; a Hugging Face model takes its dropout from its config.json "
            "(e.g. attention_dropout)",
        )
        if self.factory:
            _require(":" in self.factory, "model.factory", f"expected 'package.module:function', got {self.factory!r}")
        _require(
            not self.hf_config or bool(self.factory),
            "model.hf_config",
            'is set but model.factory is empty: use factory = "elastic_trainer.models.hf:causal_lm"',
        )


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from (see :mod:`elastic_trainer.worker.sources`).

    ``format = "memmap"``: ``path`` is a flat binary file of token ids (``dtype`` uint16/uint32).
    ``format = "text"``: ``path`` is a Parquet/Arrow/JSONL file, a directory of them or a glob;
    column ``column`` (default ``text``) is tokenised with the local ``tokenizer``
    (``tokenizer.json`` or a directory holding one), ``eos_token`` is appended to each document,
    and documents are packed into one token stream (cached under ``cache_dir``, default
    ``<run.dir>/data-cache``). ``format = "tokens"``: the same files with a column of token-id
    lists (default ``input_ids``), packed as they are."""

    path: str = "runs/data/demo.bin"
    dtype: TokenDtype = "uint16"
    format: DataFormat = "memmap"
    column: str = ""
    tokenizer: str = ""
    eos_token: str = ""
    cache_dir: str = ""

    def validate(self, cfg: Config) -> None:
        _require_one_of(self.format, DataFormat, "data.format")
        if self.format == "text":
            _require(
                bool(self.tokenizer),
                "data.tokenizer",
                'data.format = "text" needs a local tokenizer (tokenizer.json or its directory)',
            )
        else:
            only_text = f'is only used with data.format = "text" (format is {self.format!r})'
            _require(not self.tokenizer, "data.tokenizer", only_text)
            _require(not self.eos_token, "data.eos_token", only_text)
        _require_one_of(self.dtype, TokenDtype, "data.dtype")
        _require(bool(self.path), "data.path", "must not be empty")
        vocab = cfg.model.vocab_size
        if self.format == "memmap" and self.dtype == "uint16":
            _require(vocab <= 65536, "model.vocab_size", f"{vocab} does not fit data.dtype=uint16")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    global_batch_size: int = 16
    micro_batch_size: int = 4
    seed: int = 1234
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    mixed_precision: MixedPrecision = "auto"
    device: Device = "auto"
    log_every: int = 10
    on_nonfinite: OnNonfinite = "stop"
    # A step whose global loss is above this many times the median of the previous
    # loss_spike_window steps' is refused like a non-finite one (0 = no spike test).
    loss_spike_factor: float = 0.0
    loss_spike_window: int = 10

    def validate(self, cfg: Config) -> None:
        for k in ("steps", "global_batch_size", "micro_batch_size"):
            _require(getattr(self, k) > 0, f"train.{k}", f"must be > 0, got {getattr(self, k)}")
        _require(
            self.micro_batch_size <= self.global_batch_size,
            "train.micro_batch_size",
            f"{self.micro_batch_size} is larger than train.global_batch_size={self.global_batch_size}",
        )
        _require(self.lr > 0, "train.lr", f"must be > 0, got {self.lr}")
        _require(0 <= self.min_lr <= self.lr, "train.min_lr", f"must be within [0, train.lr], got {self.min_lr}")
        _require(0 <= self.warmup_steps, "train.warmup_steps", "must be >= 0")
        _require(0 <= self.beta1 < 1, "train.beta1", "must be in [0, 1)")
        _require(0 <= self.beta2 < 1, "train.beta2", "must be in [0, 1)")
        _require(self.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping)")
        _require_one_of(self.mixed_precision, MixedPrecision, "train.mixed_precision")
        _require_one_of(self.device, Device, "train.device")
        _require(self.log_every > 0, "train.log_every", "must be > 0")
        _require_one_of(self.on_nonfinite, OnNonfinite, "train.on_nonfinite")
        factor = self.loss_spike_factor
        _require(factor == 0 or factor > 1, "train.loss_spike_factor", f"must be 0 (off) or above 1, got {factor}")
        _require(self.loss_spike_window > 0, "train.loss_spike_window", f"must be > 0, got {self.loss_spike_window}")


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = "runs/demo/checkpoints"
    # Save every N steps (0 = off), or "auto": the interval that maximises the expected goodput
    # from measured save and restart costs and the lineage's failure rate (checkpoint/cadence.py).
    interval_steps: int | Literal["auto"] = 50
    interval_seconds: float = 0.0
    # interval_steps = "auto": the failure-rate prior for a fresh job (one failure per this many
    # seconds, worth auto_prior_weight_seconds of observed time) and the bounds of the interval.
    auto_prior_mtbf_seconds: float = 3600.0
    auto_prior_weight_seconds: float = 600.0
    auto_min_steps: int = 1
    auto_max_steps: int = 10000
    keep_last: int = 3
    keep_every: int = 0
    resume: str = "latest"  # latest | none | <step>
    # Load only commits `ckpt audit` certified (every start and restart; newer ones are passed over
    # and kept). With commits but none certified, a start stops with exit 2 rather than start over.
    resume_certified_only: bool = False
    mode: SaveMode = "async"
    # Where an async save is written: "thread" (a thread of the training process) or "process"
    # (a persistent writer process per rank fed through shared memory: the save's Python work
    # never holds the training process's GIL; see checkpoint/writer_process.py).
    writer: Writer = "thread"
    # A local checkpoint.dir's shard files are written around the page cache (O_DIRECT, through
    # aligned buffers): less CPU per byte on the cores that train. A file system that refuses
    # O_DIRECT is written through the page cache either way. Object stores: no effect.
    direct_io: bool = True
    preempt_grace_seconds: float = 60.0
    s3_endpoint_url: str = ""
    storage_timeout_seconds: float = 20.0
    storage_retries: int = 3
    # Per-save deadline: a save still writing this long after it started no longer holds up
    # training (the next save is skipped with checkpoint_failed). Storage time is never hang time.
    save_timeout_seconds: float = 600.0
    # Run-defining keys (Config.run_identity) a resume may change on purpose, e.g.
    # ["train.global_batch_size"]; also "a,b" on the command line. Recorded in a config_changed event.
    allow_changes: list[str] = field(default_factory=list)
    # The local tier: a node-local directory (/dev/shm, NVMe) that takes every save as per-rank
    # copies; checkpoint.dir then gets every remote_every-th save (and always the final and the
    # preemption save). A restart within the same launch, at the same world size, with every
    # rank's copy present and verified, loads locally; anything else loads from checkpoint.dir.
    local_dir: str = ""
    remote_every: int = 1
    # The peer tier (with local_dir and ELASTIC_TRAINER_CHECKPOINT_KEY): every local copy is also
    # sent to this many other nodes' memory; a restart at any world size loads from the nodes' copies
    # when every shard of a step is on a surviving node (0 = off). See checkpoint/peer_tier.py.
    peer_replicas: int = 1

    def validate(self, cfg: Config) -> None:
        _require(bool(self.dir), "checkpoint.dir", "must not be empty")
        if self.interval_steps != "auto":
            _require(
                self.interval_steps >= 0,
                "checkpoint.interval_steps",
                'must be >= 0 (0 disables step-based saves), or "auto"',
            )
        for k in ("auto_prior_mtbf_seconds", "auto_prior_weight_seconds"):
            _require(getattr(self, k) > 0, f"checkpoint.{k}", f"must be > 0, got {getattr(self, k)}")
        _require(self.auto_min_steps >= 1, "checkpoint.auto_min_steps", f"must be >= 1, got {self.auto_min_steps}")
        _require(
            self.auto_max_steps >= self.auto_min_steps,
            "checkpoint.auto_max_steps",
            f"must be >= checkpoint.auto_min_steps ({self.auto_min_steps}), got {self.auto_max_steps}",
        )
        _require(
            self.interval_seconds >= 0, "checkpoint.interval_seconds", "must be >= 0 (0 disables time-based saves)"
        )
        _require(self.keep_last >= 1, "checkpoint.keep_last", f"must be >= 1, got {self.keep_last}")
        _require(self.keep_every >= 0, "checkpoint.keep_every", "must be >= 0")
        _require_one_of(self.mode, SaveMode, "checkpoint.mode")
        _require_one_of(self.writer, Writer, "checkpoint.writer")
        _require(
            self.writer == "thread" or not self.dir.startswith("memory://"),
            "checkpoint.writer",
            "process needs storage another process can reach; memory:// lives in one process",
        )
        _require(
            self.writer == "thread" or torch_release() >= PROCESS_WRITER_MIN_TORCH,
            "checkpoint.writer",
            f"process needs torch>={'.'.join(map(str, PROCESS_WRITER_MIN_TORCH))} (installed: "
            f"{'.'.join(map(str, torch_release()))}); use thread",
        )
        for k in ("preempt_grace_seconds", "storage_timeout_seconds"):
            _require(getattr(self, k) > 0, f"checkpoint.{k}", "must be > 0")
        _require(self.storage_retries >= 0, "checkpoint.storage_retries", "must be >= 0")
        _require(self.save_timeout_seconds > 0, "checkpoint.save_timeout_seconds", "must be > 0")
        self._validate_resume_and_tiers()

    def _validate_resume_and_tiers(self) -> None:
        """The keys of what a resume may take (``allow_changes``, ``resume``) and of the tiers
        (``dir``, the local tier, the peer tier, the S3 endpoint)."""
        for key in self.allow_changes:
            section, _, name = key.partition(".")
            known = (
                {f.name for f in dataclasses.fields(_SECTION_TYPES[section])} if section in _SECTION_TYPES else set()
            )
            _require(name in known, "checkpoint.allow_changes", f"{key!r} is not a config key (section.key)")
        if self.resume not in ("latest", "none"):
            _require(
                self.resume.isdigit(),
                "checkpoint.resume",
                f"expected 'latest', 'none' or a step number, got {self.resume!r}",
            )
        check_uri(self.dir, "checkpoint.dir")
        _require(self.remote_every >= 1, "checkpoint.remote_every", f"must be >= 1, got {self.remote_every}")
        _require(
            self.remote_every == 1 or bool(self.local_dir),
            "checkpoint.remote_every",
            "needs checkpoint.local_dir (without a local tier every save goes to checkpoint.dir)",
        )
        _require(self.peer_replicas >= 0, "checkpoint.peer_replicas", f"must be >= 0, got {self.peer_replicas}")
        if self.local_dir:
            check_local_dir(self.local_dir, self.dir)
        if self.s3_endpoint_url:
            refuse_credentials(self.s3_endpoint_url, "checkpoint.s3_endpoint_url")
            _require(
                self.s3_endpoint_url.startswith(("http://", "https://")),
                "checkpoint.s3_endpoint_url",
                f"expected an http(s) URL, got {self.s3_endpoint_url!r}",
            )


@dataclass(frozen=True)
class ElasticConfig:
    nnodes: str = "1"
    nproc_per_node: int = 2
    max_restarts: int = 3
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = ""
    rdzv_id: str = "elastic-trainer"
    # Multi-node rendezvous settings (torchrun's --rdzv-conf), used when an endpoint is given.
    # The default re-forms the group within seconds of a node loss or join (torch's defaults:
    # ~45 s). Run the store with 'elastic-trainer store' so that no node's loss stops the job
    # (docs/elasticity.md); add is_host=false to require it. A node silent for longer than
    # keep_alive_interval x keep_alive_max_attempt (2 s; a heartbeat every 0.25 s) is gone.
    rdzv_conf: str = "last_call_timeout=1,keep_alive_interval=0.25,keep_alive_max_attempt=8"
    # How often a supervisor reads the rendezvous state: how soon a training node sees a node
    # waiting to join, and a waiting node sees its round complete (torch's own: 1 s).
    rdzv_poll_seconds: float = 0.2
    hang_timeout_seconds: float = 120.0
    monitor_interval_seconds: float = 0.1  # detection latency of a dead worker; polls are cheap (waitpid)
    # Start workers by forking a pre-imported interpreter (the supervisor's zygote) instead of a
    # fresh 'python -m ...' that imports torch again: restarts skip the import (launch only).
    warm_start: bool = True
    # When a replay (train.on_nonfinite = "replay") does not reproduce an anomaly, the node whose
    # rank's state differed leaves the job (exit 69) and the others re-form the group without it,
    # from a commit of the replayed step.
    exclude_corrupt_node: bool = False

    def validate(self, cfg: Config) -> None:
        parse_nnodes(self.nnodes)
        _require(
            not self.exclude_corrupt_node or cfg.train.on_nonfinite == "replay",
            "elastic.exclude_corrupt_node",
            f'needs train.on_nonfinite = "replay" (the replay is what names the node), got {cfg.train.on_nonfinite!r}',
        )
        _require(self.nproc_per_node >= 1, "elastic.nproc_per_node", "must be >= 1")
        _require(self.max_restarts >= 0, "elastic.max_restarts", "must be >= 0")
        parse_rdzv_conf(self.rdzv_conf)
        _require(self.hang_timeout_seconds >= 5, "elastic.hang_timeout_seconds", "must be >= 5")
        _require(self.monitor_interval_seconds > 0, "elastic.monitor_interval_seconds", "must be > 0")
        own = self.rdzv_backend == contract.OWN_RDZV_BACKEND  # its poll is its own; torch's reads at least every 1 s
        _require(
            0 < self.rdzv_poll_seconds <= (MAX_OWN_POLL_SECONDS if own else 1),
            "elastic.rdzv_poll_seconds",
            f"must be > 0 and <= {MAX_OWN_POLL_SECONDS:g} (rdzv_backend {contract.OWN_RDZV_BACKEND})"
            if own
            else "must be > 0 and <= 1 (torch's own poll)",
        )


@dataclass(frozen=True)
class MetricsConfig:
    port: int = 9400
    host: str = "0.0.0.0"

    def validate(self, cfg: Config) -> None:
        _require(0 <= self.port <= 65535, "metrics.port", f"must be in 0..65535 (0 disables), got {self.port}")


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def run_identity(self) -> dict[str, Any]:
        """The resolved settings that define *which run* a checkpoint belongs to, as dotted
        keys: the whole model (with the *content* of ``model.hf_config``), the data source, the
        seed, the global batch and the sequence length. Recorded in every manifest; a resume
        with any of them changed is refused before start unless ``checkpoint.allow_changes``
        names it (see :func:`run_changes`)."""
        out: dict[str, Any] = {f"model.{k}": v for k, v in dataclasses.asdict(self.model).items()}
        if self.model.hf_config:
            out["model.hf_config"] = _file_identity(self.model.hf_config, "config.json")
        for k in ("path", "format", "dtype", "column", "tokenizer", "eos_token"):
            out[f"data.{k}"] = getattr(self.data, k)
        out["train.seed"] = self.train.seed
        out["train.global_batch_size"] = self.train.global_batch_size
        return out

    def model_fingerprint(self) -> str:
        """Hash of everything that fixes the shape of the training state (model + optimizer kind)."""
        model = dataclasses.asdict(self.model)
        model.pop("init_from")  # where the first weights came from does not shape the state
        payload = json.dumps({"model": model}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _file_identity(path: str, default_name: str) -> str:
    """``sha256:<hex>`` of a file's content (a directory means its ``default_name``), or the
    path itself when it cannot be read (the worker then reports the missing file)."""
    target = os.path.join(path, default_name) if os.path.isdir(path) else path
    try:
        with open(target, "rb") as f:
            return "sha256:" + hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return path


def run_changes(
    recorded: dict[str, Any], current: dict[str, Any], allowed: list[str]
) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """(refused, allowed) changes between a checkpoint's run identity and the config's, each
    ``(key, checkpoint value, config value)``. Keys absent from ``recorded`` are not compared. Pure."""
    refused: list[tuple[str, Any, Any]] = []
    ok: list[tuple[str, Any, Any]] = []
    for key in sorted(recorded):
        if key in current and recorded[key] != current[key]:
            (ok if key in allowed else refused).append((key, recorded[key], current[key]))
    return refused, ok


def check_run_identity(cfg: Config, recorded: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Raise RunChangedError naming every run-defining key that differs from a checkpoint's
    ``recorded`` identity (unless ``checkpoint.allow_changes`` names it); returns the allowed
    changes (for the ``config_changed`` event)."""
    from .errors import RunChangedError

    refused, allowed = run_changes(recorded, cfg.run_identity(), cfg.checkpoint.allow_changes)
    if refused:
        raise RunChangedError(refused)
    return allowed


_SECTION_TYPES = {
    "run": RunConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "elastic": ElasticConfig,
    "metrics": MetricsConfig,
}


# String keys that also take an integer (``nnodes = 2`` means "2").
_INT_AS_STR = ("elastic.nnodes",)


def _coerce(key: str, value: Any, typ: Any) -> Any:
    if isinstance(typ, str):
        typ = eval(typ, {**vars(typing), "list": list, "dict": dict}, {})  # noqa: S307 - own annotations
    origin = typing.get_origin(typ)
    if origin is Literal:  # one of a few words: the section's validate names them
        typ = str
    if origin is list:
        (item,) = typing.get_args(typ)
        if isinstance(value, str) and key == "checkpoint.allow_changes":  # --set checkpoint.allow_changes=a,b
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        # Only ``int | Literal[...]`` (a number or a keyword such as "auto").
        arms = typing.get_args(typ)
        words = [w for a in arms if typing.get_origin(a) is Literal for w in typing.get_args(a)]
        assert int in arms and len(arms) == 2 and words, f"unsupported config type {typ!r} at {key}"
        if isinstance(value, str) and value in words:
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(
            key, f"expected an integer or {' or '.join(repr(w) for w in words)}, got {type(value).__name__} {value!r}"
        )
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {type(value).__name__} {value!r}")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if typ is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key.endswith(".resume"):
            return str(value)
        if isinstance(value, int) and not isinstance(value, bool) and key in _INT_AS_STR:
            return str(value)
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {type(value).__name__} {value!r}")
        return value
    raise AssertionError(f"unsupported config type {typ!r} at {key}")


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(item, "an override must look like section.key=value")
    dotted, raw = item.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(dotted, "an override key must be section.key")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare string
    return parts, value


def with_paths(data: dict[str, Any], name: str | None) -> dict[str, Any]:
    """``data`` with the run's paths filled in where it sets none: ``run.dir`` = ``runs/<name>``
    (``name``: the config file's or the script's stem; None keeps the built-in default) and
    ``checkpoint.dir`` = ``<run.dir>/checkpoints``. So two runs never share a directory by accident,
    and ``elastic-trainer run`` derives the same paths as the script it starts."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    run = out.setdefault("run", {})
    if isinstance(run, dict) and not run.get("dir") and name:
        run["dir"] = f"runs/{name}"
    ckpt = out.setdefault("checkpoint", {})
    if isinstance(run, dict) and isinstance(ckpt, dict) and not ckpt.get("dir") and run.get("dir"):
        ckpt["dir"] = f"{str(run['dir']).rstrip('/')}/checkpoints"
    return out


def run_name(path: str | os.PathLike | None) -> str | None:
    """The name :func:`with_paths` derives from a config file or a script (its stem; a module's last part)."""
    if not path:
        return None
    base = os.path.basename(str(path).rstrip("/"))
    stem = os.path.splitext(base)[0] if base.endswith((".py", ".toml")) else base.rsplit(".", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem) or None


def config_from_dict(data: dict[str, Any], name: str | None = None) -> Config:
    """Build and validate a Config from a nested dict (as parsed from TOML); paths derived from
    ``name`` where the dict sets none (:func:`with_paths`)."""
    data = with_paths(data, name)
    sections = {}
    for name, values in data.items():
        if name not in _SECTION_TYPES:
            raise ConfigError(name, f"unknown section (known: {', '.join(_SECTION_TYPES)})")
        if not isinstance(values, dict):
            raise ConfigError(name, "a section must be a table")
        cls = _SECTION_TYPES[name]
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in values.items():
            if key not in hints:
                raise ConfigError(f"{name}.{key}", f"unknown key (known: {', '.join(hints)})")
            kwargs[key] = _coerce(f"{name}.{key}", value, hints[key])
        sections[name] = cls(**kwargs)
    cfg = Config(**sections)
    validate(cfg)
    return cfg


def load_config(
    path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = (), name: str | None = None
) -> Config:
    """Load TOML ``path`` (or defaults when None), apply overrides, derive the paths it does not
    set from ``name`` (default: the config file's stem), validate."""
    return config_from_dict(apply_overrides(read_toml(path), overrides), name if name is not None else run_name(path))


def keys_set(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """``section.key`` of every setting TOML file ``path`` and ``overrides`` set, sorted."""
    data = apply_overrides(read_toml(path), overrides)
    return sorted(f"{s}.{k}" for s, values in data.items() if isinstance(values, dict) for k in values)


def split_overrides(raw: str) -> list[str]:
    """The overrides of ``ELASTIC_TRAINER_SET``: ``section.key=value`` items, one per line or
    separated by ``;`` (blank items ignored). Pure."""
    return [item.strip() for item in re.split(r"[;\n]", raw) if item.strip()]


@dataclass(frozen=True)
class EnvSettings:
    """What the environment sets for any launcher: a config file (``ELASTIC_TRAINER_CONFIG``)
    and ``--set``-style overrides (``ELASTIC_TRAINER_SET``). Both count as the command line's."""

    path: str | None = None
    overrides: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, environ: typing.Mapping[str, str] | None = None) -> EnvSettings:
        env = os.environ if environ is None else environ
        return cls(
            env.get(contract.CONFIG_FILE_ENV) or None, tuple(split_overrides(env.get(contract.OVERRIDES_ENV, "")))
        )

    def data(self) -> dict[str, Any]:
        """The sections the file and the overrides set, as parsed; ConfigError naming the variable
        (a missing or unparsable file, an item that is not ``section.key=value``)."""
        data = read_toml(self.path, key=contract.CONFIG_FILE_ENV)
        try:
            return apply_overrides(data, self.overrides)
        except ConfigError as e:
            raise ConfigError(contract.OVERRIDES_ENV, f"{e} (items: section.key=value, one per line or ';')") from None


def toml_text(cfg: typing.Mapping[str, typing.Mapping[str, Any]]) -> str:
    """``cfg`` (sections of scalars and lists; None values left out) as TOML: what :func:`read_toml` reads back."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(str(v))

    lines = []
    for section, values in cfg.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {value(v)}" for k, v in values.items() if v is not None]
        lines.append("")
    return "\n".join(lines)


def read_toml(path: str | os.PathLike | None, key: str = "<config file>") -> dict[str, Any]:
    """The sections of TOML file ``path`` as parsed ({} for None), or ConfigError at ``key`` naming the file."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(key, f"no such file: {path}") from None
        except IsADirectoryError:
            raise ConfigError(key, f"{path} is a directory, not a TOML file") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(key, f"{path} is not valid TOML: {e}") from None
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``data`` (nested sections, as parsed) with ``section.key=value`` overrides applied."""
    for item in overrides:
        (section, key), value = _parse_override(item)
        data.setdefault(section, {})
        if not isinstance(data[section], dict):
            raise ConfigError(section, "a section must be a table")
        data[section][key] = value
    return data


# The oldest torch whose writer process (DCP's process executor) the process writer is proven on:
# on torch 2.11 its saves do not finish.
PROCESS_WRITER_MIN_TORCH = (2, 13)


def torch_release() -> tuple[int, int]:
    """The installed torch's (major, minor), read from its package metadata (no torch import)."""
    from importlib.metadata import version

    major, minor = version("torch").split(".")[:2]
    digits = re.match(r"\d+", minor)
    assert digits is not None, f"torch minor version {minor!r}"
    return int(major), int(digits.group())


def _require(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(key, message)


def _require_one_of(value: str, words: Any, key: str) -> None:
    """``value`` is one of the ``Literal`` ``words``."""
    allowed = typing.get_args(words)
    _require(value in allowed, key, f"expected {', '.join(allowed[:-1])} or {allowed[-1]}, got {value!r}")


def parse_nnodes(value: str, key: str = "elastic.nnodes") -> tuple[int, int]:
    parts = value.split(":")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(key, f"expected N or MIN:MAX, got {value!r}") from None
    if len(nums) == 1:
        nums = nums * 2
    _require(
        len(nums) == 2 and 1 <= nums[0] <= nums[1], key, f"expected N or MIN:MAX with 1 <= MIN <= MAX, got {value!r}"
    )
    return nums[0], nums[1]


# elastic.rdzv_poll_seconds under the package's own rendezvous: a job of thousands of nodes reads
# it every second or two (docs/elasticity.md, "How many nodes one rendezvous carries")
MAX_OWN_POLL_SECONDS = 10.0
_RDZV_INT_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_max_attempt",
    "read_timeout",
    "timeout",
)
# Decimal seconds: torch's handlers read whole seconds; the launcher sets the exact interval on it.
_RDZV_SECONDS_KEYS = ("keep_alive_interval",)
_RDZV_OTHER_KEYS = (
    "is_host",
    "store_type",
    "local_addr",
    "protocol",
    "cacert",
    "cert",
    "key",
    "etcd_prefix",
    "ca_cert",
    "ssl_cert",
    "ssl_cert_key",
)


def _positive_decimal(value: str) -> bool:
    try:
        return 0 < float(value) < math.inf
    except ValueError:
        return False


def parse_rdzv_conf(value: str, key: str = "elastic.rdzv_conf") -> dict[str, str]:
    """``k=v,k=v`` → dict, checking names and value types torch's rendezvous handlers read."""
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in value.split(","))):
        k, sep, v = item.partition("=")
        k, v = k.strip(), v.strip()
        _require(bool(sep and k), key, f"expected key=value items separated by commas, got {item!r}")
        _require(
            k in _RDZV_INT_KEYS + _RDZV_SECONDS_KEYS + _RDZV_OTHER_KEYS,
            key,
            f"unknown rendezvous setting {k!r} "
            f"(known: {', '.join(_RDZV_INT_KEYS + _RDZV_SECONDS_KEYS + _RDZV_OTHER_KEYS)})",
        )
        if k in _RDZV_SECONDS_KEYS:
            _require(_positive_decimal(v), key, f"{k} must be a positive number of seconds, got {v!r}")
        elif k in _RDZV_INT_KEYS:
            _require(v.isdigit() and int(v) > 0, key, f"{k} must be a positive integer (seconds or count), got {v!r}")
        if k == "is_host":
            _require(
                v.lower() in ("true", "false", "1", "0", "yes", "no"), key, f"is_host must be true or false, got {v!r}"
            )
        out[k] = v
    return out


def validate(cfg: Config) -> None:
    """Every section's checks, in the order of the sections: each section's ``validate(cfg)``
    gets the whole config for the checks that span sections (``data.dtype`` against
    ``model.vocab_size``, ``checkpoint.allow_changes`` against every section's keys). Pure;
    raises ConfigError naming the key."""
    for f in dataclasses.fields(cfg):
        getattr(cfg, f.name).validate(cfg)


_SUPPORTED_SCHEMES = ("file", "s3", "memory")
_S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # S3's bucket naming rules


def refuse_credentials(url: str, key: str) -> None:
    """A URL's user-info (``scheme://user:secret@host/...``) is a credential: refused before
    anything uses it, and never echoed (the message shows the URL without it). A secret may hold a
    ``/`` (AWS secrets do), so an S3 URL whose bucket part holds a ``:`` counts too (buckets have
    none), and an endpoint URL any ``@``."""
    scheme, sep, rest = url.partition("://")
    netloc = rest.split("/", 1)[0]
    at = rest.rfind("@")
    if sep and ("@" in netloc or (scheme == "s3" and ":" in netloc) or (scheme in ("http", "https") and at >= 0)):
        shown = f"{scheme}://***" + (rest[at:] if at >= 0 else "")
        raise ConfigError(
            key,
            f"credentials in a URL are not accepted (not used, not logged): {shown}; give them through the "
            "environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) or the node's role"
            + ("; an S3 server's host:port goes in checkpoint.s3_endpoint_url" if scheme == "s3" else ""),
        )


def check_local_dir(local_dir: str, ckpt_dir: str) -> None:
    """checkpoint.local_dir must be a plain node-local path, apart from checkpoint.dir."""
    key = "checkpoint.local_dir"
    _require("://" not in local_dir, key, f"must be a node-local path (e.g. /dev/shm/ckpt), not a URL: {local_dir!r}")
    if "://" not in ckpt_dir or ckpt_dir.startswith("file://"):
        a = os.path.realpath(local_dir)
        b = os.path.realpath(ckpt_dir.removeprefix("file://"))
        inside = a == b or a.startswith(b.rstrip(os.sep) + os.sep) or b.startswith(a.rstrip(os.sep) + os.sep)
        _require(not inside, key, f"must not overlap checkpoint.dir ({ckpt_dir!r}): the tiers are separate stores")


def check_uri(uri: str, key: str = "checkpoint.dir") -> str:
    """Validate a checkpoint location; returns its protocol. Raises ConfigError naming ``key``."""
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError(key, "must be a non-empty path or URL")
    if "://" not in uri:
        return "file"
    refuse_credentials(uri, key)
    proto, rest = uri.split("://", 1)
    if proto not in _SUPPORTED_SCHEMES:
        raise ConfigError(
            key, f"unsupported scheme {proto!r} in {uri!r} (supported: local path, file://, s3://, memory://)"
        )
    if proto == "s3":
        bucket = rest.split("/", 1)[0]
        if not _S3_BUCKET.fullmatch(bucket):
            raise ConfigError(key, f"invalid S3 bucket name {bucket!r} in {uri!r}")
    if proto == "file" and not rest.startswith("/"):
        raise ConfigError(key, f"file:// URLs must be absolute, got {uri!r}")
    return proto


def check_world_size(cfg: Config, world_size: int) -> None:
    """A global batch must give every rank work: checked against the real world size at start."""
    _require(
        cfg.train.global_batch_size >= world_size,
        "train.global_batch_size",
        f"{cfg.train.global_batch_size} cannot be split across {world_size} ranks (need >= 1 sample per rank)",
    )


def check_max_world_size(cfg: Config, max_world: int) -> None:
    check_world_size(cfg, max_world)
