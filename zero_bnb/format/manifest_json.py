"""The JSON shape a manifest must have before it is read: bounded size and nesting, and every field the readers
index or compute with of its JSON type (bools are not ints). Pure; local.
"""

from __future__ import annotations

import re
from typing import Any

from zero_bnb.errors import CheckpointFormatError
from zero_bnb.format.digests import ALGORITHMS, SHA256
from zero_bnb.format.masters import FULL

__all__ = ["MAX_MANIFEST_BYTES", "MAX_MANIFEST_DEPTH", "check_bounds", "check_types", "json_is", "json_items"]

#: Largest manifest read: about 500 000 parameters (zero_bnb writes ~130 bytes per parameter).
MAX_MANIFEST_BYTES = 64 << 20
#: Deepest JSON nesting read (zero_bnb writes 6 levels).
MAX_MANIFEST_DEPTH = 32
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_INNERMOST = re.compile(r"\[\]|\{\}")
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "dp_world_size": int, "block_size": int, "optimizer_class": str, "optimizer_spec": str, "groups": list,
    "shards": list, "files": list, "non_finite": dict, "versions": dict, "format_version": int,
}
_OPTIONAL_TYPES: dict[str, type] = {"module_file": str, "module_sha256": str, "module_digest": str,
                                     "migrated_from": dict}


def check_bounds(text: str, source: str) -> None:
    """Refuse, before parsing, a manifest larger than :data:`MAX_MANIFEST_BYTES` or nested deeper than
    :data:`MAX_MANIFEST_DEPTH` (linear: strings and other characters dropped, then innermost pairs, level by level)."""
    if len(text) > MAX_MANIFEST_BYTES:
        raise CheckpointFormatError(
            f"{source} holds {len(text)} characters, more than the {MAX_MANIFEST_BYTES} a manifest may have "
            f"(about 500 000 parameters); it was not written by zero_bnb or was edited"
        )
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    for _ in range(MAX_MANIFEST_DEPTH):
        brackets, found = _INNERMOST.subn("", brackets)
        if not found:
            break
    else:
        found = _INNERMOST.search(brackets) is not None
    if found or len(brackets) > MAX_MANIFEST_DEPTH:  # deeper, or a long run left unclosed (json would recurse)
        raise CheckpointFormatError(
            f"{source} nests JSON arrays or objects deeper than the {MAX_MANIFEST_DEPTH} levels a manifest may have; "
            f"it was not written by zero_bnb or was edited"
        )


def json_is(value: Any, kind: type | tuple[type, ...]) -> bool:
    """``isinstance`` where a JSON ``true`` is not an int."""
    return isinstance(value, kind) and not (isinstance(value, bool) and kind is int)


def json_items(value: Any) -> list:
    """``value`` if it is a JSON array, else ``[]`` (its type is reported on its own)."""
    return value if isinstance(value, list) else []


def check_types(data: dict[str, Any], source: str) -> None:
    """Every field the readers index or compute with has its JSON type (bools are not ints)."""
    problems = [f"{name} must be {getattr(kind, '__name__', kind)}" for name, kind in _FIELD_TYPES.items()
                if not json_is(data.get(name), kind)]
    problems += [f"{name} must be {kind.__name__}" for name, kind in _OPTIONAL_TYPES.items()
                 if name in data and not json_is(data[name], kind)]
    for g, group in enumerate(json_items(data.get("groups"))):
        if not isinstance(group, dict):
            problems.append(f"groups[{g}] must be an object")
            continue
        ints = [("numel", group.get("numel"))]
        ints += [(f"params[{p}].offset", param.get("offset")) for p, param in enumerate(json_items(group.get("params")))
                 if isinstance(param, dict)]
        ints += [(f"params[{p}].shape", size) for p, param in enumerate(json_items(group.get("params")))
                 if isinstance(param, dict) for size in (param.get("shape") if isinstance(param.get("shape"), list) else [None])]
        ints += [(name, bound) for name in ("element_ranges", "block_ranges")
                 for pair in (group.get(name) if isinstance(group.get(name), list) else [[None]])
                 for bound in (pair if isinstance(pair, list) else [None])]
        ints += [(f"states[{s}].lead", size) for s, state in enumerate(json_items(group.get("states")))
                 if isinstance(state, dict) for size in (state.get("lead", []) if isinstance(state.get("lead", []), list) else [None])]
        problems += [f"groups[{g}].{name} must hold integers" for name, value in ints if not json_is(value, int)]
        strings = [(f"params[{p}].name", param.get("name")) for p, param in enumerate(json_items(group.get("params")))
                   if isinstance(param, dict)]
        strings += [("masters", group.get("masters", FULL))]
        strings += [(f"states[{s}].{key}", state.get(key)) for s, state in enumerate(json_items(group.get("states")))
                    if isinstance(state, dict) for key in ("key", "dtype", "reason")]
        problems += [f"groups[{g}].{name} must be a string" for name, value in strings if not isinstance(value, str)]
    batch = data.get("batch", {})
    if not (isinstance(batch, dict) and (not batch or (set(batch) == {"global", "micro", "accumulation", "dp"} and all(
            json_is(value, int) and value > 0 for value in batch.values())))):
        problems.append("batch must be {} or {global, micro, accumulation, dp: positive integers}")
    non_finite = data.get("non_finite")
    if isinstance(non_finite, dict) and not all(isinstance(v, list) and all(isinstance(k, str) for k in v)
                                                for v in non_finite.values()):
        problems.append("non_finite must map parameter names to lists of strings")
    # version 4 names each file's digest algorithm by its key, and the module file's digest module_digest; earlier
    # versions hold SHA-256 only, the module file's as module_sha256
    modern = json_is(data.get("format_version"), int) and data["format_version"] >= 4
    algorithms = ALGORITHMS if modern else (SHA256,)
    other = "module_sha256" if modern else "module_digest"
    if other in data:
        problems.append(f"{other} is not a field of format version {data.get('format_version')!r}")
    for f, record in enumerate(json_items(data.get("files"))):
        if not (isinstance(record, dict) and isinstance(record.get("path"), str) and json_is(record.get("size"), int)
                and len(set(record) - {"path", "size"}) == 1
                and any(isinstance(record.get(name), str) for name in algorithms)):
            problems.append(f"files[{f}] must be {{path: string, size: integer, <algorithm>: string}} with one "
                            f"algorithm of {list(algorithms)}")
    if problems:
        raise CheckpointFormatError(f"{source} has malformed fields: {'; '.join(problems[:8])}; the manifest was not "
                                    f"written by zero_bnb or was edited")
