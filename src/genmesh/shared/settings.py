"""Options declared once, on the fields of typed configs.

A config is a frozen dataclass. A field declared with `option(...)` is an option: a
command-line flag (`--max-concurrency`, from the field name unless `flag` says otherwise)
with an environment variable (`GENMESH_MAX_CONCURRENCY`, from the flag unless `env` says
otherwise), help text, a parser for its text and a default. A field declared with
`group(...)` holds another config, whose options join the command (under a title in
--help when the group has one); `only` takes a few of them, which is how `genmesh up`
re-uses the options of the services it starts. A plain field is a setting the command line
does not reach: it keeps its default.

Everything else is derived from these declarations: the argparse flags, the variables, the
--help text (`[env GENMESH_X; default: Y]`), the typed config (`ConfigOptions.config`,
`parse`, `from_env`) and the way back to a command line or an environment for a child
process (`to_argv`, `to_env`). The rules, as `genmesh` has always had them:

- a flag wins over its variable, which wins over the default; an empty variable is unset;
- a variable that does not parse stops the command: `GENMESH_X='abc' is not a valid value
  for --flag`;
- a `bool` option is a switch (`--flag`, no value) that flips its default; its variable
  flips it when set to 1, true, yes or on;
- a `tuple` option with `repeat=True` takes its flag once per value; its variable is
  comma-separated;
- a `short` alias (`-n` for `--requests`) is taken as the flag, on the command line only;
- an option with a `bare` value may be given as its flag alone, which means that value
  (`--watch` is `--watch 2`);
- a `secret` never shows its value in --help and never goes on a command line (`to_argv`
  refuses it; `to_env` is how it travels);
- a field with a `default_factory` (a random id) is made anew by every parse that is not
  given a value, and is always written out by `to_argv`.

Hand-written rather than pydantic-settings: the CLI behaviour above is the spec, and
reproducing it (the help format, the error message, switches, comma-separated repeats,
defaults shown from the environment, rendering back to argv) would take as much glue as
this module, on top of a ~140 ms import for every command.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass, field
from types import NoneType, UnionType
from typing import Any, TypeVar

from genmesh.shared.ids import SUBJECT_TOKEN_RULE, is_subject_token

T = TypeVar("T")

ENV_PREFIX = "GENMESH_"
TRUE_WORDS = ("1", "true", "yes", "on")
_KEY = "genmesh.settings"


class _Derived:
    def __repr__(self) -> str:
        return "DERIVED"


# `env` of an option whose variable is named after its flag (GENMESH_ + FLAG_NAME).
DERIVED: Any = _Derived()


@dataclass(frozen=True, slots=True)
class Option:
    """How one field is given on the command line and in the environment."""

    help: str
    flag: str | None = None  # None: from the field name (max_concurrency: --max-concurrency)
    short: str | None = None  # a one-letter alias of the flag (`-n`), for commands typed often
    env: str | None = DERIVED  # None: no variable
    parse: Callable[[str], Any] | None = None  # None: from the field's type
    render: Callable[[Any], str] | None = None  # the way back to text; None: str / repr
    choices: tuple[str, ...] | None = None
    secret: bool = False
    repeat: bool = False
    positional: bool = False
    metavar: str | None = None
    bare: Any = None  # the value of the flag given alone (None: the flag takes a value)


@dataclass(frozen=True, slots=True)
class Group:
    """A field that holds another config, whose options join the command."""

    title: str | None = None
    description: str | None = None
    only: tuple[str, ...] | None = None  # these fields of it (None: all)


def option(
    default: Any = MISSING,
    *,
    help: str,
    flag: str | None = None,
    short: str | None = None,
    env: str | None = DERIVED,
    parse: Callable[[str], Any] | None = None,
    render: Callable[[Any], str] | None = None,
    choices: Sequence[str] | None = None,
    secret: bool = False,
    repeat: bool = False,
    positional: bool = False,
    metavar: str | None = None,
    bare: Any = None,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field that is also an option (see the module's docstring)."""
    declared = Option(
        help=help,
        flag=flag,
        short=short,
        env=env,
        parse=parse,
        render=render,
        choices=tuple(choices) if choices is not None else None,
        secret=secret,
        repeat=repeat,
        positional=positional,
        metavar=metavar,
        bare=bare,
    )
    if default_factory is not None:
        return field(default_factory=default_factory, metadata={_KEY: declared})
    return field(default=default, metadata={_KEY: declared})


