"""Reading the model registry from TOML: the built-in `app/models.toml` plus an optional user file.

A user model replaces a built-in one of the same name. A broken file raises `RegistryError`
naming file, model and field; app/models.toml's header documents every field.
"""

from __future__ import annotations

import math
import re
import string
import tomllib
from collections.abc import Mapping, Set
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, TypeVar

from app import errors, registry

_T = TypeVar("_T")

BUILTIN_FILE: Final = Path(__file__).with_name("models.toml")

_MODEL_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
_PARAM_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_MEDIA_TYPE = re.compile(r"[a-z0-9][a-z0-9.+-]*/[a-z0-9][a-z0-9.+-]*")
_PARAM_TYPES: Final[dict[str, registry.ParamType]] = {
    "int": "int",
    "float": "float",
    "bool": "bool",
    "str": "str",
}
_MODEL_REQUIRED: Final = frozenset({"argv", "vram", "timeout_s", "max_attempts", "outputs"})
_MODEL_KEYS: Final = _MODEL_REQUIRED | {
    "description", "bad_input_exit_codes", "params", "oom_exit_codes", "oom_patterns",
    "mode", "serve_argv", "load_timeout_s", "idle_vram_mb", "extends",
}  # fmt: skip
_VRAM_KEYS: Final = frozenset({"base_mb", "mb_per_megapixel", "max_mb"})
_PARAM_KEYS: Final = frozenset({"type", "default", "min", "max", "choices", "description"})
_OUTPUT_KEYS: Final = frozenset({"name", "media_type", "required", "max_mb"})


def load_registry(user_file: Path | None = None) -> registry.Registry:
    """The built-in models, plus (replacing same-named ones) those in `user_file`."""
    models = _load_file(BUILTIN_FILE)
    if user_file is not None:
        try:
            models.update(_load_file(user_file))
        except errors.RegistryError as exc:  # where the path came from, for one set long ago
            raise errors.RegistryError(f"GPUJOBS_MODELS_FILE: {exc.message}") from exc
    return registry.Registry(MappingProxyType(models))


