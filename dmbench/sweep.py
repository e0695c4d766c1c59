"""YAML sweep files -> frozen dataclasses.

A sweep file has these top-level keys (all optional except that it needs cases)::

    name: window                  # defaults to the file stem; a plain file name
    description: free text
    backends: [triton, sdpa]      # names from dmbench.backends.BACKEND_NAMES
    timing: {warmup: 5, repeats: 30, budget_s: 10.0, flush_l2: true, cuda_graph: false}
    check: false                  # also check accuracy against the fp64 reference while timing
    defaults: {causal: true}      # case keys shared by every grid point and listed case
    grid: {...} or [{...}, ...]   # each value a scalar or a list; cartesian product per grid
    cases: [{...}, ...]           # explicit points

Case keys: batch, heads ("16/4", {q: 16, kv: 4} or 8 for MHA), seqlen (2048, "1/65536" or
{q: 1, k: 65536}), head_dim, window, causal, dtype (bf16/fp16/fp32), mask (none, topk,
block_topk, block_sparse, sliding, random, document), mask_shape, mask_format (bool, intervals,
varlen), documents (explicit document lengths), bias (none, kv_row, kv_full, q_full, shared or
an explicit shape), seed.

What the case keys' values mean (mask formats, axis tokens of shapes, the ``A/B`` form of
heads and seqlen): ``dmbench.case``.

Every problem is reported as a ``ConfigError`` with one line naming the file and the key; a key
given twice in one mapping, at any depth, is one too (``UniqueKeyLoader``), with its line. A point
that cannot run (``case.case_problem``) is an error too, except in a grid, which skips it with
the reason; but a heads value that cannot run is an error wherever it is not one value of a grid
axis, and so is a sweep none of whose points can run.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from .case import (AXIS_TOKENS, BIAS_KINDS, FULL_MASK_SHAPE, MASK_FORMATS, MASK_KINDS, WINDOW_MASKS,
                   Case, case_problem, format_problem, heads_problem, parse_pair)
from .errors import ConfigError

DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
          "half": "fp16", "fp32": "fp32", "float32": "fp32"}
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Timing:
    """How each point is timed. ``repeats`` and ``budget_s`` are per point in all. With
    ``rounds`` > 1, a case's points are timed round-robin, ``rounds`` times each, and a row pools
    its rounds' samples: a slow spell of the host then falls on every backend alike instead of
    on whichever one was being timed (sub-millisecond rows are host-bound, see the runner).
    With ``cuda_graph`` each point's call is captured once into a CUDA graph and every timed
    repeat replays it (``dmbench.timing``), which takes the host's time per call out."""

    warmup: int = 5
    repeats: int = 30
    budget_s: float = 10.0
    flush_l2: bool = True
    rounds: int = 1
    cuda_graph: bool = False

    @property
    def kind(self) -> str:
        """How the calls are timed, as the CSV's ``timing`` column says: eager or cuda_graph."""
        return "cuda_graph" if self.cuda_graph else "eager"

    def per_round(self) -> "Timing":
        """The timing of one round: warmup each round (other backends ran in between), the
        repeats and the budget shared out."""
        if self.rounds == 1:
            return self
        return replace(self, repeats=-(-self.repeats // self.rounds),
                       budget_s=self.budget_s / self.rounds, rounds=1)


@dataclass(frozen=True)
class SkippedCase:
    case: Case
    reason: str


@dataclass(frozen=True)
class Sweep:
    name: str
    path: str
    backends: tuple[str, ...]
    timing: Timing
    check: bool
    cases: tuple[Case, ...]
    skipped: tuple[SkippedCase, ...] = field(default=())


CASE_KEYS = ("batch", "heads", "seqlen", "head_dim", "window", "causal", "dtype", "mask",
             "mask_shape", "mask_format", "documents", "bias", "seed")
REQUIRED_CASE_KEYS = ("batch", "heads", "seqlen", "head_dim")
TOP_KEYS = ("name", "description", "backends", "timing", "check", "defaults", "grid", "cases")
DEFAULT_BACKENDS = ("triton", "sdpa", "sdpa-dense", "flex", "fdma", "fa4")


class _Where:
    """Builds 'file: key: message' lines."""

    def __init__(self, path: str):
        self.path = path

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.path}: {key}: {message}")


