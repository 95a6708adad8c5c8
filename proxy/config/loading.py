"""Reading a config file: YAML hardened against what would exhaust us (size, depth, aliases),
duplicate keys refused, and `${VAR}` / `${VAR:-default}` replaced from the environment."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from policies.core.settings import Collector, ConfigError, ConfigErrors, join

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")

# A config is a few levels deep; yaml's composer recurses once per level and overflows the
# stack near 330, and aliases can make a small file expand without bound.
MAX_CONFIG_BYTES = 1024 * 1024
MAX_DEPTH = 64
MAX_VALUES = 100_000


class DuplicateKeys(ConfigErrors):
    """Keys repeated in their mapping. `document` is the file as YAML reads it (the last of
    each repeated key wins), so the rest of the config can be checked in the same run."""

    def __init__(self, errors: list[ConfigError], document: Any) -> None:
        super().__init__(errors)
        self.document = document


class _Refused(yaml.MarkedYAMLError):
    """A document PyYAML would read, refused because reading it further would exhaust us."""


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans (only true/false, so `on:` (retry.on) stays a key) and
    no timestamps (a date stays a string); it refuses nesting deeper than MAX_DEPTH."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise _Refused(problem=f"nested deeper than {MAX_DEPTH} levels", problem_mark=mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_Loader.yaml_implicit_resolvers = {
    first: [
        (tag, rx)
        for tag, rx in resolvers
        if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:timestamp")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)


def interpolate(node: Any, env: Mapping[str, str], path: str = "") -> Any:
    """Replace `${VAR}` (or `${VAR:-default}`) in every string; a missing variable is an error."""
    collect = Collector()
    done = interpolate_into(node, env, path, collect)
    collect.raise_any()
    return done


def interpolate_into(
    node: Any,
    env: Mapping[str, str],
    path: str,
    collect: Collector,
    sources: dict[str, tuple[str, ...]] | None = None,
) -> Any:
    """`interpolate`, recording each missing variable and leaving its `${VAR}` in place. With
    `sources`, the variables each interpolated string read are recorded by its YAML path: once
    replaced, only they can say which variable to export for a value that came out empty."""
    if isinstance(node, dict):
        return {
            k: interpolate_into(v, env, join(path, str(k)), collect, sources)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [
            interpolate_into(v, env, f"{path}[{i}]", collect, sources) for i, v in enumerate(node)
        ]
    if isinstance(node, str) and "${" in node:
        if sources is not None:
            sources[path] = tuple(m.group(1) for m in _ENV.finditer(node))

        def sub(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name in env:
                return env[name]
            if default is not None:
                return default
            collect.add(path, f"environment variable {name} is not set")
            return m.group(0)

        return _ENV.sub(sub, node)
    return node


def read_config_file(path: str | Path) -> bytes:
    """The bytes of config file `path`; one that cannot be read or is too big is a ConfigError."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError("", f"cannot read config {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError("", f"config {path} is larger than {MAX_CONFIG_BYTES} bytes")
    return data


def read_document(path: str | Path, data: bytes | None = None) -> Any:
    """The YAML document in file `path` (whose bytes are `data` when already read). A file
    that cannot be read, is not UTF-8, is not YAML, or is too big, deep or alias-expanded to
    handle is a ConfigError; one that repeats a key is DuplicateKeys, which carries the document
    all the same."""
    if data is None:
        data = read_config_file(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            "", f"{path} is not UTF-8 text: byte 0x{data[exc.start]:02x} on line {line}"
        ) from None
    try:
        loader = _Loader(text)  # refuses non-printable characters already
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            duplicates = _duplicate_keys(loader, node)
            document = loader.construct_document(node)
            if duplicates:
                raise DuplicateKeys(duplicates, document)
            return document
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise ConfigError("", _yaml_problem(path, exc, text)) from None
    except ValueError as exc:  # a scalar its explicit tag cannot hold: `!!timestamp 2024-02-30`
        raise ConfigError("", f"{path} is not valid YAML: {exc}") from None


def _duplicate_keys(loader: _Loader, root: yaml.Node) -> list[ConfigError]:
    """Every key repeated in its mapping (YAML would silently keep the last), walking the
    document as aliases expand it: too deep (an alias inside itself) or too big is refused."""
    problems: list[ConfigError] = []
    checked: set[int] = set()  # an aliased mapping is visited once per alias, checked once
    stack: list[tuple[yaml.Node, str, int]] = [(root, "", 1)]
    visited = 0
    while stack:
        node, path, depth = stack.pop()
        visited += 1
        if depth > MAX_DEPTH:
            limit = f"nested deeper than {MAX_DEPTH} levels"
        elif visited > MAX_VALUES:
            limit = f"more than {MAX_VALUES} values"
        else:
            limit = ""
        if limit:
            raise _Refused(problem=f"{limit} once aliases expand", problem_mark=node.start_mark)
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Node] = {}
            check = id(node) not in checked
            checked.add(id(node))
            for key_node, value_node in node.value:
                where = path
                if key_node.tag != "tag:yaml.org,2002:merge":  # `<<: *base` overrides by design
                    key = _scalar_key(loader, key_node)
                    where = join(path, str(key))
                    if check and key in first:
                        line = first[key].start_mark.line + 1
                        problems.append(ConfigError(where, f"duplicate key (first at line {line})"))
                    elif key is not _NOT_SCALAR:
                        first[key] = key_node
                stack.append((value_node, where, depth + 1))
    return sorted(problems, key=lambda e: e.path)


_NOT_SCALAR = object()  # a collection as a key: construction refuses it as unhashable


def _scalar_key(loader: _Loader, node: yaml.Node) -> Any:
    if not isinstance(node, yaml.ScalarNode):
        return _NOT_SCALAR
    return loader.construct_object(node)


def _yaml_problem(path: str | Path, exc: yaml.YAMLError, text: str) -> str:
    """One line saying where and why PyYAML (or our limits) refused the document."""
    if isinstance(exc, yaml.reader.ReaderError):
        line = text.count("\n", 0, exc.position) + 1
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        return f"{path} is not valid YAML at line {line}: {exc.reason} (#x{char:04x})"
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
    verdict = "is refused" if isinstance(exc, _Refused) else "is not valid YAML"
    return f"{path} {verdict}{where}: {problem}"
