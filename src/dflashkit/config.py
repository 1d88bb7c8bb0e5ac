"""One typed run config: YAML file + dotted command-line overrides (``train.lr=3e-4``).

Unknown keys are errors (with the valid keys listed), values are type-checked by pydantic, and every
problem ends in one `ConfigError` line that says where and what to do. The cross-checks between data
manifest, drafter and target (block size, mask token, layer ids, vocabulary, template) happen when a
run starts, in `dflashkit.train.trainer`, where all three are known.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dflashkit.errors import ConfigError

LOSS_NAMES = ("ce", "kl", "tv", "lk")  # train.loss: see dflashkit.train.loss


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TargetSection(Section):
    path: str = "embedded"  # "embedded" or a transformers model folder
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU


class SourceSpec(Section):
    """One prompt source of a mixture (`data.sources`): how many of its prompts to take, and how to
    answer them. Give `count` (prompts) or `weight` (a share of `data.max_prompts`), or neither (all)."""

    source: str  # "chitchat", "sharegpt", "mtbench", "self" or a file
    name: str | None = None  # what the manifest and the records call it (default: `source`)
    format: Literal["auto", "chat", "sharegpt", "prompts"] = "auto"
    count: int | None = Field(None, ge=1)
    weight: float | None = Field(None, gt=0)
    max_turns: int | None = Field(None, ge=1)  # user turns kept per conversation; None: all
    samples_per_prompt: int = Field(1, ge=1)  # training records per prompt (sampled replies)
    temperature: float = Field(0.0, ge=0)  # 0: greedy
    top_p: float = Field(1.0, gt=0, le=1)
    val_fraction: float | None = Field(None, ge=0, le=1)  # None: data.val_fraction
    # A fixed number of held-out prompts instead: the first of the seeded order, so that a larger count
    # (or another dataset with the same seed) holds out the same prompts and never trains on them.
    val_count: int | None = Field(None, ge=0)
    # Training prompts start after the first `skip` of the seeded order past the held-out ones: a later round
    # takes prompts an earlier one did not (greedy replies repeat on the same prompt), the held-out set stays.
    skip: int = Field(0, ge=0)
    # source "self": the target writes the user turns itself (`dflashkit.data.self_prompts`): each turn
    # starts with one of `seeds` (in turn; none: the target starts it), the target writes on until its end
    # token (at most `prompt_max_tokens`, sampled with `prompt_temperature` and `prompt_top_p`), and
    # `suffix` is appended (an answer-format instruction, say).
    seeds: list[str] = Field(default_factory=list)
    suffix: str = ""
    prompt_max_tokens: int = Field(128, ge=8)
    prompt_temperature: float = Field(1.0, gt=0)
    prompt_top_p: float = Field(0.95, gt=0, le=1)

    @property
    def label(self) -> str:
        """The source's name in the manifest, the records and the held-out metrics."""
        return self.name or self.source

    @model_validator(mode="after")
    def _check(self) -> SourceSpec:
        if self.source != "self" and (self.seeds or self.suffix):
            raise ValueError(
                f"source {self.source!r}: seeds and suffix are settings of source 'self' (prompts the target "
                "writes); remove them"
            )
        if self.source == "self" and self.count is None and self.weight is None:
            raise ValueError("source 'self': give count (how many prompts the target writes) or weight")
        if self.count is not None and self.weight is not None:
            raise ValueError(f"source {self.source!r}: give count or weight, not both")
        if self.val_count is not None and self.val_fraction is not None:
            raise ValueError(f"source {self.source!r}: give val_count or val_fraction, not both")
        if self.val_count is not None and self.count is not None and self.val_count > self.count:
            raise ValueError(
                f"source {self.source!r}: val_count {self.val_count} is above count {self.count}"
            )
        if self.skip and self.source == "self":
            raise ValueError(
                "source 'self': skip passes over prompts of a file or dataset; the target writes new prompts "
                "with another data.sample_seed"
            )
        if self.skip and self.val_count is None:
            raise ValueError(
                f"source {self.source!r}: skip needs a fixed held-out set (val_count, e.g. 0), so that the "
                "held-out prompts stay the same"
            )
        if self.samples_per_prompt > 1 and self.temperature == 0:
            raise ValueError(
                f"source {self.source!r}: samples_per_prompt={self.samples_per_prompt} with temperature 0 "
                "would repeat one greedy reply; set a temperature (e.g. 0.8)"
            )
        return self


