"""Hydra-style composition of ``configs/`` with OmegaConf.

``configs/config.yaml`` holds a ``defaults`` list naming one option per group (``model: tiny``);
each group is a folder of YAML files merged under the group's key, unless the file starts with
``# @package _global_`` (the ``experiment`` group), which merges at the root. Command-line
overrides work as in hydra:

* ``group=option`` picks another file of a group (``runtime=off``); ``~group`` drops it;
* ``key.sub=value`` sets an existing key (an unknown key is an error listing the valid ones);
* ``+key=value`` adds a key under the free-form ``extra`` mapping or any dict-typed node (an
  existing key is an error); ``++key=value`` adds or sets;
* ``~key`` (or ``~key=value``, only if it holds ``value``) deletes a key that is not a schema field.

A group file's ``defaults`` may pick other groups' options (``override /train: flow_grpo``) and, with a plain name,
extend another option of its own group (``grpo_qwen_image`` in ``experiment/grpo_qwen_image_1024.yaml``).

Values are parsed as hydra does (``null`` → None, numbers, booleans, lists; ``overrides.py``).

:func:`derive` makes one command's config from another's composed config plus ``key=value``
overrides (``ablate`` makes each job's ``run`` config so).

Each command composes its own schema (:data:`~mmdit_strict.config.schema.SCHEMAS`): a group, an
experiment key or an override naming a section the command does not read is refused with the
command's valid keys. The result is validated (:func:`~mmdit_strict.config.validate.problems`) before
it is returned, so every check on a value happens before any work.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from .overrides import Override, OverrideError, parse_override
from .schema import choices_for, commands_reading, schema_for, section_names
from .validate import problems

GLOBAL_PACKAGE = "# @package _global_"


class ConfigError(ValueError):
    """A config file or override is invalid; the message says which and what is valid."""


def default_config_dir() -> Path:
    """``$MMDIT_STRICT_CONFIG_DIR``, else ``./configs``, else the repository's ``configs/``."""
    env = os.environ.get("MMDIT_STRICT_CONFIG_DIR")
    candidates = [Path(env)] if env else []
    candidates += [Path.cwd() / "configs", Path(__file__).resolve().parents[2] / "configs"]
    for c in candidates:
        if (c / "config.yaml").exists():
            return c
    raise ConfigError(f"no config.yaml found in {[str(c) for c in candidates]}; pass --config-dir")


def groups(config_dir: Path) -> dict[str, list[str]]:
    """Config groups and their options (folder name → YAML stems)."""
    return {
        d.name: sorted(p.stem for p in d.glob("*.yaml"))
        for d in sorted(config_dir.iterdir()) if d.is_dir() and not d.name.startswith((".", "_"))
    }


def _load_yaml(path: Path) -> tuple[DictConfig, bool]:
    try:
        text = path.read_text()
        node = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    except (OSError, OmegaConfBaseException, Exception) as exc:  # yaml errors come in several types
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path} must hold a mapping")
    return node, text.lstrip().startswith(GLOBAL_PACKAGE)