def _positive_int(where: _Where, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise where.error(key, f"expected a positive integer, got {value!r}")
    return value


def _pair(where: _Where, key: str, value: Any, names: tuple[str, str]) -> tuple[int, int]:
    """'16/4', {q: 16, kv: 4} or a single int meaning both equal (the 'A/B' text through
    ``case.parse_pair``, as every parse of that form)."""
    first, second = names
    expected = f"expected an integer, '{first.upper()}/{second.upper()}' or {{{first}: .., {second}: ..}}"
    if isinstance(value, int) and not isinstance(value, bool):
        n = _positive_int(where, key, value)
        return n, n
    if isinstance(value, str):
        pair = parse_pair(value)
        if pair is None:
            raise where.error(key, f"{expected}, got {value!r}")
        return _positive_int(where, key, pair[0]), _positive_int(where, key, pair[1])
    if isinstance(value, dict):
        if set(value) != {first, second}:
            raise where.error(key, f"{expected}, got keys {sorted(map(str, value))}")
        return (_positive_int(where, f"{key}.{first}", value[first]),
                _positive_int(where, f"{key}.{second}", value[second]))
    raise where.error(key, f"{expected}, got {value!r}")


def _shape_tokens(where: _Where, key: str, value: Any) -> str:
    tokens = value.split("x") if isinstance(value, str) else []
    if len(tokens) != 4 or any(t not in allowed for t, allowed in zip(tokens, AXIS_TOKENS)):
        raise where.error(key, "expected four axis tokens joined by 'x' from "
                          "(1|B)x(1|Hk|Hq)x(1|Lq)x(1|Lk), e.g. 'BxHkx1xLk', got " f"{value!r}")
    return value


def _as_written(value: Any) -> str:
    """A heads or seqlen value as a sweep file writes it: ``"3/2"``, ``{q: 3, kv: 2}``."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)


def _parse_case(where: _Where, key: str, raw: dict[str, Any], defaults: dict[str, Any],
                axes: frozenset[str] = frozenset()) -> Case:
    """``raw`` is the case's own keys (a grid point or a listed case); ``defaults`` fills the
    rest. A bad value is reported where it is written: ``defaults.<name>`` or ``<key>.<name>``.
    ``axes`` are the grid's list-valued keys: a heads value that cannot run is an error unless
    it is one value of such an axis (then the point is skipped, ``case_problem``), since a value
    in ``defaults``, a listed case or a grid's scalar reaches only points that cannot run."""

    own = raw

    def at(name: str) -> str:
        return f"{key}.{name}" if name in own or name not in defaults else f"defaults.{name}"

    unknown = sorted(set(raw) - set(CASE_KEYS))
    if unknown:
        raise where.error(f"{key}.{unknown[0]}", f"unknown key; expected one of {', '.join(CASE_KEYS)}")
    raw = {**defaults, **raw}
    missing = [k for k in REQUIRED_CASE_KEYS if k not in raw]
    if missing:
        raise where.error(f"{key}.{missing[0]}", "missing (set it in the case, the grid or defaults)")
    heads_q, heads_kv = _pair(where, at("heads"), raw["heads"], ("q", "kv"))
    problem = heads_problem(heads_q, heads_kv)
    if problem and not ("heads" in own and "heads" in axes):
        raise where.error(at("heads"), f"{_as_written(raw['heads'])}: {problem}")
    seqlen_q, seqlen_k = _pair(where, at("seqlen"), raw["seqlen"], ("q", "k"))
    head_dim = _positive_int(where, at("head_dim"), raw["head_dim"])
    if head_dim > MAX_HEAD_DIM:
        raise where.error(at("head_dim"), f"expected at most {MAX_HEAD_DIM}, got {head_dim}")
    window = raw.get("window")
    if window is not None:
        window = _positive_int(where, at("window"), window)
    causal = raw.get("causal", False)
    if not isinstance(causal, bool):
        raise where.error(at("causal"), f"expected true or false, got {causal!r}")
    dtype = raw.get("dtype", "bf16")
    if dtype not in DTYPES:
        raise where.error(at("dtype"), f"expected one of bf16, fp16, fp32, got {dtype!r}")
    mask = raw.get("mask", "none")
    if mask not in MASK_KINDS:
        raise where.error(at("mask"), f"expected one of {', '.join(MASK_KINDS)}, got {mask!r}")
    mask_shape = _shape_tokens(where, at("mask_shape"), raw.get("mask_shape", FULL_MASK_SHAPE))
    bias = raw.get("bias", "none")
    if bias not in BIAS_KINDS:
        try:
            _shape_tokens(where, at("bias"), bias)
        except ConfigError:
            raise where.error(at("bias"), f"expected one of {', '.join(BIAS_KINDS)} or a shape "
                              f"like '1xHqxLqx1', got {bias!r}") from None
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise where.error(at("seed"), f"expected a non-negative integer, got {seed!r}")
    documents = _documents(where, at("documents"), raw.get("documents"), mask)
    if mask not in WINDOW_MASKS or documents is not None:
        window = None  # the window only means something for window masks
    mask_format = raw.get("mask_format", "bool")
    if mask_format not in MASK_FORMATS:
        raise where.error(at("mask_format"),
                          f"expected one of {', '.join(MASK_FORMATS)}, got {mask_format!r}")
    batch = _positive_int(where, at("batch"), raw["batch"])
    case = Case(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, window, causal,
                DTYPES[dtype], mask, mask_shape, bias, seed, mask_format, documents)
    problem = format_problem(case)
    if problem:
        raise where.error(at("mask_format"), problem)
    return case


def _documents(where: _Where, key: str, value: Any, mask: str) -> tuple[int, ...] | None:
    """Explicit document lengths (a list of non-negative integers), only for mask document."""
    if value is None:
        return None
    if mask != "document":
        raise where.error(key, f"documents needs mask document, got mask {mask!r}")
    if (not isinstance(value, list) or not value
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in value)):
        raise where.error(key, f"expected a non-empty list of non-negative integers (document "
                          f"lengths), got {value!r}")
    return tuple(value)