def reuse(declared: Any) -> Any:
    """A field declared by the same `Option` as `declared` (an `option(...)` field), for an
    option several commands take as their own: `--router-policy` (routers, and frontends
    that route)."""
    return field(
        default=declared.default,
        default_factory=declared.default_factory,
        metadata=declared.metadata,
    )


def group(
    default: Any,
    *,
    title: str | None = None,
    description: str | None = None,
    only: Sequence[str] | None = None,
) -> Any:
    """A dataclass field holding the config `default`, whose options join the command.
    `default` also gives those options their defaults here (a worker's mock engine runs
    in real time, the mock's own default is instant)."""
    declared = Group(title, description, tuple(only) if only is not None else None)
    return field(default=default, metadata={_KEY: declared})


# --------------------------------------------------------------------------- parsers


class InvalidText(ValueError):
    """Raised by a parse function: its message says what a valid value is ("must be a
    number above 0"), for the one-line error that names the flag or variable."""


def positive_int(text: str) -> int:
    number = int(text)
    if number < 1:
        raise InvalidText("must be an integer above 0")
    return number


def non_negative_int(text: str) -> int:
    number = int(text)
    if number < 0:
        raise InvalidText("must be an integer of 0 or more")
    return number


def non_negative_float(text: str) -> float:
    number = float(text)
    if not 0 <= number < math.inf:  # NaN too
        raise InvalidText("must be a number of 0 or more")
    return number


def positive_float(text: str) -> float:
    number = float(text)
    if not 0 < number < math.inf:  # NaN too
        raise InvalidText("must be a number above 0")
    return number


def subject_token(text: str) -> str:
    """A name that stands as one NATS subject token: a namespace, a worker or router id."""
    if not is_subject_token(text):
        raise InvalidText(f"must be {SUBJECT_TOKEN_RULE}")
    return text


def token_ids(text: str) -> tuple[int, ...]:
    """`1,2,3` (spaces allowed)."""
    return tuple(int(part) for part in text.replace(" ", "").split(",") if part)


def render_token_ids(value: Sequence[int]) -> str:
    return ",".join(str(token) for token in value)


def is_true(text: str | None) -> bool:
    return (text or "").lower() in TRUE_WORDS


# --------------------------------------------------------------------------- declarations


class InvalidValue(ValueError):
    """A value for an option that does not parse (one line, for the operator)."""


@dataclass(frozen=True, slots=True)
class Spec:
    """One option of a command, resolved: where it sits in the config and how it reads."""

    path: tuple[str, ...]  # field names from the command's config down to this field
    option: Option
    flag: str
    env: str | None
    kind: str  # "value", "switch" or "list"
    parse: Callable[[str], Any]
    render: Callable[[Any], str]
    default: Any  # MISSING when required, or when `factory` makes it
    factory: Callable[[], Any] | None
    section: Group | None  # the titled group it is listed under in --help

    @property
    def dest(self) -> str:
        return ".".join(self.path)

    def error(self, raw: str, why: str = "") -> InvalidValue:
        reason = f": {why}" if why else ""
        return InvalidValue(f"{self.env}={raw!r} is not a valid value for {self.flag}{reason}")

    def from_text(self, raw: str) -> Any:
        """A variable's text as this option's value; InvalidValue if it does not parse."""
        if self.kind == "switch":
            return (not self.default) if is_true(raw) else self.default
        if self.kind == "list":
            return tuple(self._one(part.strip(), raw) for part in raw.split(",") if part.strip())
        return self._one(raw, raw)

    def _one(self, text: str, raw: str) -> Any:
        try:
            value = self.parse(text)
        except InvalidText as exc:
            raise self.error(raw, str(exc)) from exc
        except (TypeError, ValueError) as exc:
            raise self.error(raw) from exc
        if self.option.choices is not None and value not in self.option.choices:
            raise self.error(raw)
        return value

    def shown_default(self, value: Any) -> str:
        """The `default: Y` note of the help; a secret's value is never shown."""
        if value is MISSING or value is None or value in ("", ()) or self.kind == "switch":
            return ""
        if self.option.secret:
            return "set"
        if self.kind == "list":
            return f"default: {','.join(self.render(v) for v in value)}"
        return f"default: {self.render(value)}"