def _load_option(path: Path, chain: tuple[Path, ...] = ()) -> tuple[DictConfig, bool, dict[str, str | None]]:
    """A group option's file: its node without ``defaults``, whether it is ``_global_``, and the group options its
    ``defaults`` pick (``override /train: flow_grpo`` → ``{"train": "flow_grpo"}``). A plain name in ``defaults`` is
    another option of the same group, which this one extends as in hydra: the files merge in the order of
    ``defaults``, this one at ``_self_`` (last when ``_self_`` is absent, so its keys win)."""
    if path in chain:
        raise ConfigError(f"{path}: its defaults come back to it ({' -> '.join(p.stem for p in (*chain, path))})")
    node, is_global = _load_yaml(path)
    raw = node.pop("defaults", None)
    entries = OmegaConf.to_container(raw) if raw is not None else []
    if not isinstance(entries, list):
        raise ConfigError(f"{path}: defaults must be a list")
    parts: list[DictConfig] = []  # merged in the order of ``defaults``, this file at ``_self_`` (last when absent)
    picks: dict[str, str | None] = {}
    for entry in entries:
        if entry == "_self_":
            parts.append(node)
            continue
        if isinstance(entry, str):
            parent = path.parent / f"{entry}.yaml"
            if not parent.exists():
                raise ConfigError(f"{path}: its defaults extend {entry!r}, which is not an option of its group "
                                  f"({', '.join(sorted(p.stem for p in path.parent.glob('*.yaml')))})")
            pnode, pglobal, ppicks = _load_option(parent, (*chain, path))
            if pglobal != is_global:
                raise ConfigError(f"{path} extends {parent.name}, and only one of them is {GLOBAL_PACKAGE!r}")
            parts.append(pnode)
            picks.update(ppicks)
        elif isinstance(entry, dict) and len(entry) == 1:
            (g, opt), = entry.items()
            picks[str(g).replace("override ", "").strip("/ ")] = None if opt is None else str(opt)
        else:
            raise ConfigError(f"bad defaults entry {entry!r} in {path}")
    if not any(part is node for part in parts):
        parts.append(node)
    return (parts[0] if len(parts) == 1 else OmegaConf.merge(*parts)), is_global, picks


def _parse_override(item: str) -> Override:
    try:
        return parse_override(item)
    except OverrideError as exc:
        raise ConfigError(str(exc)) from None


def _is_schema_field(parent: DictConfig, leaf: str) -> bool:
    import dataclasses

    t = OmegaConf.get_type(parent)
    return t is not None and dataclasses.is_dataclass(t) and leaf in {f.name for f in dataclasses.fields(t)}


def _valid_keys(node: Any, prefix: str) -> list[str]:
    if not isinstance(node, DictConfig):
        return []
    return sorted(f"{prefix}{k}" for k in node.keys())


def _foreign(keys: Sequence[str], command: str, valid: Sequence[str], where: str) -> ConfigError:
    """The error for ``where`` setting top-level ``keys`` that ``command``'s schema lacks."""
    owners = []
    for k in keys:
        readers = commands_reading(k)
        if readers:
            owners.append(f"{k} is read by {' / '.join(readers)}")
    return ConfigError(
        f"{where} sets {', '.join(repr(k) for k in keys)}, which `mmdit-strict {command}` does not read"
        + (f" ({'; '.join(owners)})" if owners else "")
        + f"; valid keys for {command}: {', '.join(valid)}"
    )