def unique_source_labels(sources: list[SourceSpec]) -> list[SourceSpec]:
    """A mixture's sources, checked: no two share a name (`SourceSpec.label`)."""
    labels = [s.label for s in sources]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise ValueError(f"data.sources names {', '.join(twice)} more than once; give each a distinct `name`")
    return sources


class DataSection(Section):
    """Where the prepared dataset lives, and how `dflashkit prepare --config` makes it (the fields
    besides `dir` and `features_dir` are `dflashkit.data.dataset.PrepareSettings` fields).

    Prompts come from one source (`source`, `format`, `max_prompts`, `max_turns`, `samples_per_prompt`,
    `temperature`, `top_p`) or from a mixture (`sources`, which then replaces those fields)."""

    dir: str = "runs/embedded/data"
    # A `dflashkit capture` folder: training reads target features and labels from it instead of
    # running the target (None: online, the target runs in-process).
    features_dir: str | None = None
    source: str = "chitchat"  # "chitchat", "sharegpt", "mtbench" or a file
    format: Literal["auto", "chat", "sharegpt", "prompts"] = "auto"
    sources: list[SourceSpec] = Field(default_factory=list)
    _labels = field_validator("sources")(unique_source_labels)
    max_prompts: int | None = Field(400, ge=1)
    val_fraction: float = Field(0.1, ge=0, le=1)
    max_turns: int | None = Field(None, ge=1)
    samples_per_prompt: int = Field(1, ge=1)
    max_new_tokens: int = Field(128, ge=1)
    max_prompt_tokens: int = Field(1024, ge=1)
    batch_size: int = Field(16, ge=1)  # replies generated at once (slots, or rows per generate call)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # generation only
    backend: Literal["auto", "slots", "hf"] = "auto"  # auto: slots for Llama-family targets, else hf
    enable_thinking: bool = False
    seed: int = 0  # selection and held-out split (and sampling, unless sample_seed is given)
    sample_seed: int | None = None  # sampling only: new replies (and self-written prompts), same held-out


class DrafterSection(Section):
    layers: int = Field(1, ge=1)
    block_size: int = Field(8, ge=2)
    num_target_layers: int = Field(3, ge=1)
    target_layer_ids: list[int] | None = None  # default: round(1 + i*(L-4)/(n-1))
    mask_token_id: int | None = None  # default: the target's documented mask token
    init: str | None = None  # start from an existing drafter checkpoint (z-lab layout)
    sliding_window: int | None = None