def _base_type(hint: Any) -> tuple[Any, bool]:
    """(the type an option's text parses to, whether None is allowed)."""
    if isinstance(hint, UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not NoneType]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _text_parser(hint: Any, declared: Option) -> tuple[str, Callable[[str], Any]]:
    base, optional = _base_type(hint)
    kind = "value"
    if base is bool:
        return "switch", bool
    if declared.repeat:
        kind = "list"
        args = typing.get_args(base)
        base = args[0] if args else str
    parse = declared.parse or base
    if parse not in (str, int, float) and declared.parse is None:
        raise TypeError(f"option of type {hint!r} needs a `parse` function")
    if optional and kind == "value" and parse is str:
        return kind, _str_or_none  # `--request-trace ""`: none
    return kind, parse


def _str_or_none(text: str) -> str | None:
    return text or None


def _renderer(declared: Option) -> Callable[[Any], str]:
    if declared.render is not None:
        return declared.render
    return lambda value: repr(value) if isinstance(value, float) else str(value)


def _flag_of(name: str, declared: Option) -> str:
    return declared.flag or "--" + name.replace("_", "-")


def env_name(flag: str) -> str:
    """The variable named after a flag: --nats-url -> GENMESH_NATS_URL."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _split_only(only: tuple[str, ...] | None, name: str) -> tuple[bool, tuple[str, ...] | None]:
    """(is field `name` taken, the `only` of its own fields) for `only` entries that may be
    dotted: ("engine", "worker.drain_timeout_s") takes `engine` whole and one field of
    `worker`."""
    if only is None or name in only:
        return True, None
    inner = tuple(p.split(".", 1)[1] for p in only if p.startswith(name + "."))
    return bool(inner), inner


def _walk(
    cls: type,
    instance: Any,
    given: bool,
    path: tuple[str, ...],
    only: tuple[str, ...] | None,
    section: Group | None,
) -> Iterator[Spec]:
    """The options of `cls`. Defaults come from `instance` when there is one: a group's
    declared default, or (`given`) the instance a caller passed, whose made-up ids count
    as chosen values rather than ids to make anew."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        taken, inner_only = _split_only(only, f.name)
        if not taken:
            continue
        declared = f.metadata.get(_KEY)
        if isinstance(declared, Group):
            inner = getattr(instance, f.name) if given else _field_default(f)
            yield from _walk(
                type(inner),
                inner,
                given,
                (*path, f.name),
                _merge_only(declared.only, inner_only),
                declared if declared.title else section,
            )
        elif isinstance(declared, Option):
            kind, parse = _text_parser(hints[f.name], declared)
            factory = None
            if given:
                default = getattr(instance, f.name)
            elif f.default_factory is not MISSING:
                default, factory = MISSING, f.default_factory
            elif instance is not None:
                default = getattr(instance, f.name)
            else:
                default = f.default
            flag = _flag_of(f.name, declared)
            env = env_name(flag) if declared.env is DERIVED else declared.env
            if declared.positional and env is not None:
                raise TypeError(f"positional option {f.name!r} cannot have a variable")
            yield Spec(
                path=(*path, f.name),
                option=declared,
                flag=flag,
                env=env,
                kind=kind,
                parse=parse,
                render=_renderer(declared),
                default=default,
                factory=factory,
                section=section,
            )


def _merge_only(
    declared: tuple[str, ...] | None, chosen: tuple[str, ...] | None
) -> tuple[str, ...] | None:
    if declared is None:
        return chosen
    if chosen is None:
        return declared
    return tuple(name for name in chosen if name in declared)


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise TypeError(f"group field {f.name!r} needs a default config")