def compose(overrides: Sequence[str] = (), config_dir: str | Path | None = None, config_name: str = "config",
            command: str = "run", checks: Sequence[Callable[[DictConfig], list[str]]] = ()) -> DictConfig:
    """Compose ``config_name`` with ``overrides`` onto ``command``'s schema; return it validated, resolved, read-only.

    A ConfigError names any key, group or experiment key ``command`` does not read, with its valid keys.
    """
    try:
        schema = schema_for(command)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    valid = section_names(schema)
    cdir = Path(config_dir) if config_dir else default_config_dir()
    primary_path = cdir / f"{config_name}.yaml"
    if not primary_path.exists():
        raise ConfigError(f"no {config_name}.yaml in {cdir}")
    primary, _ = _load_yaml(primary_path)
    known_groups = groups(cdir)

    def check_global(node: DictConfig, where: str, nested_groups: Sequence[str] = ()) -> None:
        bad = [str(k) for k in node.keys() if str(k) not in valid and k != "defaults"]
        bad += [g for g in nested_groups if g not in valid and g not in bad]
        if bad:
            raise _foreign(bad, command, valid, where)

    check_global(primary, str(primary_path))

    parsed = [_parse_override(o) for o in overrides]
    group_choice: dict[str, str | None] = {
        o.key: (None if o.op == "delete" else o.raw) for o in parsed if o.key in known_groups
    }
    value_overrides = [o for o in parsed if o.key not in known_groups]

    defaults = OmegaConf.to_container(primary.pop("defaults")) if "defaults" in primary else ["_self_"]
    order: list[tuple[str, str | None]] = []
    for entry in defaults:  # type: ignore[union-attr]
        if entry == "_self_":
            order.append(("_self_", None))
        elif isinstance(entry, dict) and len(entry) == 1:
            (g, opt), = entry.items()
            order.append((str(g), None if opt is None else str(opt)))
        else:
            raise ConfigError(f"bad defaults entry {entry!r} in {primary_path}")
    listed = {g for g, _ in order}
    for g in group_choice:
        if g not in listed:
            order.insert(len(order) - 1 if order and order[-1][0] == "_self_" else len(order), (g, None))

    merged = OmegaConf.structured(schema)
    choices: dict[str, str] = {}
    try:
        for g, opt in order:
            if g == "_self_":
                merged = OmegaConf.merge(merged, primary)
                continue
            opt = group_choice.get(g, opt)
            if opt in (None, "null", "none"):
                continue
            path = cdir / g / f"{opt}.yaml"
            if not path.exists():
                raise ConfigError(f"unknown option {opt!r} for config group {g!r}; choose one of {known_groups.get(g, [])}")
            node, is_global, nested = _load_option(path)
            if is_global:
                check_global(node, f"{g}={opt}", list(nested))
            elif g not in valid:
                raise _foreign([g], command, valid, f"config group {g}={opt}")
            for ng, nopt in nested.items():  # an experiment may pick group options
                if ng not in valid:
                    raise _foreign([ng], command, valid, f"{g}={opt} (its defaults pick {ng}={nopt})")
                if ng in group_choice:
                    continue
                npath = cdir / ng / f"{nopt}.yaml"
                if not npath.exists():
                    raise ConfigError(f"{path}: unknown option {nopt!r} for group {ng!r}")
                nnode, _ = _load_yaml(npath)
                merged = OmegaConf.merge(merged, {ng: nnode})
                choices[ng] = str(nopt)
            merged = OmegaConf.merge(merged, node if is_global else {g: node})
            choices[g] = opt
    except (ConfigKeyError, ValidationError) as exc:
        raise ConfigError(_explain(exc, merged)) from exc

    _apply_overrides(merged, value_overrides, command, valid)
    return _finish(merged, schema, choices, checks)


def derive(cfg: DictConfig, overrides: Sequence[str] = (), command: str = "run",
           checks: Sequence[Callable[[DictConfig], list[str]]] = ()) -> DictConfig:
    """``command``'s config made from ``cfg``, a config another command composed: the sections ``command``
    reads (the others are dropped, missing ones take their defaults), then ``key=value`` ``overrides``,
    validated as :func:`compose` validates. A group override (``runtime=off``) is refused: name the key.

    ``ablate`` makes each job's ``run`` config this way from its own.
    """
    try:
        schema = schema_for(command)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    valid = section_names(schema)
    tree = OmegaConf.to_container(cfg, resolve=True)
    choices = dict(tree.pop("_choices_", None) or {})  # type: ignore[union-attr]
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), {k: v for k, v in tree.items() if k in valid})  # type: ignore[union-attr]
    except (ConfigKeyError, ValidationError) as exc:
        raise ConfigError(f"cannot make a {command} config: {getattr(exc, 'msg', exc)}") from exc
    parsed = [_parse_override(o) for o in overrides]
    for o in parsed:
        if isinstance(merged.get(o.key), DictConfig):
            raise ConfigError(f"override {o.key}={o.raw}: {o.key} is a config section (or group); set one of its keys "
                              f"({', '.join(_valid_keys(merged[o.key], o.key + '.')[:4])}, ...)")
    _apply_overrides(merged, parsed, command, valid)
    return _finish(merged, schema, {k: v for k, v in choices.items() if k in valid or k == "experiment"}, checks)


