"""The optimizer config users set, and `setup_optimizer`, which builds from it.

This is the one place that imports both `muon` and `offload`: they stay
independent of each other and meet here (and only through the subset-step
protocol at run time).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import json
import numbers
import re
import sys
import textwrap
import types
import typing
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from muon import SCHEDULES, Muon, muon_param_groups
from muon import options as muon_checks
from muon.planning import DEFAULT_BUCKET_CAP_BYTES
from offload import CPUOffloadOptimizer
from offload import options as offload_checks
from offload.cpu_offload import DEFAULT_CHUNK_BYTES, DEFAULT_STAGING_SLOTS, shard_count
from offload.forward_overlap import user_stacklevel

OPTIMIZER_TYPES = ("adamw", "muon")
OFFLOAD_MODES = ("none", "optimizer")
# Muon arguments the config sets from its own fields; muon_options may set the rest.
_MUON_ARGS_FROM_FIELDS = {
    "self",
    "params",
    "lr",
    "weight_decay",
    "momentum",
    "nesterov",
    "ns_coefficients",
    "adjust_lr_fn",
}


@dataclass(kw_only=True)
class OptimizerConfig:
    """What to optimize with, and whether its state lives on the host.

    Every field is checked at construction, by the same checks `muon.Muon` and
    `offload.CPUOffloadOptimizer` run (`muon.options`, `offload.options`), whether it
    comes from Python, `add_arguments`' flags or TOML.

    Defaults are a training recipe in which one lr serves Muon and AdamW groups, so
    three differ from `muon.Muon(...)`'s, which are torch's: lr 3e-4 (Muon: 1e-3,
    torch.optim.Muon's), adjust_lr_fn "match_rms_adamw" (Muon: None, i.e. "original"),
    betas (0.9, 0.95) for AdamW groups (Muon's AdamW groups: (0.9, 0.999),
    torch.optim.AdamW's). With type="adamw" the same fields build torch.optim.AdamW,
    whose own defaults are lr 1e-3, betas (0.9, 0.999), weight_decay 0.01.
    """

    type: str = "adamw"
    """"adamw", or "muon" (Muon for hidden matrices and expert stacks, AdamW for the rest)."""
    lr: float = 3e-4
    """Learning rate of every group (Muon's is scaled per matrix by `adjust_lr_fn`)."""
    weight_decay: float = 0.1
    """Decoupled weight decay, every group."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (also Muon's AdamW groups)."""
    eps: float = 1e-8
    """AdamW epsilon (also Muon's AdamW groups)."""
    momentum: float = 0.95
    """Muon momentum."""
    nesterov: bool = True
    """Muon Nesterov momentum."""
    ns_schedule: str = "keller_jordan"
    """Newton-Schulz schedule, one of `muon.SCHEDULES`."""
    adjust_lr_fn: str = "match_rms_adamw"
    """Muon per-matrix lr scale: "match_rms_adamw" (0.2 * sqrt(max(rows, cols)), so one lr
    serves Muon and AdamW groups) or "original" (sqrt(max(1, rows / cols)))."""
    offload: str = "none"
    """"optimizer": keep optimizer state in pinned host memory (CPUOffloadOptimizer)."""
    offload_overlap_forward: bool = False
    """With offload: run the step's chunks alongside the next forward."""
    offload_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """With offload: state bytes per streamed chunk."""
    offload_staging_slots: int = DEFAULT_STAGING_SLOTS
    """With offload: GPU staging slots in the ring."""
    offload_gpu_resident_bytes: int | str = 0
    """With offload: state bytes kept on the GPU, or "auto" (CPUOffloadOptimizer's
    `gpu_resident_bytes`)."""
    offload_gpu_budget_bytes: int | None = None
    """The GPU memory the optimizer may hold for state, for what it chooses: with
    `offload_gpu_resident_bytes="auto"` what it keeps and loads in the backward (default:
    what the device had free at the measured peak); with forward overlap and nothing
    resident, what the default's backward loads hold with the ring (CPUOffloadOptimizer's
    `gpu_budget_bytes`)."""
    offload_load_in_backward: bool | int | None = None
    """With forward overlap: load the next step's first chunks during the backward: True
    one ring's worth, or a byte count (more holds extra staging slots from the backward
    to the next forward; with "auto", the most it may load); default: what the next
    forward first waits for (the root unit's state), at least the ring's, or "auto"'s
    choice; False: never
    (CPUOffloadOptimizer's `load_in_backward`)."""
    fused: bool | None = None
    """type="adamw": torch.optim.AdamW's `fused` kernel, one launch per group where
    foreach takes a dozen (offloaded, per chunk, and an overlapped step's launches run
    inside the next forward). Default: fused when every param is on CUDA (torchtitan's
    default), else torch's choice."""
    muon_options: dict[str, Any] = field(default_factory=dict)
    """Extra `muon.Muon` keyword arguments (bucket_cap_bytes, max_inflight, ns_dtype, ...)."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, _plain_numbers(getattr(self, f.name)))
            _check_type(f.name, getattr(self, f.name), hints[f.name], _field_default(f))
        for name, check in _FIELD_CHECKS.items():
            check(getattr(self, name), name)
        if self.offload_overlap_forward and self.offload != "optimizer":
            raise ValueError(
                "offload_overlap_forward=True needs offload='optimizer' (it overlaps the "
                "offloaded step with the next forward); set offload='optimizer' or turn it off"
            )
        _check_used(self)
        offload_checks.check_offload_options(
            chunk_bytes=self.offload_chunk_bytes,
            staging_slots=self.offload_staging_slots,
            gpu_resident_bytes=self.offload_gpu_resident_bytes,
            gpu_budget_bytes=self.offload_gpu_budget_bytes,
            overlap_forward=self.offload_overlap_forward,
            load_in_backward=self.offload_load_in_backward,
            prefix="offload_",
        )
        _check_muon_options(self.muon_options)
        muon_checks.check_ns_steps_of_schedule(
            self.muon_options.get("ns_steps"),
            SCHEDULES[self.ns_schedule],
            "muon_options['ns_steps']",
            f"ns_schedule={self.ns_schedule!r}",
        )

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one `--flag` per field (`--offload-overlap-forward`, ...) to `parser`; each
        value is checked as the field is, and an error names the flag. `--muon-options`
        takes a JSON object, e.g. '{"ns_dtype": "float32", "max_inflight": 3}'. `--help`
        shows each field's docstring."""
        docs = _field_docs(cls)
        group = parser.add_argument_group("optimizer (muon_offload.OptimizerConfig)")
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = _field_default(f)
            text = docs.get(f.name, "").replace("%", "%%")
            boolean = isinstance(default, bool) or f.name == "fused"
            # BooleanOptionalAction adds its own default before Python 3.11
            if "default" not in text.lower() and not (boolean and sys.version_info < (3, 11)):
                text += " (default: %(default)r)"  # else the docstring says what it means
            described = {"help": text}
            if boolean:
                group.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=default, **described
                )
                continue
            if f.name == "offload_load_in_backward":  # --flag (True), --flag BYTES, --no-flag
                load = _checked(_byte_count, offload_checks.check_load_in_backward, f.name)
                group.add_argument(
                    flag, nargs="?", const=True, type=load, metavar="BYTES", **described
                )
                group.add_argument(
                    "--no-" + flag[2:], dest=f.name, action="store_const", const=False,
                    help="load nothing in the backward",
                )  # fmt: skip
                parser.set_defaults(**{f.name: default})
                continue
            if f.name == "muon_options":
                parse: Callable[[str], Any] = _json_object
            elif f.name == "offload_gpu_resident_bytes":
                parse = _bytes_or_auto
            elif f.name.endswith("_bytes"):  # offload_chunk_bytes, offload_gpu_budget_bytes
                parse = _byte_count
            else:
                parse = float if isinstance(default, tuple) else type(default)
            kwargs: dict[str, Any] = {"nargs": len(default)} if isinstance(default, tuple) else {}
            check = _FLAG_CHECKS.get(f.name)
            if hasattr(check, "choices"):
                kwargs["metavar"] = "{" + ",".join(check.choices) + "}"
            group.add_argument(
                flag, type=_checked(parse, check, f.name), default=default, **kwargs, **described
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OptimizerConfig:
        """The config of flags `add_arguments` added; an error of how they combine names
        the flags (`--offload optimizer`), as the per-value checks do."""
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [name for name in names if not hasattr(args, name)]
        if missing:
            raise ValueError(
                f"args lacks the optimizer's flags {missing}: call "
                "OptimizerConfig.add_arguments(parser) before parser.parse_args()"
            )
        values = {name: getattr(args, name) for name in names}
        values["betas"] = tuple(values["betas"])
        # the parser's default dict is one object: each config gets its own
        if isinstance(values["muon_options"], dict):
            values["muon_options"] = dict(values["muon_options"])
        try:
            return cls(**values)
        except ValueError as error:
            raise ValueError(_as_flags(str(error), names)) from error

    @classmethod
    def from_toml(cls, path: str, table: str = "optimizer") -> OptimizerConfig:
        """Read the `[optimizer]` table of a TOML file (`table`: its name, dotted for a
        nested one, `"train.optimizer"`).

        A missing table or an unknown key in it is an error; other tables (a
        trainer's own) are left alone.
        """
        try:
            import tomllib
        except ImportError as err:  # Python 3.10
            raise RuntimeError("reading TOML configs needs Python >= 3.11") from err

        with open(path, "rb") as f:
            try:
                document = tomllib.load(f)
            except tomllib.TOMLDecodeError as error:
                raise ValueError(f"{path} is not valid TOML: {error}") from error
        values: Any = document.get(table)  # a quoted key with a dot (["a.b"]) first
        if values is None:
            values = document
            for part in table.split("."):
                values = values.get(part) if isinstance(values, dict) else None
        if not isinstance(values, dict):
            tables = sorted(_table_names(document))
            arrays = [t for t in tables if t == f"[{table}]"]
            raise ValueError(
                f"{path} has no [{table}] table (found tables {tables}); put the optimizer "
                f"fields under [{table}]"
                + (f" (one table: [{table}], not an array of tables [[{table}]])" if arrays else "")
            )
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            meant = {
                key: [_OTHER_NAMES[key]] if key in _OTHER_NAMES else
                difflib.get_close_matches(key, names, n=1)
                for key in unknown
            }  # fmt: skip
            hints = [f"{key!r} (did you mean {near[0]!r}?)" for key, near in meant.items() if near]
            raise ValueError(
                f"unknown keys in [{table}] of {path}: {unknown}"
                + (f"; {', '.join(hints)}" if hints else "")
                + f"; the fields are {names}"
            )
        if "betas" in values:
            if not isinstance(values["betas"], list):  # a TOML array; tuple() of "0.9, 0.95"
                raise ValueError(  # would split the string into characters
                    f"betas in [{table}] of {path} should be an array of two numbers, e.g. "
                    f"betas = [0.9, 0.95], but is: {values['betas']!r}"
                )
            values["betas"] = tuple(values["betas"])
        try:
            return cls(**values)
        except ValueError as error:  # named where, and as, the user edits it
            raise ValueError(f"[{table}] of {path}: {_as_toml(str(error), names)}") from error


# Other trainers' names for fields, which spelling alone does not match
_OTHER_NAMES = {
    "learning_rate": "lr",
    "wd": "weight_decay",
    "optimizer": "type",
    "name": "type",
    "adam_beta1": "betas",
    "adam_beta2": "betas",
    "adam_epsilon": "eps",
}


def _table_names(document: dict[str, Any], prefix: str = "") -> list[str]:
    """The tables of a TOML document, nested ones dotted; an array of tables `[[name]]`."""
    names = []
    for key, value in document.items():
        if isinstance(value, dict):
            names.append(prefix + key)
            names += _table_names(value, f"{prefix}{key}.")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            names.append(f"[{prefix}{key}]")
    return names


# Fields that only one type or offload mode reads: (the field that picks, its value, a
# hint). A value other than the default under another choice would be silently unused.
_USED_ONLY_WITH: dict[str, tuple[str, str, str]] = {
    "momentum": ("type", "muon", ""),
    "nesterov": ("type", "muon", ""),
    "ns_schedule": ("type", "muon", ""),
    "adjust_lr_fn": ("type", "muon", ""),
    "muon_options": ("type", "muon", ""),
    "fused": (
        "type",
        "adamw",
        "; it picks torch.optim.AdamW's kernel, and Muon's own elementwise kernels are "
        "chosen by MUON_ELEMENTWISE_BACKEND (muon.elementwise)",
    ),
    "offload_chunk_bytes": ("offload", "optimizer", ""),
    "offload_staging_slots": ("offload", "optimizer", ""),
    "offload_gpu_resident_bytes": ("offload", "optimizer", ""),
    "offload_gpu_budget_bytes": ("offload", "optimizer", ""),
    "offload_load_in_backward": ("offload", "optimizer", ""),
}


def _check_used(config: OptimizerConfig) -> None:
    """Refuse a field set away from its default where the chosen type or offload mode
    does not read it (momentum with type="adamw", offload_chunk_bytes without offload)."""
    for f in dataclasses.fields(config):
        if f.name not in _USED_ONLY_WITH:
            continue
        chooser, needed, hint = _USED_ONLY_WITH[f.name]
        value, default = getattr(config, f.name), _field_default(f)
        if getattr(config, chooser) != needed and value != default:
            raise ValueError(
                f"{f.name}={value!r} is set but {chooser} is {getattr(config, chooser)!r}, "
                f"which does not use it: it is read only with {chooser}={needed!r}{hint}; set "
                f"{chooser}={needed!r} or leave {f.name} at its default ({default!r})"
            )


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the dataclass `cls`, on one line (for `--help`)."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    except (OSError, TypeError):  # no source (a frozen app): flags without help
        return {}
    docs = {}
    for field_node, doc in zip(body, body[1:], strict=False):
        if (
            isinstance(field_node, ast.AnnAssign)
            and isinstance(field_node.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[field_node.target.id] = " ".join(doc.value.value.split())
    return docs


def _field_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _plain_numbers(value: Any) -> Any:
    """A NumPy number or bool (a sweep's `np.float32(1e-3)`), alone or in a tuple or a
    dict's values (`muon_options`), as the Python value it holds: `muon.Muon` and
    `CPUOffloadOptimizer` take either, and a config is written to TOML and JSON, which take
    Python's. Other numbers (a `Fraction`) as Python's int or float."""
    if type(value) is tuple:
        return tuple(map(_plain_numbers, value))
    if type(value) is dict:
        return {k: _plain_numbers(v) for k, v in value.items()}
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()
    if type(value) in (bool, int, float) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _matches(value: Any, hint: Any) -> bool:
    """Whether `value` has type `hint` (strictly: a bool is not a number, nor "no" a bool)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # an int is a float too (TOML's `lr = 1`)
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is tuple:
        return (
            isinstance(value, tuple)
            and len(value) == len(args)
            and all(_matches(v, a) for v, a in zip(value, args, strict=True))
        )
    if origin is dict:
        return isinstance(value, dict) and all(
            _matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items()
        )
    return isinstance(value, origin or hint)


def _type_name(hint: Any) -> str:
    if isinstance(hint, type) and not typing.get_args(hint):
        module = hint.__module__
        return hint.__qualname__ if module == "builtins" else f"{module}.{hint.__qualname__}"
    return str(hint).replace("typing.", "")


# A value of each type, to show in an error about a field whose default is None.
_TYPE_EXAMPLES: dict[type, Any] = {bool: True, int: 1, float: 1.0}


def _example(value: Any, hint: Any, default: Any) -> Any:
    """A value of type `hint` to show in an error about `value`: `value` as an int where
    that loses nothing (TOML's `4e9` for a byte count), else `default` unless it is None,
    else an example of the first of the hint's types that has one."""
    if isinstance(value, float) and value.is_integer() and _matches(int(value), hint):
        return int(value)
    if default is not None:
        return default
    return next((_TYPE_EXAMPLES[t] for t in typing.get_args(hint) if t in _TYPE_EXAMPLES), None)


def _check_type(name: str, value: Any, hint: Any, default: Any) -> None:
    if not _matches(value, hint):
        raise ValueError(
            f"{name} should be of type {_type_name(hint)} but is: {value!r} "
            f"({type(value).__name__}); set it like {_example(value, hint, default)!r}"
        )


def _check_muon_options(options: dict[str, Any]) -> None:
    """`muon_options` against `muon.Muon`'s signature: known names, values of its types."""
    signature = inspect.signature(Muon.__init__)
    hints = typing.get_type_hints(Muon.__init__)
    allowed = [name for name in signature.parameters if name not in _MUON_ARGS_FROM_FIELDS]
    for name, value in options.items():
        if name not in allowed:
            raise ValueError(
                f"muon_options has {name!r}, which muon.Muon does not take from muon_options; "
                f"it takes {allowed} (lr, momentum, ... are config fields)"
            )
        default = signature.parameters[name].default
        _check_type(f"muon_options[{name!r}]", value, hints[name], default)
        if name in muon_checks.CHECKS:
            muon_checks.CHECKS[name](value, f"muon_options[{name!r}]")


def _one_of(choices: tuple[str, ...]) -> Callable[[Any, str], None]:
    def check(value: Any, name: str) -> None:
        if value not in choices:
            raise ValueError(f"{name} should be one of {list(choices)} but is: {value!r}")

    check.choices = choices  # type: ignore[attr-defined]  # `--help` lists them
    return check


def _as_flags(message: str, names: Sequence[str]) -> str:
    """`message` with the fields it names written as the flags `add_arguments` adds:
    `nesterov=False` as `--no-nesterov`, `type='muon'` as `--type 'muon'`, `leave momentum
    at` as `leave --momentum at` (a switch's as `drop --no-nesterov`), and a bare
    `offload_chunk_bytes` (names with an underscore: the others are words) as the flag."""
    fields = "|".join(sorted(names, key=len, reverse=True))

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    message = re.sub(rf"\b({fields})=True\b", lambda m: flag(m.group(1)), message)
    message = re.sub(rf"\b({fields})=False\b", lambda m: "--no-" + flag(m.group(1))[2:], message)
    message = re.sub(rf"\b({fields})=", lambda m: flag(m.group(1)) + " ", message)
    # a field that is a plain word (`momentum`) where the message says to leave it
    message = re.sub(rf"\bleave ({fields}) at\b", lambda m: f"leave {flag(m[1])} at", message)
    message = re.sub(r"leave --([\w-]+) at its default \(True\)", r"drop --no-\1", message)
    message = re.sub(r"leave --([\w-]+) at its default \(False\)", r"drop --\1", message)
    # a default of None: drop what was typed (`--fused` or `--no-fused`), where it leads
    typed = re.match(r"(--[\w-]+)(?: \S+)? is set\b", message)
    if typed:
        message = re.sub(r"leave --[\w-]+ at its default \(None\)", f"drop {typed[1]}", message)
    spaced = "|".join(n for n in names if "_" in n)
    return re.sub(rf"(?<![-\w'])({spaced})\b(?![=\['])", lambda m: flag(m.group(1)), message)


def _as_toml(message: str, names: Sequence[str]) -> str:
    """`message` with the settings it names written as TOML keys are: `type='muon'` as
    `type = "muon"`, `nesterov=False` as `nesterov = false`; and the values it shows as
    TOML writes them: `set it like True` as `true`, `(0.9, 0.95)` as `[0.9, 0.95]`, a
    default of None as the key left out (TOML has no None)."""
    fields = "|".join(sorted(names, key=len, reverse=True))
    message = re.sub(rf"\b({fields})=(True|False)\b", lambda m: f"{m[1]} = {m[2].lower()}", message)
    message = re.sub(rf"\b({fields})='([^']*)'", lambda m: f'{m[1]} = "{m[2]}"', message)
    message = re.sub(
        r"set it like (True|False)\b", lambda m: f"set it like {m[1].lower()}", message
    )
    message = re.sub(r"set it like \(([^()]*)\)", r"set it like [\1]", message)
    message = re.sub(
        r"at its default \((True|False)\)", lambda m: f"at its default ({m[1].lower()})", message
    )
    message = re.sub(r"but is: \(([^()]*?),?\) \(tuple\)", r"but is: [\1]", message)
    message = re.sub(rf"leave ({fields}) at its default \(None\)", r"leave \1 out", message)
    return re.sub(rf"\b({fields})=", lambda m: f"{m[1]} = ", message)


def offload_bucket_cap(chunk_bytes: int, shards: int) -> int:
    """Muon's `bucket_cap_bytes` when its state is offloaded in `chunk_bytes` chunks and
    its params are sharded `shards` ways (what `setup_optimizer` and the planner use).

    A bucket that exchanges is one offload unit, and the staging ring holds its largest
    unit `offload_staging_slots` times: cap buckets so a unit's fp32 momentum shard (twice
    the bf16 bytes the cap counts, over the shards) fits one chunk. With no param sharded
    (one rank, or a plain module) nothing exchanges: each param is a unit of its own
    whatever the cap, which then only bounds how many matrices one Newton-Schulz launch
    batches, so Muon's default stays (the chunks loaded in the backward update in one
    call, and small launches would slow it)."""
    if shards == 1:
        return DEFAULT_BUCKET_CAP_BYTES
    return min(DEFAULT_BUCKET_CAP_BYTES, chunk_bytes * shards // 2)


def setup_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """Build the optimizer `config` asks for over `model`'s trainable params.

    Call it after `fully_shard` (which replaces the params) and after the weights are
    materialized and unfrozen: it plans from the params as they are now (a param frozen
    now is in no group; one that gets a grad later is warned about at `step()`). Returns a
    `torch.optim.AdamW` (`type="adamw"`) or a `muon.Muon` whose AdamW groups take
    embeddings, head, norms and biases (`type="muon"`, `muon_param_groups`); with
    `offload="optimizer"` wrapped in a `CPUOffloadOptimizer`, whose `overlap_forward` is
    `model` when `offload_overlap_forward` is set (under FSDP2, pass the root module).
    """
    if not isinstance(model, nn.Module) or not isinstance(config, OptimizerConfig):
        raise TypeError(
            "setup_optimizer(model, config) takes the model (an nn.Module) and an "
            f"OptimizerConfig, but got: {type(model).__name__}, {type(config).__name__}"
        )
    config.__post_init__()  # fields set since construction are checked as there
    meta = next((name for name, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:  # to_empty() makes new params: the optimizer would step the old
        raise ValueError(
            f"param {meta!r} is on the meta device (a model not materialized yet): call "
            "setup_optimizer after model.to_empty(device=...) and the weights' init"
        )
    if not any(p.requires_grad for p in model.parameters()):
        count = sum(1 for _ in model.parameters())
        raise ValueError(
            f"{type(model).__name__} has no trainable params to optimize ("
            + (f"all {count} are frozen: requires_grad=False" if count else "it has none")
            + "): unfreeze what should train before setup_optimizer"
        )
    if config.type == "adamw":
        params = [p for p in model.parameters() if p.requires_grad]
        fused = config.fused
        if fused is None and params and all(p.device.type == "cuda" for p in params):
            fused = True
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            params,
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
            fused=fused,
        )
    else:
        groups = muon_param_groups(model, adamw_options={"betas": config.betas, "eps": config.eps})
        options = dict(config.muon_options)
        if config.offload == "optimizer":
            # the mesh's count, not numel / local numel: a 7-element param on 4 ranks
            # (shards of 2, 2, 2, 1) read as 7 shards and raised the cap, and the ring
            shards = max((shard_count(p) for p in model.parameters()), default=1)
            options.setdefault(
                "bucket_cap_bytes", offload_bucket_cap(config.offload_chunk_bytes, shards)
            )
        optimizer = Muon(
            groups,
            lr=config.lr,
            weight_decay=config.weight_decay,
            momentum=config.momentum,
            nesterov=config.nesterov,
            ns_coefficients=SCHEDULES[config.ns_schedule],
            adjust_lr_fn=config.adjust_lr_fn,
            **options,
        )
    if config.offload == "optimizer":
        optimizer = CPUOffloadOptimizer(
            optimizer,
            chunk_bytes=config.offload_chunk_bytes,
            staging_slots=config.offload_staging_slots,
            overlap_forward=model if config.offload_overlap_forward else None,
            gpu_resident_bytes=config.offload_gpu_resident_bytes,
            gpu_budget_bytes=config.offload_gpu_budget_bytes,
            load_in_backward=config.offload_load_in_backward,
        )
    _warn_when_left_out_params_get_grads(optimizer, model)
    return optimizer


def _warn_when_left_out_params_get_grads(
    optimizer: torch.optim.Optimizer, model: nn.Module
) -> None:
    """The params frozen at `setup_optimizer` are in no group (as transformers' Trainer
    leaves them out; the offloaded state is planned for the rest): one unfrozen later gets
    grads and never steps. Said once, at the first `step()` that finds a param of the model
    that requires grad and has one, in none of the optimizer's groups. Watched only where
    some param was frozen; the params are held weakly, and listed once (walking the model's
    modules every step is host work on the trainer's path)."""
    if all(p.requires_grad for p in model.parameters()):
        return
    watched = [(name, weakref.ref(p)) for name, p in model.named_parameters()]
    grouped = {id(p) for group in optimizer.param_groups for p in group["params"]}

    def check(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        graded = [
            (name, p)
            for name, ref in watched
            if (p := ref()) is not None and p.grad is not None and p.requires_grad
        ]
        left_out = [name for name, p in graded if id(p) not in grouped]
        if left_out:  # against the groups as they are now (a group may have been added)
            now = {id(p) for group in opt.param_groups for p in group["params"]}
            left_out = [name for name, p in graded if id(p) not in now]
        if left_out:
            handle.remove()
            warnings.warn(
                f"{len(left_out)} param(s) of the model have grads and are in no param group "
                f"of the optimizer setup_optimizer built, so it does not train them (first: "
                f"{left_out[0]!r}), unless another optimizer does; setup_optimizer takes the "
                "params that require grad when it is called: call it again after unfreezing "
                "(close() an offloaded one first; its state starts anew)",
                stacklevel=user_stacklevel(),
            )

    handle = optimizer.register_step_pre_hook(check)


def _bytes_or_auto(text: str) -> int | str:
    """`--offload-gpu-resident-bytes`: "auto" or a byte count."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"should be 'auto' or a whole number of bytes (e.g. {2**30} for 1 GiB), "
            f"but is: {text!r}"
        ) from None


def _byte_count(text: str) -> int:
    """A flag's byte count: a whole number (argparse said only "invalid int value" to
    `256MiB`)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"should be a whole number of bytes (e.g. {256 * 2**20} for 256 MiB), but is: {text!r}"
        ) from None


def _json_object(text: str) -> dict[str, Any]:
    """`--muon-options`: a JSON object (text that is not JSON: argparse's "invalid JSON
    object value")."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"should be a JSON object like '{{\"max_inflight\": 3}}' but is: {text}"
        )
    return value


_json_object.__name__ = "JSON object"  # argparse: "invalid JSON object value: ..."


def _checked(
    parse: Callable[[str], Any], check: Callable[[Any, str], None] | None, name: str
) -> Callable[[str], Any]:
    """An argparse `type`: `parse`, then the field's `check`; argparse puts the flag in
    front of the error."""

    def parse_flag(text: str) -> Any:
        value = parse(text)
        if check is not None:
            try:
                check(value, name)
            except (TypeError, ValueError) as error:
                raise argparse.ArgumentTypeError(str(error)) from error
        return value

    parse_flag.__name__ = parse.__name__
    return parse_flag


# What checks each field (besides its type), from `muon.options` and `offload.options`:
# the dataclass, its CLI flags and TOML all go through these.
_FIELD_CHECKS: dict[str, Callable[[Any, str], None]] = {
    "type": _one_of(OPTIMIZER_TYPES),
    "offload": _one_of(OFFLOAD_MODES),
    "ns_schedule": _one_of(tuple(SCHEDULES)),  # muon.options' check, with choices for --help
    # Muon's None means "original": a config names it (it listed None, which the field's
    # type then refused)
    "adjust_lr_fn": _one_of(tuple(f for f in muon_checks.ADJUST_LR_FNS if f is not None)),
    "lr": muon_checks.check_lr,
    "weight_decay": muon_checks.check_weight_decay,
    "betas": muon_checks.check_betas,
    "eps": muon_checks.check_eps,
    "momentum": muon_checks.check_momentum,
}
# A flag's value is one element of a tuple field (`--betas 0.9 0.95`).
_FLAG_CHECKS: dict[str, Callable[[Any, str], None]] = {
    **_FIELD_CHECKS,
    "betas": muon_checks.check_beta,
    "offload_chunk_bytes": offload_checks.check_chunk_bytes,
    "offload_staging_slots": offload_checks.check_staging_slots,
    "offload_gpu_resident_bytes": offload_checks.check_gpu_resident_bytes,
    "offload_gpu_budget_bytes": offload_checks.check_optional_bytes,
    "muon_options": lambda value, name: _check_muon_options(value),
}