class TrainSection(Section):
    epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, ge=1)  # overrides epochs when set
    batch_size: int = Field(1, ge=1)  # packed rows per micro-batch
    grad_accum: int = Field(1, ge=1)
    max_len: int = Field(512, ge=16)  # tokens per packed row
    num_anchors: int = Field(64, ge=1)  # blocks per row
    lr: float = Field(6e-4, gt=0)
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(1.0, gt=0)
    gamma: float | None = None  # position decay; default 7 for B=16, scaled with B otherwise
    loss_weighting: Literal["decay", "dpace"] = "decay"
    dpace_alpha: float = Field(0.5, ge=0, le=1)
    labels: Literal["target", "dataset"] = "target"
    # Distillation, the older name of train.loss {ce: 1 - alpha, kl: alpha}. 0: off.
    distill: float = Field(0.0, ge=0, le=1)
    # Each slot's loss: ce (the target's argmax), kl (KL(p_T || q_T)), tv (total variation), lk (LK's
    # adaptive KL/TV), or a weighted mix such as {ce: 0.1, tv: 0.9}; p_T, q_T the target's and the drafter's
    # distributions at loss_temperature. kl, tv and lk read the target's last layer (through its final norm
    # and lm_head: online, or from a capture made with this config, which stores it).
    loss: str | dict[str, float] = "ce"
    loss_temperature: float = Field(1.0, gt=0)
    # The temperature and proposal serving uses: validation reports the served-order expected acceptance
    # length under them beside the greedy one, and best/ is chosen by it when serve_temperature > 0.
    serve_temperature: float = Field(0.0, ge=0)
    serve_draft_sampling: Literal["marginal", "argmax"] = "marginal"
    chunk_blocks: int = Field(32, ge=1)  # blocks per loss chunk (full-vocab logits never all at once)
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(100, ge=1)
    save_every: int = Field(100, ge=1)
    keep_last: int = Field(2, ge=1)
    seed: int = 0
    cache_features: bool = False  # keep each training row's target features after its first pass (small data)
    autocast: Literal["auto", "bf16", "off"] = "auto"  # auto: bf16 on GPU, off on CPU
    # Compile each drafter layer and each loss chunk whole (fuses norms, RoPE, SwiGLU and the softmax around
    # the matmuls; warmed before the first step like the attention). auto: on with flex on a GPU, except FSDP.
    compile: Literal["auto", "on", "off"] = "auto"
    tensorboard: bool = False

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, v: str | dict[str, float]) -> str | dict[str, float]:
        names = ", ".join(LOSS_NAMES)
        weights = {v: 1.0} if isinstance(v, str) else v
        unknown = sorted(set(weights) - set(LOSS_NAMES))
        if unknown:
            raise ValueError(
                f"unknown loss {', '.join(unknown)}; use {names} or a mix such as {{ce: 0.1, tv: 0.9}}"
            )
        if any(w < 0 for w in weights.values()) or not sum(weights.values()) > 0:
            raise ValueError(f"the weights of a loss mix must be >= 0 with a positive sum, not {weights}")
        return v

    def loss_weights(self) -> dict[str, float]:
        """Each slot's loss as {name: weight}: train.loss, or train.distill = a as {ce: 1 - a, kl: a}."""
        if self.distill > 0:
            return {"ce": 1.0 - self.distill, "kl": self.distill}
        return {self.loss: 1.0} if isinstance(self.loss, str) else dict(self.loss)

    def reads_target_distribution(self) -> bool:
        """Whether a run needs the target's whole distribution at each slot: a kl, tv or lk loss, or the
        metric at a serving temperature above 0."""
        return any(n != "ce" and w > 0 for n, w in self.loss_weights().items()) or self.serve_temperature > 0

    @field_validator("autocast", "compile", mode="before")
    @classmethod
    def _yaml_booleans(cls, v: Any, info: ValidationInfo) -> Any:
        """YAML reads a bare off/on as a boolean."""
        on = "bf16" if info.field_name == "autocast" else "on"
        return {False: "off", True: on}.get(v, v) if isinstance(v, bool) else v


class AttentionSection(Section):
    backend: Literal["auto", "flex", "sdpa", "eager"] = "auto"  # auto: flex on GPU, sdpa on CPU
    dense_budget_gib: float = Field(4.0, gt=0)


class RunSection(Section):
    out_dir: str = "runs/embedded"
    device: str = "auto"  # auto: cuda if available, else cpu
    allow_env_drift: bool = False
    # A portable compile cache file: loaded before warm-up when it exists and was built by this environment
    # (torch build, CUDA, triton, GPU type), written after warm-up when it was missing or stale.
    compile_cache: str | None = None


class DistributedSection(Section):
    """Data-parallel training under torchrun (`dflashkit train --nproc N`); a one-process run ignores it."""

    strategy: Literal["ddp", "fsdp"] = "ddp"  # fsdp: FSDP2 shards weights, gradients and optimizer state
    fsdp_param_dtype: Literal["bfloat16", "float32"] = (
        "bfloat16"  # FSDP compute copy; gradients reduce in fp32
    )
    timeout_minutes: float = Field(30.0, gt=0)  # a collective that waits longer fails the run


class EvalSection(Section):
    max_prompts: int = Field(16, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0)


# Fan-out (`dflashkit fanout`): one target computes each micro-batch's features once, and several drafter
# variants train on them at the same time, as threads of one process (dflashkit.train.fanout).
# Keys the variants share, so that they may not override them: one target, one dataset, one batch stream.
FANOUT_SHARED_KEYS = (
    "target.",
    "data.",
    "run.",
    "distributed.",
    "fanout.",
    "train.batch_size",
    "train.max_len",
    "train.seed",
    "train.cache_features",
)