def _apply_overrides(merged: DictConfig, value_overrides: Sequence[Override], command: str, valid: Sequence[str]) -> None:
    """Apply ``key=value`` / ``+`` / ``++`` / ``~`` overrides to ``merged`` in place."""
    for o in value_overrides:
        key, value = o.key, o.raw if o.raw is not None else ""
        top = key.split(".")[0]
        if top not in valid:
            raise _foreign([top], command, valid, f"unknown config key {key!r}: the override")
        add = o.op in ("add", "force")
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(merged, parent_key) if parent_key else merged
        if parent is None or not isinstance(parent, DictConfig):
            raise ConfigError(f"unknown config key {key!r}: {parent_key!r} is not a config section")
        exists = leaf in parent
        if o.op == "delete":
            if not exists:
                raise ConfigError(f"cannot delete {key!r}: no such key")
            if _is_schema_field(parent, leaf):
                raise ConfigError(f"cannot delete {key!r}: it is a schema field (set it, e.g. {key}=null, instead)")
            if o.raw is not None and parent[leaf] != o.value:
                raise ConfigError(f"cannot delete {key!r}: it holds {parent[leaf]!r}, not {o.value!r}")
            with_flag = OmegaConf.is_struct(parent)
            OmegaConf.set_struct(parent, False)
            del parent[leaf]
            OmegaConf.set_struct(parent, with_flag)
            continue
        if exists and o.op == "add":
            raise ConfigError(f"cannot add {key!r}: it already exists (set it with {key}=..., or ++{key}=...)")
        if not exists and not add:
            raise ConfigError(
                f"unknown config key {key!r}; valid keys here: {', '.join(_valid_keys(parent, parent_key + '.' if parent_key else ''))}"
                + (" (prefix with + to add a new key)" if parent_key == "extra" else "")
            )
        try:
            # hydra's value grammar: null → None, numbers, booleans, lists; on/off/yes/no stay text
            # (``runtime=off``), a bool field still parses them.
            parsed_value: Any = o.value if o.raw is not None else ""
            if add and not exists:
                with_flag = OmegaConf.is_struct(parent)
                OmegaConf.set_struct(parent, False)
                parent[leaf] = parsed_value
                OmegaConf.set_struct(parent, with_flag)
            else:
                OmegaConf.update(merged, key, parsed_value, merge=False)
        except (ValidationError, ConfigKeyError) as exc:
            raise ConfigError(f"bad value for {key}: {value!r} ({exc.msg if hasattr(exc, 'msg') else exc})") from exc


def _finish(merged: DictConfig, schema: type, choices: dict[str, str],
            checks: Sequence[Callable[[DictConfig], list[str]]]) -> DictConfig:
    """Check choices and values, resolve, record the group choices; return ``merged`` read-only."""
    for key, allowed in choices_for(schema).items():
        val = OmegaConf.select(merged, key)
        if val not in allowed:
            raise ConfigError(f"{key}={val!r} is not one of {[a for a in allowed]}")
    try:
        OmegaConf.resolve(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot resolve interpolations: {exc}") from exc
    found = problems(merged) + [p for check in checks for p in check(merged)]
    if found:
        raise ConfigError("; ".join(found))
    merged_choices = OmegaConf.create({"choices": choices})
    OmegaConf.set_struct(merged, False)
    merged["_choices_"] = merged_choices.choices
    OmegaConf.set_readonly(merged, True)
    return merged


def _explain(exc: Exception, node: DictConfig) -> str:
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
    parent_key = str(key).rpartition(".")[0] if key else ""
    parent = OmegaConf.select(node, parent_key) if parent_key else node
    valid = _valid_keys(parent, parent_key + "." if parent_key else "")
    return f"unknown or invalid config key {key!r}: {getattr(exc, 'msg', exc)}; valid keys: {', '.join(valid)}"


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg)


def save_resolved(cfg: DictConfig, directory: str | Path) -> Path:
    """Write the resolved config beside a run's outputs (``config.yaml``), atomically."""
    from ..io import atomic_write_text

    path = Path(directory) / "config.yaml"
    atomic_write_text(path, to_yaml(cfg))
    return path