def _read_toml(path: Path) -> dict[str, object]:
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8").removeprefix("\ufeff"))  # an editor's BOM
    except FileNotFoundError:
        raise errors.RegistryError(f"{path}: file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise errors.RegistryError(f"{path}: not valid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise errors.RegistryError(f"{path}: cannot be read: {exc}") from exc


def _load_file(path: Path) -> dict[str, registry.ModelSpec]:
    document, loader = _read_toml(path), _Loader(path)
    loader.keys(document, {"models"}, {"models"}, "")
    models: dict[str, registry.ModelSpec] = {}
    tables = loader.of(document["models"], dict, "models", "a table")
    for name, value in tables.items():
        model = _Loader(path, name)
        model.check(bool(_MODEL_NAME.fullmatch(name)), None, f"a name must match {_MODEL_NAME.pattern}")
        models[name] = model.model(name, model.inherit(model.of(value, dict, None, "a table"), tables))
    loader.check(bool(models), "models", "defines no model")
    return models


@dataclass(frozen=True, slots=True)
class _Loader:
    """Reads one file (and one model in it); every error names the file, model and field."""

    file: Path
    model_name: str | None = None

    def error(self, field: str | None, problem: str) -> errors.RegistryError:
        model = [f"model '{self.model_name}'"] if self.model_name is not None else []
        named = [f"field '{field}'"] if field is not None else []
        return errors.RegistryError(": ".join([str(self.file), *model, *named, problem]))

    def check(self, ok: bool, field: str | None, problem: str) -> None:
        if not ok:
            raise self.error(field, problem)

    def model(self, name: str, table: dict[str, object]) -> registry.ModelSpec:
        self.keys(table, _MODEL_KEYS, _MODEL_REQUIRED, "")
        tables = self.of(table.get("params", {}), dict, "params", "a table")
        params = {param_name: self.param(param_name, value) for param_name, value in tables.items()}
        vram = self.of(table["vram"], dict, "vram", "a table")
        self.keys(vram, _VRAM_KEYS, {"base_mb"}, "vram")
        base_mb = int(self.number(vram["base_mb"], "vram.base_mb", integer=True, high=registry.MAX_VRAM_MB))
        max_mb, max_vram = vram.get("max_mb"), None
        if max_mb is not None:
            max_vram = int(
                self.number(max_mb, "vram.max_mb", True, max(base_mb, 1), high=registry.MAX_VRAM_MB)
            )
        return registry.ModelSpec(
            name=name,
            description=self.of(table.get("description", ""), str, "description", "a string"),
            argv=self.argv(table["argv"], params),
            params=MappingProxyType(params),
            base_mb=base_mb,
            mb_per_megapixel=float(
                self.number(
                    vram.get("mb_per_megapixel", 0), "vram.mb_per_megapixel", high=registry.MAX_VRAM_MB
                )
            ),
            max_vram_mb=max_vram,
            timeout_s=float(self.number(table["timeout_s"], "timeout_s", above=True)),
            max_attempts=int(
                self.number(
                    table["max_attempts"], "max_attempts", integer=True, low=1, high=registry.MAX_ATTEMPTS
                )
            ),
            bad_input_exit_codes=self.exit_codes(table.get("bad_input_exit_codes", [])),
            outputs=self.outputs(table["outputs"], params),
            oom_exit_codes=self.exit_codes(table.get("oom_exit_codes", []), "oom_exit_codes"),
            oom_patterns=self.patterns(table.get("oom_patterns", list(registry.DEFAULT_OOM_PATTERNS))),
            **self.warm(table),
        )

    def inherit(self, table: dict[str, object], tables: Mapping[str, object]) -> dict[str, object]:
        """`extends = "other"`: the other model's fields (same file), overridden by this table's;
        `params` one level deeper, parameter by parameter. The tables are read, never changed:
        whether a model extends another is seen as written, whichever of them was loaded first."""
        base = table.get("extends")
        if base is None:
            return table
        parent = tables.get(base) if isinstance(base, str) else None
        self.check(
            isinstance(parent, dict) and "extends" not in parent,
            "extends",
            "must name another model of this file that extends nothing",
        )
        assert isinstance(parent, dict)
        merged = {**parent, **{key: value for key, value in table.items() if key != "extends"}}
        # Redefining one parameter keeps the others: a child's argv still names them all.
        own, inherited = table.get("params"), parent.get("params")
        if isinstance(own, dict) and isinstance(inherited, dict):
            merged["params"] = {**inherited, **own}
        return merged

    def warm(self, table: Mapping[str, object]) -> dict[str, Any]:
        """mode, serve_argv, load_timeout_s and idle_vram_mb, checked together."""
        mode = table.get("mode", "oneshot")
        self.check(mode in registry.MODES, "mode", f"must be one of {', '.join(registry.MODES)}")
        serve = table.get("serve_argv", [])
        ok = isinstance(serve, list) and all(isinstance(item, str) for item in serve)
        self.check(
            ok and (mode != "persistent" or bool(serve)),
            "serve_argv",
            "must be a non-empty array of strings for a persistent model",
        )
        for index, element in enumerate(serve if isinstance(serve, list) else []):
            self.template(element, f"serve_argv[{index}]", {"python"})
        if isinstance(serve, list) and serve:
            self.program(serve[0], "serve_argv[0]", set())
        idle = table.get("idle_vram_mb")
        idle_mb = (
            None if idle is None else int(self.number(idle, "idle_vram_mb", True, high=registry.MAX_VRAM_MB))
        )
        return {
            "mode": mode,
            "serve_argv": tuple(serve) if isinstance(serve, list) else (),
            "load_timeout_s": float(
                self.number(table.get("load_timeout_s", 300), "load_timeout_s", above=True)
            ),
            "idle_vram_mb": idle_mb,
        }

    def param(self, name: str, value: object) -> registry.ParamSpec:
        at = f"params.{name}"
        self.check(bool(_PARAM_NAME.fullmatch(name)), at, f"a name must match {_PARAM_NAME.pattern}")
        self.check(
            name not in registry.BUILTIN_PLACEHOLDERS, at, "python, input and output_dir are reserved names"
        )
        table = self.of(value, dict, at, "a table")
        self.keys(table, _PARAM_KEYS, {"type"}, at)
        kind = _PARAM_TYPES.get(table["type"]) if isinstance(table["type"], str) else None
        if kind is None:
            raise self.error(f"{at}.type", f"must be one of int, float, bool, str, not {table['type']!r}")
        low, high = (self.bound(table, kind, f"{at}.{key}") for key in ("min", "max"))
        self.check(low is None or high is None or low <= high, f"{at}.min", f"must not be above max ({high})")
        description = self.of(table.get("description", ""), str, f"{at}.description", "a string")
        spec = registry.ParamSpec(name, kind, None, low, high, (), description)
        if "choices" in table:
            spec = replace(spec, choices=self.choices(spec, table["choices"]))
        if "default" in table:
            spec = replace(spec, default=self.checked(spec, table["default"], f"{at}.default"))
        return spec

    def bound(self, table: dict[str, object], kind: registry.ParamType, field: str) -> int | float | None:
        key = field.rpartition(".")[2]
        if key not in table:
            return None
        self.check(kind in ("int", "float"), field, "only int and float parameters have one")
        return self.number(table[key], field, kind == "int", -math.inf)

    def choices(self, spec: registry.ParamSpec, value: object) -> tuple[registry.Value, ...]:
        at = f"params.{spec.name}.choices"
        if spec.type == "bool" or not isinstance(value, list) or not value:
            raise self.error(at, "must be a non-empty array (and bool parameters have none)")
        choices = tuple(self.checked(spec, item, at) for item in value)
        self.check(len(set(choices)) == len(choices), at, "lists a value twice")
        return choices

    def checked(self, spec: registry.ParamSpec, value: object, field: str) -> registry.Value:
        try:
            return spec.coerce(value)
        except errors.InvalidParams as exc:
            raise self.error(field, exc.message.partition(": ")[2]) from None

    def argv(self, value: object, params: Mapping[str, registry.ParamSpec]) -> tuple[str, ...]:
        if not isinstance(value, list) or not value or not all(isinstance(item, str) for item in value):
            raise self.error("argv", "must be a non-empty array of strings")
        for index, element in enumerate(value):
            self.template(element, f"argv[{index}]", registry.BUILTIN_PLACEHOLDERS | params.keys())
        # The program is the operator's: a parameter there would let a request choose what runs.
        self.program(value[0], "argv[0]", params.keys())
        return tuple(value)

    def program(self, element: str, field: str, params: Set[str]) -> None:
        """A command's first element: a program, named without a request's parameter."""
        self.check(bool(element.strip()), field, "must name the program to run")
        named = {name for _, name, _, _ in string.Formatter().parse(element) if name is not None}
        self.check(
            not named & params, field, "must not hold a parameter: a request would choose the program to run"
        )

    def template(self, template: str, field: str, known: Set[str]) -> str:
        """`template` with every placeholder replaced by "x", once each is a known plain `{name}`."""
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as exc:
            raise self.error(field, f"{template!r}: {exc} (write {{{{ and }}}} for braces)") from None
        for _, name, spec, conversion in parsed:
            if name is not None and (spec or conversion or name not in known):
                listed = ", ".join(f"{{{k}}}" for k in sorted(known)) or "none"
                raise self.error(field, f"{template!r}: placeholders must be plain and one of {listed}")
        return "".join(text + ("x" if name is not None else "") for text, name, _, _ in parsed)

    def outputs(
        self, value: object, params: Mapping[str, registry.ParamSpec]
    ) -> tuple[registry.OutputSpec, ...]:
        if not isinstance(value, list) or not value:
            raise self.error("outputs", "must be a non-empty array of tables ([[models.<name>.outputs]])")
        outputs = tuple(self.output(f"outputs[{i}]", item, params) for i, item in enumerate(value))
        self.check(len({output.name for output in outputs}) == len(outputs), "outputs", "repeats a name")
        return outputs

    def output(self, at: str, value: object, params: Mapping[str, registry.ParamSpec]) -> registry.OutputSpec:
        table = self.of(value, dict, at, "a table")
        self.keys(table, _OUTPUT_KEYS, {"name"}, at)
        name = self.of(table["name"], str, f"{at}.name", "a string")
        skeleton = self.template(name, f"{at}.name", params.keys())
        self.check(bool(registry.PLAIN_FILE.fullmatch(skeleton)), f"{at}.name", "must be a plain file name")
        media_type = table.get("media_type")
        if media_type is not None and not (isinstance(media_type, str) and _MEDIA_TYPE.fullmatch(media_type)):
            raise self.error(f"{at}.media_type", "must be a media type such as model/gltf-binary")
        required = self.of(table.get("required", True), bool, f"{at}.required", "true or false")
        max_mb = self.number(table.get("max_mb", registry.DEFAULT_OUTPUT_MAX_MB), f"{at}.max_mb", True, 1)
        return registry.OutputSpec(name, media_type, required, int(max_mb))

    def exit_codes(self, value: object, field: str = "bad_input_exit_codes") -> frozenset[int]:
        codes = value if isinstance(value, list) else [None]
        if any(isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 255 for c in codes):
            raise self.error(field, "must be an array of exit codes from 1 to 255")
        return frozenset(codes)

    def patterns(self, value: object) -> tuple[str, ...]:
        items = self.of(value, list, "oom_patterns", "an array of regular expressions")
        for item in items:
            try:
                re.compile(self.of(item, str, "oom_patterns", "an array of regular expressions"))
            except re.error as exc:
                raise self.error("oom_patterns", f"{item!r} is not a regular expression ({exc})") from exc
        return tuple(items)

    def keys(self, table: Mapping[str, object], allowed: Set[str], required: Set[str], at: str) -> None:
        listed = ", ".join(sorted(allowed))
        for key in table:
            self.check(key in allowed, f"{at}.{key}".lstrip("."), f"unknown field (allowed: {listed})")
        for key in sorted(required - table.keys()):
            raise self.error(f"{at}.{key}".lstrip("."), "is required")

    def of(self, value: object, kind: type[_T], field: str | None, words: str) -> _T:
        if not isinstance(value, kind):
            raise self.error(field, f"must be {words}")
        return value

    def number(
        self,
        value: object,
        field: str,
        integer: bool = False,
        low: float = 0,
        above: bool = False,
        high: float = math.inf,
    ) -> int | float:
        kind = "an integer" if integer else "a number"
        if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
            raise self.error(field, f"must be {kind}")
        self.check(math.isfinite(value), field, f"must be {kind}, not {value}")
        bad = value <= low if above else value < low
        self.check(not bad, field, f"must be {kind} {'above' if above else 'of at least'} {low:g}")
        self.check(value <= high, field, f"must be {kind} of at most {high:.12g}")
        return value
