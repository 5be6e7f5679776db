"""Chrome-trace JSON schema and checks shared by the trace tests (unit, local, MPI).

The schema follows the Trace Event Format's JSON Object Format, restricted to what
Perfetto and chrome://tracing need from complete ("X") and metadata ("M") events. A
small validator for the subset of JSON Schema used here keeps the tests free of extra
packages.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

_INT = {"type": "integer", "minimum": 0}
_COMPLETE = {
    "type": "object",
    "required": ["name", "cat", "ph", "ts", "dur", "pid", "tid", "args"],
    "properties": {
        "name": {"type": "string"},
        "cat": {"enum": ["task", "message"]},
        "ph": {"const": "X"},
        "ts": {"type": "number", "minimum": 0},
        "dur": {"type": "number", "minimum": 0},
        "pid": _INT,
        "tid": _INT,
        "args": {"type": "object", "required": ["group"], "properties": {"group": _INT}},
    },
}
_METADATA = {
    "type": "object",
    "required": ["name", "ph", "pid", "tid", "args"],
    "properties": {
        "name": {"enum": ["process_name", "thread_name", "process_sort_index",
                          "thread_sort_index"]},
        "ph": {"const": "M"},
        "pid": _INT,
        "tid": _INT,
        "args": {"type": "object"},
    },
}
SCHEMA = {
    "type": "object",
    "required": ["traceEvents", "displayTimeUnit"],
    "properties": {
        "traceEvents": {"type": "array", "items": {"oneOf": [_COMPLETE, _METADATA]}},
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "otherData": {"type": "object"},
    },
}
_TYPES = {"object": dict, "array": list, "string": str, "number": (int, float), "integer": int}


def schema_errors(value: Any, schema: dict, where: str = "$") -> list[str]:
    """Where `value` breaks `schema` (type, required, properties, items, oneOf, enum,
    const, minimum); empty when it conforms."""
    errors: list[str] = []
    if "type" in schema:
        kind = _TYPES[schema["type"]]
        if isinstance(value, bool) or not isinstance(value, kind):
            return [f"{where}: expected {schema['type']}, got {value!r}"]
    if "const" in schema and value != schema["const"]:
        errors.append(f"{where}: expected {schema['const']!r}, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} not one of {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{where}: {value} < {schema['minimum']}")
    for key in schema.get("required", ()):
        if key not in value:
            errors.append(f"{where}: missing {key!r}")
    for key, sub in schema.get("properties", {}).items():
        if key in value:
            errors += schema_errors(value[key], sub, f"{where}.{key}")
    if "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{where}[{i}]")
    if "oneOf" in schema:
        matching = [s for s in schema["oneOf"] if not schema_errors(value, s, where)]
        if len(matching) != 1:
            errors.append(f"{where}: matches {len(matching)} of the oneOf schemas: {value!r}")
    return errors


def check_chrome_trace(trace: dict) -> dict[tuple[int, int], str]:
    """Asserts `trace` is schema-valid, JSON-serialisable, and that every slice sits on a
    named track of a named process; returns each track's (pid, tid) -> thread name."""
    assert json.loads(json.dumps(trace)) == trace
    errors = schema_errors(trace, SCHEMA)
    assert not errors, "\n".join(errors[:10])
    events = trace["traceEvents"]
    processes = {e["pid"] for e in events if e["name"] == "process_name" and e["ph"] == "M"}
    threads = [(e["pid"], e["tid"]) for e in events
               if e["name"] == "thread_name" and e["ph"] == "M"]
    assert len(threads) == len(set(threads)), f"a track is named twice: {threads}"
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["name"] == "thread_name" and e["ph"] == "M"}
    for e in events:
        if e["ph"] == "X":
            assert e["pid"] in processes and (e["pid"], e["tid"]) in names, e
            assert e["args"]["group"] == e["tid"] % 65536, e  # a group's thread tracks
    return names


def task_counts(trace: dict) -> Counter:
    """(pid, tid, task label) -> how many task slices the trace has."""
    return Counter((e["pid"], e["tid"], e["name"]) for e in trace["traceEvents"]
                   if e["ph"] == "X" and e["cat"] == "task")


def program_tasks(program: Any, groups: Any, pid_of: Any) -> Counter:
    """(pid, group, task label) -> how many labelled Runs `program` has on `groups`."""
    from jaxpp_mpi._src.ir.program import Run

    return Counter((pid_of(g), g, i.task) for g in groups
                   for i in program.group(g).instrs if isinstance(i, Run) and i.task)
