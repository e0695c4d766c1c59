"""Shared-memory wavefronts of a compiled kernel's 64-bit shared stores, read from its PTX.

A store's address is evaluated for every thread from the straight-line integer code that
computes it from ``%tid.x`` (the operations below; any other raises), and a 64-bit store is
served half a warp at a time: a half warp takes as many wavefronts as the most distinct
32-bit words that fall in one of the 32 banks. Checked against ncu on the H200: the Hopper
backward's dQ staging stores, 4 wavefronts per warp (ncu: 4.0 per STS.64)."""

from __future__ import annotations

import re
from collections import defaultdict

STORE = re.compile(r"st\.shared\.v2\.b32\s+\[(%r\d+)\+(\d+)\]")
DEFINITION = re.compile(r"\s*([a-z][\w.]*)\s+(%r\d+),\s*(.*);")


def staging_stores(ptx: str, count: int) -> tuple[list[str], list[tuple[str, int]]]:
    """(the PTX lines, the first ``count`` 64-bit shared stores at a register plus offset)."""
    lines = ptx.splitlines()
    stores = [(i, m.group(1), int(m.group(2))) for i, line in enumerate(lines)
              for m in [STORE.search(line)] if m]
    return lines, stores[:count]


def _slice(lines: list[str], registers: set[str], before: int) -> list[tuple[str, str, list]]:
    """The definitions the registers depend on, in program order, from lines before
    ``before`` (the last definition of each register there)."""
    defined = {}
    for i, line in enumerate(lines[:before]):
        m = DEFINITION.match(line)
        if m:
            defined[m.group(2)] = (i, m.group(1), [a.strip() for a in m.group(3).split(",")])
    needed, todo = {}, list(registers)
    while todo:
        register = todo.pop()
        if register in needed or register not in defined:
            continue
        needed[register] = defined[register]
        todo.extend(a for a in needed[register][2] if a.startswith("%r"))
    return [(register, op, args) for register, (_, op, args)
            in sorted(needed.items(), key=lambda item: item[1][0])]


def _evaluate(code, tid: int) -> dict:
    values = {}

    def value(arg):
        if arg.startswith("%r"):
            return values[arg]
        return 0 if arg == "global_smem" else int(arg, 0)

    for register, op, args in code:
        a = [value(x) if x != "%tid.x" else tid for x in args]
        if op.startswith("mov"):
            out = a[0]
        elif op.startswith("and"):
            out = a[0] & a[1]
        elif op.startswith("or"):
            out = a[0] | a[1]
        elif op.startswith("xor"):
            out = a[0] ^ a[1]
        elif op.startswith("shl"):
            out = a[0] << a[1]
        elif op.startswith("shr"):
            out = a[0] >> a[1]
        elif op.startswith("add"):
            out = a[0] + a[1]
        elif op.startswith("sub"):
            out = a[0] - a[1]
        elif op.startswith("mul.lo"):
            out = a[0] * a[1]
        elif op.startswith("mad.lo"):
            out = a[0] * a[1] + a[2]
        elif op.startswith("bfe.u32"):
            out = (a[0] >> a[1]) & ((1 << a[2]) - 1)
        else:
            raise ValueError(f"ptx_banks: no evaluation of {op!r}")
        values[register] = out & 0xFFFFFFFF
    return values


def wavefronts_per_store(ptx: str, count: int, warps: int = 4) -> float:
    """The mean wavefronts per warp of the first ``count`` 64-bit register-addressed shared
    stores, over ``warps`` warps of threads 0, 1, ..."""
    lines, stores = staging_stores(ptx, count)
    code = _slice(lines, {register for _, register, _ in stores}, stores[0][0])
    addresses = [_evaluate(code, tid) for tid in range(32 * warps)]
    total = 0
    for _, register, offset in stores:
        for first in range(0, 32 * warps, 16):  # half warps
            words = defaultdict(set)
            for tid in range(first, first + 16):
                word = (addresses[tid][register] + offset) // 4
                for w in (word, word + 1):
                    words[w % 32].add(w)
            total += max(len(ws) for ws in words.values())
    return total / (len(stores) * warps)