def specs(cls: type, defaults: Any = None) -> list[Spec]:
    """Every option of `cls`; with `defaults` (an instance), its values are the defaults."""
    return list(_walk(cls, defaults, defaults is not None, (), None, None))


def variables(cls: type) -> list[str]:
    """The environment variables the options of `cls` read."""
    return [s.env for s in specs(cls) if s.env is not None]


# --------------------------------------------------------------------------- argparse


class ConfigOptions:
    """The options of one config class as one command takes them: added to an argparse
    parser, and read back from its namespace as the typed config."""

    def __init__(self, cls: type, defaults: Any = None) -> None:
        self.cls = cls
        self.defaults = defaults
        self.specs = specs(cls, defaults)
        # What the variables of `repeat` options held: used when the flag is not given.
        self._listed: dict[str, tuple[Any, ...]] = {}

    def add_to(self, parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
        """Add every option to `parser`, with its variable (from `environ`) as its default;
        a variable that does not parse is the parser's error."""
        sections: dict[Group, argparse._ArgumentGroup] = {}
        for spec in self.specs:
            target: argparse.ArgumentParser | argparse._ArgumentGroup = parser
            if spec.section is not None:
                if spec.section not in sections:
                    sections[spec.section] = parser.add_argument_group(
                        spec.section.title, spec.section.description
                    )
                target = sections[spec.section]
            raw = environ.get(spec.env, "") if spec.env else ""
            try:
                value = spec.from_text(raw) if raw else spec.default
            except InvalidValue as exc:
                parser.error(str(exc))
            self._add(target, spec, value)
            if spec.kind == "list" and raw:
                self._listed[spec.dest] = value

    @staticmethod
    def _add(
        target: argparse.ArgumentParser | argparse._ArgumentGroup, spec: Spec, value: Any
    ) -> None:
        declared = spec.option
        notes = [f"env {spec.env}"] if spec.env else []
        if spec.kind == "list" and spec.env:
            notes[0] += ", comma-separated"
        shown = spec.shown_default(spec.default if spec.kind == "list" else value)
        if shown:
            notes.append(shown)
        text = _escape(declared.help + (f" [{'; '.join(notes)}]" if notes else ""))
        if declared.positional:
            target.add_argument(
                spec.dest,
                type=_argparse_type(spec.parse),
                nargs="+" if spec.kind == "list" else None,
                choices=declared.choices,
                metavar=declared.metavar,
                help=text,
            )
        elif spec.kind == "switch":
            target.add_argument(
                spec.flag,
                dest=spec.dest,
                action="store_false" if spec.default else "store_true",
                default=value,
                help=text,
            )
        else:
            target.add_argument(
                *([declared.short] if declared.short else []),
                spec.flag,
                dest=spec.dest,
                type=_argparse_type(spec.parse),
                action="append" if spec.kind == "list" else "store",
                nargs=None if declared.bare is None else "?",
                const=declared.bare,
                default=None if value is MISSING or spec.kind == "list" else value,
                choices=declared.choices,
                required=value is MISSING and spec.factory is None,
                metavar=declared.metavar or _metavar(spec),
                help=text,
            )

    def config(self, namespace: argparse.Namespace) -> Any:
        """The typed config from a namespace this parser filled."""
        values: dict[str, Any] = {}
        for spec in self.specs:
            value = getattr(namespace, spec.dest)
            if spec.kind == "list":
                if value:
                    value = tuple(value)
                elif spec.dest in self._listed:
                    value = self._listed[spec.dest]
                else:
                    value = () if spec.default is MISSING else spec.default
            elif value is None and spec.factory is not None:
                value = spec.factory()
            values[spec.dest] = value
        return _assemble(self.cls, self.defaults, (), values)


def _assemble(cls: type, instance: Any, path: tuple[str, ...], values: Mapping[str, Any]) -> Any:
    """`cls` with the option values in `values` (by dest); every other field from
    `instance` (a group's default, or a caller's defaults), else its own default."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        dest = ".".join((*path, f.name))
        declared = f.metadata.get(_KEY)
        if isinstance(declared, Group):
            inner = getattr(instance, f.name) if instance is not None else _field_default(f)
            kwargs[f.name] = _assemble(type(inner), inner, (*path, f.name), values)
        elif dest in values:
            kwargs[f.name] = values[dest]
        elif instance is not None:
            kwargs[f.name] = getattr(instance, f.name)
    return cls(**kwargs)


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` for argparse: an `InvalidText` reason goes into its one-line error
    (`argument --timeout: '-5' must be a number above 0`)."""

    def parse_arg(text: str) -> Any:
        try:
            return parse(text)
        except InvalidText as exc:
            raise argparse.ArgumentTypeError(f"{text!r} {exc}") from None

    # argparse names the type in its own error ("invalid int value: 'x'").
    parse_arg.__name__ = getattr(parse, "__name__", "value")
    return parse_arg


def _metavar(spec: Spec) -> str | None:
    if spec.option.choices is not None:
        return None  # argparse shows them: {debug,info,warning,error}
    return spec.flag.lstrip("-").replace("-", "_").upper()


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse %-formats help texts


def parse(
    cls: type[T],
    argv: Sequence[str],
    *,
    environ: Mapping[str, str] | None = None,
    defaults: T | None = None,
    prog: str = "genmesh",
) -> T:
    """`cls` from command-line arguments and `environ` (default: ours); with `defaults`,
    options not given keep that instance's values instead of the declared defaults."""
    parser = argparse.ArgumentParser(prog=prog)
    options = ConfigOptions(cls, defaults)
    options.add_to(parser, os.environ if environ is None else environ)
    config: T = options.config(parser.parse_args(list(argv)))
    return config


def from_env(cls: type[T], environ: Mapping[str, str] | None = None) -> T:
    """`cls` from its variables alone (for embedders); InvalidValue on a bad value."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for spec in specs(cls):
        raw = env.get(spec.env, "") if spec.env else ""
        if raw:
            values[spec.dest] = spec.from_text(raw)
        elif spec.factory is not None:
            values[spec.dest] = spec.factory()
        elif spec.default is MISSING:
            raise InvalidValue(f"{spec.env or spec.flag} is required")
    return typing.cast(T, _assemble(cls, None, (), values))


# --------------------------------------------------------------------------- back to text


def _value_at(config: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        config = getattr(config, name)
    return config


def _changed(spec: Spec, value: Any) -> bool:
    return spec.default is MISSING or value != spec.default


def to_argv(config: Any) -> list[str]:
    """The command-line arguments that give `config` back (`parse(type(config), ...)`):
    every option that differs from its declared default. Secrets never go on a command
    line: a config holding one is refused (give it with `to_env`)."""
    argv: list[str] = []
    positional: list[str] = []
    for spec in specs(type(config)):
        value = _value_at(config, spec.path)
        if value is None or not _changed(spec, value):
            continue
        if spec.option.secret:
            raise ValueError(f"{spec.flag} is a secret: pass it in the environment (to_env)")
        if spec.kind == "switch":
            argv.append(spec.flag)
        elif spec.kind == "list":
            if spec.option.positional:
                positional += [spec.render(v) for v in value]
            else:
                for item in value:
                    argv += [spec.flag, spec.render(item)]
        elif spec.option.positional:
            positional.append(spec.render(value))
        else:
            argv += [spec.flag, spec.render(value)]
    return positional + argv


def to_env(config: Any) -> dict[str, str]:
    """The variables that give `config` to a child process: every option that differs
    from its default (secrets included: this is how they travel)."""
    env: dict[str, str] = {}
    for spec in specs(type(config)):
        value = _value_at(config, spec.path)
        if spec.env is None or value is None or value == "" or not _changed(spec, value):
            continue
        if spec.kind == "switch":
            env[spec.env] = "true"
        elif spec.kind == "list":
            env[spec.env] = ",".join(spec.render(v) for v in value)
        else:
            env[spec.env] = spec.render(value)
    return env