class FanoutVariant(Section):
    """One drafter of a fan-out: its name (also its folder under run.out_dir), dotted overrides of the
    base config (e.g. ``{drafter.block_size: 4, train.lr: 3.0e-4}``) and the device it trains on."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    overrides: dict[str, Any] = Field(default_factory=dict)
    device: str = "auto"  # auto: the GPUs without a target worker in turn, else the last worker's device


def _device_key(text: str) -> str:
    """A device as written, normalised for comparison: ``cuda`` and ``cuda:0`` are the same GPU."""
    key = text.strip()
    return "cuda:0" if key == "cuda" else key


class FanoutSection(Section):
    # One target worker: auto = run.device when set, else cuda:0 when there is a GPU, else cpu.
    target_device: str = "auto"
    # Several target workers, one per device (e.g. [cuda:0, cuda:1]): each holds a copy of the target and
    # computes every W-th micro-batch; the drafters still get them in stream order. Instead of target_device.
    # With train.cache_features each worker keeps its own cache, so a row may be computed on several devices.
    target_devices: list[str] | None = Field(None, min_length=1)
    queue_depth: int = Field(2, ge=1)  # micro-batches of features waiting per drafter
    variants: list[FanoutVariant] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_target_devices(self) -> FanoutSection:
        devices = self.target_devices
        if devices is None:
            return self
        if self.target_device != "auto":
            raise ValueError(
                f"fanout.target_device ({self.target_device}) and fanout.target_devices "
                f"({', '.join(devices)}) both place the target; keep one: target_device for one target "
                "worker, target_devices for one worker per device"
            )
        keys = [_device_key(d) for d in devices]
        if "auto" in keys:
            raise ValueError("fanout.target_devices names devices (cuda:0, cuda:1, ...); auto is not one")
        if len({k.split(":")[0] for k in keys}) > 1:
            raise ValueError(
                f"fanout.target_devices mixes device kinds ({', '.join(devices)}); use GPUs or cpu"
            )
        twice = sorted({k for k in keys if keys.count(k) > 1 and k != "cpu"})
        if twice:
            raise ValueError(
                f"fanout.target_devices names {', '.join(twice)} more than once; one target worker per GPU "
                "(only cpu may repeat: workers there share one copy of the target)"
            )
        return self

    @model_validator(mode="after")
    def _check_variants(self) -> FanoutSection:
        names = [v.name for v in self.variants]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"fanout variant names must differ; {', '.join(twice)} appears more than once")
        for v in self.variants:
            for key in v.overrides:
                if len([p for p in key.split(".") if p]) < 2:
                    raise ValueError(
                        f"variant {v.name}: override key '{key}' must name a section and a key (e.g. train.lr)"
                    )
                if any(key == k or key.startswith(k) for k in FANOUT_SHARED_KEYS):
                    raise ValueError(
                        f"variant {v.name} overrides {key}, which every fan-out drafter shares (the target "
                        "computes each batch once for all of them); set it in the base config"
                    )
        return self


class RunConfig(Section):
    target: TargetSection = TargetSection()
    data: DataSection = DataSection()
    drafter: DrafterSection = DrafterSection()
    train: TrainSection = TrainSection()
    attention: AttentionSection = AttentionSection()
    eval: EvalSection = EvalSection()
    run: RunSection = RunSection()
    distributed: DistributedSection = DistributedSection()
    fanout: FanoutSection | None = None  # several drafter variants from one target

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        d, t = self.drafter, self.train
        if t.max_len < 2 * d.block_size:
            raise ValueError(
                f"train.max_len ({t.max_len}) must be at least 2 x drafter.block_size ({d.block_size})"
            )
        if d.target_layer_ids is not None and len(d.target_layer_ids) != d.num_target_layers:
            raise ValueError(
                f"drafter.target_layer_ids has {len(d.target_layer_ids)} ids but drafter.num_target_layers is "
                f"{d.num_target_layers}; make them agree (or drop target_layer_ids for the default spacing)"
            )
        if t.distill > 0 and t.loss != "ce":
            raise ValueError(
                f"train.distill={t.distill} is the older name of train.loss {{ce: {1 - t.distill:g}, kl: "
                f"{t.distill:g}}} and train.loss is {t.loss}: set one of them (train.distill: 0)"
            )
        return self

    @model_validator(mode="after")
    def _check_fanout_variants(self) -> RunConfig:
        """Every fan-out variant (the base config plus its overrides) must be a valid config itself."""
        if self.fanout is not None:
            base = self.model_copy(update={"fanout": None})
            for v in self.fanout.variants:
                try:
                    apply_overrides(base, v.overrides, f"fanout variant {v.name}")
                except ConfigError as e:
                    raise ValueError(str(e)) from None
        return self

    def decay_gamma(self) -> float:
        """gamma for exp(-(k-1)/gamma): 7 for B=16 (the published recipe), scaled linearly with B otherwise."""
        if self.train.gamma is not None:
            return self.train.gamma
        return 7.0 * (self.drafter.block_size - 1) / 15


def _format_validation_error(e: ValidationError, where: str) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown key '{loc}'{_valid_keys_hint(err['loc'])}")
        else:
            parts.append(f"{loc}: {err['msg']}")
    return f"{where}: " + "; ".join(parts)


def _valid_keys_hint(loc: tuple[Any, ...]) -> str:
    model: type[BaseModel] = RunConfig
    for key in loc[:-1]:
        field = model.model_fields.get(str(key))
        if (
            field is None
            or not isinstance(field.annotation, type)
            or not issubclass(field.annotation, BaseModel)
        ):
            return ""
        model = field.annotation
    return f" (valid keys here: {', '.join(model.model_fields)})"


def parse_override(text: str) -> tuple[list[str], Any]:
    """``train.lr=3e-4`` -> (["train", "lr"], 0.0003). Values are read as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form section.key=value (e.g. train.lr=3e-4)")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if len(path) < 2:
        raise ConfigError(f"override '{text}' must name a section and a key (e.g. train.lr=3e-4)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text}': cannot read the value ({e})") from None
    return path, value