def _grid_points(where: _Where, key: str, grid: Any) -> tuple[list[dict[str, Any]], frozenset[str]]:
    """The grid's points, and its axes (the keys given a list)."""
    if not isinstance(grid, dict):
        raise where.error(key, f"expected a mapping of case keys to values or lists, got {type(grid).__name__}")
    names = list(grid)
    axes = []
    for name in names:
        values = grid[name]
        # A list is an axis, except that a heads/seqlen dict is one value; lists of lists are
        # not meaningful for any key.
        axes.append(values if isinstance(values, list) else [values])
        if not axes[-1]:
            raise where.error(f"{key}.{name}", "empty list")
    points = [dict(zip(names, combo)) for combo in itertools.product(*axes)]
    return points, frozenset(name for name in names if isinstance(grid[name], list))


def file_name_problem(name: str) -> str | None:
    """Why ``name`` is not a plain file name (one that stays in the folder it is joined to), or
    None: empty, ``.`` or ``..``, a path separator (``/`` or ``\\``, so no ``..`` component and
    nothing absolute), or a NUL character."""
    if not name:
        return "is empty"
    if name in (".", ".."):
        return f"is {name!r}"
    for char, label in (("/", "'/'"), ("\\", "'\\'"), ("\0", "a NUL character")):
        if char in name:
            return f"contains {label}"
    return None


def _results_name(where: _Where, raw: dict[str, Any], path: str) -> str:
    """The sweep's name (default: the file stem), which names its default results files
    (``results/<gpu>/<name>-<command>.csv``) and their charts: a plain file name."""
    expected = "expected a plain file name (it names the results files in results/<gpu>/)"
    if "name" not in raw:
        stem = Path(path).stem
        problem = file_name_problem(stem)
        if problem:
            raise where.error("name", f"absent, so the file stem {stem!r} would name the "
                              f"results files, but it {problem}: set name to a plain file name")
        return stem
    name = raw["name"]
    if not isinstance(name, str):
        raise where.error("name", f"{expected}, got {name!r}")
    problem = file_name_problem(name)
    if problem:
        raise where.error("name", f"{expected}, got {name!r}, which {problem}")
    return name


def _parse_timing(where: _Where, raw: Any) -> Timing:
    if raw is None:
        return Timing()
    if not isinstance(raw, dict):
        raise where.error("timing", f"expected a mapping, got {raw!r}")
    known = {f.name for f in fields(Timing)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise where.error(f"timing.{unknown[0]}", f"unknown key; expected one of {', '.join(sorted(known))}")
    timing = Timing()
    for name, value in raw.items():
        key = f"timing.{name}"
        if name in ("flush_l2", "cuda_graph"):
            if not isinstance(value, bool):
                raise where.error(key, f"expected true or false, got {value!r}")
        elif name == "budget_s":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise where.error(key, f"expected a positive number of seconds, got {value!r}")
            value = float(value)
        elif name == "warmup":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise where.error(key, f"expected a non-negative integer, got {value!r}")
        else:
            value = _positive_int(where, key, value)
        timing = replace(timing, **{name: value})
    return timing


def parse_backends(where_text: str, raw: Any, known: tuple[str, ...]) -> tuple[str, ...]:
    """A list (or comma-separated string) of backend names, each one of ``known``."""
    where = _Where(where_text)
    names = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(names, list) or not names:
        raise where.error("backends", f"expected a non-empty list of backend names, got {raw!r}")
    out = []
    for name in names:
        name = str(name).strip()
        if name not in known:
            raise where.error("backends", f"unknown backend {name!r}; expected one of {', '.join(known)}")
        if name not in out:
            out.append(name)
    return tuple(out)


def sweep_from_mapping(raw: Any, path: str, known_backends: tuple[str, ...]) -> Sweep:
    where = _Where(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(TOP_KEYS))
    if unknown:
        raise where.error(unknown[0], f"unknown key; expected one of {', '.join(TOP_KEYS)}")
    if "grid" not in raw and "cases" not in raw:
        raise where.error("grid", "a sweep needs a grid, a list of cases, or both")
    defaults = raw.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise where.error("defaults", f"expected a mapping, got {defaults!r}")
    for name in defaults:
        if name not in CASE_KEYS:
            raise where.error(f"defaults.{name}", f"unknown key; expected one of {', '.join(CASE_KEYS)}")

    cases: list[Case] = []
    skipped: list[SkippedCase] = []
    first_skip: tuple[str, str] | None = None  # (key, reason) of the first skipped point
    grids = raw.get("grid")
    grids = [] if grids is None else grids if isinstance(grids, list) else [grids]
    for gi, grid in enumerate(grids):
        key = "grid" if len(grids) == 1 and not isinstance(raw.get("grid"), list) else f"grid[{gi}]"
        points, axes = _grid_points(where, key, grid)
        for point in points:
            case = _parse_case(where, key, point, defaults, axes)
            problem = case_problem(case)
            if problem:
                skipped.append(SkippedCase(case, problem))
                if first_skip is None:
                    heads = heads_problem(case.heads_q, case.heads_kv)
                    first_skip = (f"{key}.heads" if heads else key, problem)
            else:
                cases.append(case)
    listed = raw.get("cases") or []
    if not isinstance(listed, list):
        raise where.error("cases", f"expected a list of case mappings, got {type(listed).__name__}")
    for ci, entry in enumerate(listed):
        key = f"cases[{ci}]"
        if not isinstance(entry, dict):
            raise where.error(key, f"expected a mapping of case keys, got {entry!r}")
        case = _parse_case(where, key, entry, defaults)
        problem = case_problem(case)
        if problem:
            # An explicit case that cannot run is a mistake in the file, not a grid corner.
            raise where.error(key, problem)
        cases.append(case)
    if not cases and first_skip is not None:
        # Every point is a grid corner that cannot run: the file is wrong, not a corner.
        raise where.error(first_skip[0], f"no point of the sweep can run: {first_skip[1]}")

    unique = list(dict.fromkeys(cases))  # grids that differ only in ignored keys repeat points
    check = raw.get("check", False)
    if not isinstance(check, bool):
        raise where.error("check", f"expected true or false, got {check!r}")
    name = _results_name(where, raw, path)
    backends = (parse_backends(path, raw["backends"], known_backends) if "backends" in raw
                else tuple(b for b in DEFAULT_BACKENDS if b in known_backends))
    return Sweep(name, path, backends, _parse_timing(where, raw.get("timing")), check,
                 tuple(unique), tuple(dict.fromkeys(skipped)))


def sweep_digest(sweep: Sweep) -> str:
    """A short fingerprint of what a sweep runs: its name, backends, timing, check flag and
    cases (skipped ones with their reasons). The file's path, comments and layout do not count,
    so the same sweep reached another way has the same digest."""
    content = repr((sweep.name, sweep.backends, sweep.timing, sweep.check, sweep.cases,
                    sweep.skipped))
    return hashlib.sha256(content.encode()).hexdigest()[:12]


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping, at any depth (PyYAML
    keeps the last one silently). Merge keys (``<<``) still override as YAML defines."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            _refuse_duplicate_keys(self, node)
        return super().construct_mapping(node, deep=deep)


def _refuse_duplicate_keys(loader: yaml.SafeLoader, node: yaml.MappingNode) -> None:
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            earlier = first_line.get(key)
        except TypeError:  # an unhashable key: construct_mapping reports it
            continue
        if earlier is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {earlier})",
                key_node.start_mark)
        first_line[key] = key_node.start_mark.line + 1


def load_yaml(text: str) -> Any:
    """Parse a YAML document a user wrote; a duplicate key is a ``yaml.YAMLError``."""
    return yaml.load(text, Loader=UniqueKeyLoader)


def load_sweep(path: str | Path, known_backends: tuple[str, ...]) -> Sweep:
    """Read and validate a sweep file. Raises ConfigError with a one-line message."""
    from .paths import input_file

    path = Path(path)
    input_file(path, "", "a sweep YAML file")
    try:
        raw = load_yaml(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    return sweep_from_mapping(raw, str(path), known_backends)