def _set_dotted(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for key in path[:-1]:
        nxt = node.setdefault(key, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {'.'.join(path)}: '{key}' is a value, not a section")
        node = nxt
    node[path[-1]] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            try:
                repeated = key in seen
            except TypeError:  # an unhashable key: the base loader says so
                continue
            if repeated:
                raise ConfigError(
                    f"{key_node.start_mark.name}: the key '{key}' is given twice (lines {seen[key]} and "
                    f"{line}); keep one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> Any:
    """A YAML file's content; a key given twice in one mapping is a ConfigError naming it and its lines."""
    with open(path, encoding="utf-8") as f:
        return yaml.load(f, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (or the defaults when path is None) and apply dotted overrides."""
    data: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        p = Path(path)
        where = str(p)
        if p.is_dir():
            raise ConfigError(f"{p} is a folder: --config takes a YAML file (ready configs are in configs/)")
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist (ready configs are in configs/)")
        try:
            loaded = read_yaml(p) or {}
        except UnicodeDecodeError:
            raise ConfigError(f"{p} is not a text (UTF-8) file; --config takes a YAML file") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{p} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p} must hold a mapping of sections (target, data, drafter, train, ...)")
        data = loaded
    for text in overrides or []:
        key_path, value = parse_override(text)
        _set_dotted(data, key_path, value)
    if overrides:
        where = f"{where} + overrides"
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, where)) from None


def apply_overrides(cfg: RunConfig, overrides: Mapping[str, Any], where: str) -> RunConfig:
    """A validated copy of ``cfg`` with dotted overrides (``{"train.lr": 3e-4}``) applied. The keys the
    config left unset stay unset (``model_fields_set``: a run from drafter.init takes the checkpoint's shape
    for them)."""
    data = cfg.model_dump(mode="json", exclude_unset=True)
    for key, value in overrides.items():
        _set_dotted(data, [p for p in key.split(".") if p], value)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, where)) from None


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


# Where relative paths in a config point: the one rule, shown in `--help` and the README.
PATHS_RULE = (
    "Relative paths in a config file or an override (data.dir, data.features_dir, run.out_dir, "
    "drafter.init, run.compile_cache, target.path) resolve from the working directory dflashkit runs in, "
    "not from the config file's folder: the ready configs in configs/ are written to run from the "
    "repository root."
)
