"""Read the hot loops of fastformer's kernels from their sm_90a SASS, on a CPU: `python -m tools.sass`.

    python -m tools.sass                       # every named shape: a table, and tools/results/sass.json
    python -m tools.sass --shapes fwd/model    # some of them (names: --list)

How: each shape is a call of the project's launchers under tools.sm90's dry-run sm_90a driver, with
CPU tensors laid out as the model lays them out, each launch running its rule's config (as a GPU run
does by default). Every kernel it compiles is disassembled with the `nvdisasm` that ships in
Triton's wheel. A loop is a backward branch; a hot loop is an innermost loop that holds HGMMA
(Hopper's warp-group MMA) instructions, or, in a kernel without any, an innermost loop. A body
with no branch inside it is straight-line, so its static counts are its counts per iteration
(`straight` says whether it is).

Per hot loop, per warp and iteration:
  instructions  every SASS instruction of the body, the loop's branch included
  hgmma         HGMMA instructions, and `groups`: WARPGROUP.ARRIVE, one per batch of async MMAs
  mma_flops     the MMA FLOPs of the warp's warp group: 2 * M * N * K per HGMMA.MxNxK
  per_kflop     instructions per 1,000 MMA FLOPs of one warp (a quarter of its warp group's)
  ex2_per_kflop MUFU.EX2 (exp2) the same way
  tc_bound      MMA time / max(MMA, issue, MUFU) per SM: an upper bound on the fraction of tensor-core
                peak the loop can reach. An H100 SM does 4,096 dense fp16/bf16 MMA FLOPs, issues 4
                warp-instructions and computes 16 MUFU results per clock, so per warp-group
                iteration MMA takes mma_flops / 4,096 clocks, issue instructions * 4 / 4, and MUFU
                mufu * 4 * 32 / 16 (every MUFU op, not only EX2). Past per_kflop = 0.98 the issue
                slots run out before the tensor cores are busy.
  clocks        the longest of those three per warp-group iteration: what an iteration costs an SM
  clk/kscore    attention's loops: clocks per 1,000 scores (a warp group's iteration covers
                BLOCK_M x BLOCK_N x 4 / num_warps scores), the unit in which tiles of different
                shapes, and the passes of one call, add up
Per attention shape, the call: the clk/kscore of its forward's, dQ pass's and dK/dV pass's main
loops, and their sum, the issue-and-MMA cost of a score's forward and backward. A change that moves
work out of a loop shows there, where the loop's /kF alone would hide it; a kernel with no loop
(none of attention's) would be left out of the sum, and is listed as such.
Per kernel: registers, spills and shared memory as ptxas reports them (tools.sm90). A kernel's
loops come most MMA work first; the first is its main loop (`main`), the others its rarer paths
(rows whose keys are all masked, say), marked "loop N" in the table.

What this cannot see: latency (a loop waiting on memory or on a wgmma), occupancy, dynamic trip
counts (which loop runs most), the MMA work's own efficiency. The GPU's benchmarks say how fast.

The kernels must be imported without TRITON_INTERPRET; `python -m tools.sass` runs in a fresh
process for that reason.
"""

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools import refuses_interpreter, sm90, write_report

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "tools" / "results" / "sass.json"

# what an SM does per clock on an H100 (sm_90): dense fp16/bf16 MMA FLOPs, warp-instructions
# issued (one per scheduler), MUFU results
MMA_FLOPS_PER_CLOCK = 4096
ISSUE_PER_CLOCK = 4
MUFU_PER_CLOCK = 16
WARPS_PER_GROUP = 4

_INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][\w.]*)([^;]*);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_HGMMA_SHAPE = re.compile(r"HGMMA\.(\d+)x(\d+)x(\d+)")


@dataclasses.dataclass
class Instruction:
    opcode: str  # with its modifiers: "HGMMA.64x64x16.F32", "MUFU.EX2", "BRA"
    operands: str
    predicated: bool


@dataclasses.dataclass
class Loop:
    """One loop of a kernel's SASS: instructions first..last (indices), the last its backward branch."""

    first: int
    last: int

    def holds(self, other):
        """Whether `other` is a loop inside this one."""
        inside = self.first <= other.first and other.last <= self.last
        return inside and (self.first, self.last) != (other.first, other.last)


def read_sass(text):
    """The instructions of one kernel's `nvdisasm -c` output and its labels (name -> the index of
    the instruction after the label)."""
    instructions, labels = [], {}
    for line in text.splitlines():
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        match = _INSTRUCTION.search(line)
        if match:
            _, predicate, opcode, operands = match.groups()
            instructions.append(Instruction(opcode, operands.strip(), predicate is not None))
    return instructions, labels


def find_loops(instructions, labels):
    """Every loop: a branch to a label before it (not the branch to itself that pads a kernel's end)."""
    loops = []
    for i, instruction in enumerate(instructions):
        if instruction.opcode.startswith("BRA"):
            target = _TARGET.search(instruction.operands)
            if target and labels.get(target.group(1), i) < i:
                loops.append(Loop(labels[target.group(1)], i))
    return loops


def hot_loops(instructions, loops):
    """The innermost loops that hold HGMMA instructions; without any HGMMA, the innermost loops."""

    def has_mma(loop):
        return any(ins.opcode.startswith("HGMMA") for ins in instructions[loop.first : loop.last + 1])

    candidates = [loop for loop in loops if has_mma(loop)] or loops
    return [loop for loop in candidates if not any(loop.holds(other) for other in candidates)]


def measure_loop(instructions, loop):
    """The counts and ratios of one loop (see the module docstring)."""
    body = instructions[loop.first : loop.last + 1]
    opcodes = [ins.opcode for ins in body]
    flops = 0
    for opcode in opcodes:
        shape = _HGMMA_SHAPE.match(opcode)
        if shape:
            m, n, k = map(int, shape.groups())
            flops += 2 * m * n * k
    mufu = sum(op.startswith("MUFU") for op in opcodes)
    ex2 = sum(op.startswith("MUFU.EX2") for op in opcodes)
    mma = flops / MMA_FLOPS_PER_CLOCK
    issue = len(body) * WARPS_PER_GROUP / ISSUE_PER_CLOCK
    mufu_time = mufu * WARPS_PER_GROUP * 32 / MUFU_PER_CLOCK
    row = {
        "instructions": len(body),
        "hgmma": sum(op.startswith("HGMMA") for op in opcodes),
        "groups": sum(op.startswith("WARPGROUP.ARRIVE") for op in opcodes),
        "mufu": mufu,
        "ex2": ex2,
        "mma_flops": flops,
        "straight": not any(op.startswith("BRA") for op in opcodes[:-1]),
        "clocks": max(mma, issue, mufu_time),
        "per_kflop": None,
        "ex2_per_kflop": None,
        "tc_bound": None,
    }
    if flops:
        per_warp = flops / WARPS_PER_GROUP
        row.update(
            per_kflop=len(body) / per_warp * 1000,
            ex2_per_kflop=ex2 / per_warp * 1000,
            tc_bound=mma / max(mma, issue, mufu_time),
        )
    return row


def disassemble(cubin, nvdisasm):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def nvdisasm_path():
    """The nvdisasm in Triton's wheel."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not path.exists():
        raise FileNotFoundError(f"no nvdisasm at {path}: tools.sass reads it from Triton's wheel")
    return str(path)


# ----------------------------------------------------------------------------------------------
# The named shapes: calls of the launchers (tools.sm90_cases builds the model's layouts)
# ----------------------------------------------------------------------------------------------
def shapes():
    """name -> (what it is, a tools.sm90 Case). Attention in fp16 at the tutorial's head dim: a long
    unmasked and a long causal sequence (B4 H32 L4096), the model's training call (key padding and
    dropout 0.1 on views of a fused QKV projection, B128 H4 L256, and at the tutorial's lengths, B32
    H4 L64, where the rules pick 64 x 64 tiles), D128; the model's FFN product and add + LayerNorm
    under autocast. The `/tma` shapes are the same calls with their tiles loaded through tensor
    descriptors (kernels/_tma.py), each pass running the config its rule picks for that variant."""
    from tools import sm90_cases as cases

    long = {"B": 4, "H": 32, "L": 4096}
    model = {"B": 128, "H": 4, "L": 256}
    return {
        "attention/none/D64": (
            "attention, no mask, D64, B4 H32 L4096",
            cases.attention_case("fp16", 64, "none", False, layout="contiguous", **long),
        ),
        "attention/causal/D64": (
            "attention, causal, D64, B4 H32 L4096",
            cases.attention_case("fp16", 64, "causal", False, layout="contiguous", **long),
        ),
        "attention/model": (
            "attention, the model's training call: key padding + dropout 0.1, D64, B128 H4 L256",
            cases.attention_case("fp16", 64, "pad", True, layout="self", **model),
        ),
        "attention/model/L64": (
            "attention, the model's call at the tutorial's lengths: key padding + dropout 0.1, D64, B32 H4 L64",
            cases.attention_case("fp16", 64, "pad", True, layout="self", B=32, H=4, L=64),
        ),
        "attention/none/D128": (
            "attention, no mask, D128, B4 H16 L4096",
            cases.attention_case("fp16", 128, "none", False, layout="contiguous", B=4, H=16, L=4096),
        ),
        "ffn/model": (
            "linear_gelu, the tutorial's FFN product (d 256 -> 1024, M 32768, training)",
            cases.ffn_case("fp16", "gelu", True, 256, 1024, 128 * 256),
        ),
        "attention/causal/D64/tma": (
            "attention, causal, D64, B4 H32 L4096, tiles through tensor descriptors",
            cases.attention_case("fp16", 64, "causal", False, layout="contiguous", **long, tma=True),
        ),
        "attention/model/tma": (
            "attention, the model's training call, B128 H4 L256, tiles through tensor descriptors",
            cases.attention_case("fp16", 64, "pad", True, layout="self", **model, tma=True),
        ),
        "attention/model/L64/tma": (
            "attention, the model's call, B32 H4 L64, tiles through tensor descriptors",
            cases.attention_case("fp16", 64, "pad", True, layout="self", B=32, H=4, L=64, tma=True),
        ),
        "ffn/model/tma": (
            "linear_gelu, the tutorial's FFN product, tiles through tensor descriptors",
            cases.ffn_case("fp16", "gelu", True, 256, 1024, 128 * 256, tma=True),
        ),
        "add_layer_norm/model": (
            "add + LayerNorm as the model calls it under autocast (d 256, 32768 rows)",
            cases.layer_norm_case("fp16", 256, True, rows=128 * 256, fused=True),
        ),
    }


class _KeepingRecorder(sm90._Recorder):
    """tools.sm90's recorder that also keeps each compiled kernel: (shape, kernel, config, compiled)."""

    def __init__(self):
        super().__init__()
        self.kernels = []

    def compile(self, src, target=None, options=None, **kwargs):
        compiled = super().compile(src, target, options, **kwargs)
        self.kernels.append((self.case.name, sm90._kernel_name(src), sm90.config_of(src, options)[0], compiled))
        return compiled


def read(names=None):
    """Compile the named shapes (all by default) and read their kernels: a list of rows, one per
    (shape, kernel, config, hot loop)."""
    from fastformer.kernels import set_autotune

    table = shapes()
    names = list(table) if names is None else names
    unknown = sorted(set(names) - set(table))
    if unknown:
        raise ValueError(f"unknown shapes {unknown}; known: {', '.join(table)}")
    nvdisasm = nvdisasm_path()
    modules = [name for name in sys.modules if name.startswith("fastformer.kernels")]
    rows = []
    set_autotune(False)  # each launch's rule picks its config, as on a GPU by default
    try:
        with sm90.dry_run(time_configs=False), _KeepingRecorder() as recorder:
            for name in names:
                case = table[name][1]
                recorder.case = dataclasses.replace(case, name=name)
                sm90._reset_jit_caches(modules)
                case.run()
    finally:
        set_autotune(None)
    facts = {(r.case, r.kernel, r.config): r for r in recorder.records}
    seen = set()
    for shape, kernel, config, compiled in recorder.kernels:
        if (shape, kernel, config) in seen:
            continue
        seen.add((shape, kernel, config))
        record = facts[(shape, kernel, config)]
        instructions, labels = read_sass(disassemble(compiled.asm["cubin"], nvdisasm))
        loops = hot_loops(instructions, find_loops(instructions, labels))
        base = {
            "shape": shape,
            "what": table[shape][0],
            "kernel": kernel,
            "config": config,
            "registers": record.registers,
            "spill_bytes": record.spill_stores + record.spill_loads,
            "shared": record.shared,
            "kernel_instructions": len(instructions),
        }
        measured = sorted(
            (measure_loop(instructions, loop) for loop in loops), key=lambda m: (-m["mma_flops"], m["instructions"])
        )
        # the main loop: the one with the most MMA work per iteration and, among equals, the fewest
        # instructions: the interior loop of a kernel whose masked edge blocks run copies of it (the
        # others, a kernel's rarer paths: the masked edge, fully masked rows)
        scores = _scores_per_group(kernel, config)
        for i, m in enumerate(measured):
            per_kscore = None if scores is None else m["clocks"] / scores * 1000
            rows.append({**base, "loop": i, "main": i == 0, **m, "clocks_per_kscore": per_kscore})
        if not loops:
            rows.append({**base, "loop": None, "main": False})
    return rows


_CONFIG_FIELD = re.compile(r"(BLOCK_M|BLOCK_N)=(\d+)|\bw(\d+)\b")
# attention's kernels, by the pass each runs, in a call's order
_PASSES = {
    "_attn_fwd_kernel": "forward",
    "_attn_bwd_kernel(DQ_PASS=True)": "dq",
    "_attn_bwd_kernel(DQ_PASS=False)": "dkdv",
}


def _scores_per_group(kernel, config):
    """The scores a warp group's iteration of an attention kernel's loop covers (BLOCK_M x BLOCK_N
    x 4 / num_warps, from the config's words), or None for another kernel."""
    if not kernel.startswith("_attn_"):
        return None
    fields = {}
    for name, value, warps in _CONFIG_FIELD.findall(config):
        fields[name or "warps"] = int(value or warps)
    return fields["BLOCK_M"] * fields["BLOCK_N"] * WARPS_PER_GROUP / fields["warps"]


def calls(rows):
    """shape -> its attention call: each pass's main-loop clk/kscore (forward, dq, dkdv), their
    total, and `left_out`, the shape's attention kernels with no loop to read; shapes without
    attention's three passes are not calls."""
    found = {}
    for r in rows:
        if r["kernel"].startswith("_attn_") and (r["main"] or r["loop"] is None):
            found.setdefault(r["shape"], []).append(r)
    result = {}
    for shape, kernel_rows in found.items():
        passes = {
            _PASSES[r["kernel"]]: r["clocks_per_kscore"] for r in kernel_rows if r["kernel"] in _PASSES and r["main"]
        }
        if set(passes) != set(_PASSES.values()):
            continue
        left_out = sorted(r["kernel"] for r in kernel_rows if r["loop"] is None)
        result[shape] = {**passes, "total": sum(passes.values()), "left_out": left_out}
    return result


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table(report):
    lines = [
        f"hot loops from sm_90a SASS, Triton {report['triton']}, {report['date']} (per warp and iteration)",
        "",
        "| shape | kernel | config | instr | HGMMA (groups) | /kF | EX2 /kF | TC bound | clk/kscore | regs | spills "
        "| smem |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        if r["loop"] is None:
            lines.append(f"| {r['shape']} | {r['kernel']} | {r['config']} | no loop | | | | | | {r['registers']} | | |")
            continue
        straight = "" if r["straight"] else " (branches)"
        kernel = r["kernel"] if r["main"] else f"{r['kernel']}, loop {r['loop']}"
        lines.append(
            f"| {r['shape']} | {kernel} | {r['config']} | {r['instructions']}{straight} | "
            f"{r['hgmma']} ({r['groups']}) | {_fmt(r['per_kflop'], '.2f')} | {_fmt(r['ex2_per_kflop'], '.3f')} | "
            f"{_fmt(r['tc_bound'], '.2f')} | {_fmt(r.get('clocks_per_kscore'), '.0f')} | {r['registers']} | "
            f"{r['spill_bytes']} | {r['shared']} |"
        )
    if report.get("calls"):
        lines += [
            "",
            "attention calls: main loops' SM clocks per 1,000 scores (the longest of MMA, issue and MUFU)",
            "",
            "| shape | forward | dQ | dK/dV | total | kernels with no loop, left out |",
            "|---|---|---|---|---|---|",
        ]
        for shape, c in report["calls"].items():
            left_out = ", ".join(c["left_out"]) or "-"
            lines.append(
                f"| {shape} | {c['forward']:.0f} | {c['dq']:.0f} | {c['dkdv']:.0f} | {c['total']:.0f} | {left_out} |"
            )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", metavar="NAME", help="the shapes to read (default: all)")
    parser.add_argument("--list", action="store_true", help="list the shapes and exit")
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"where the report goes (default {RESULTS})")
    args = parser.parse_args(argv)
    if refuses_interpreter("sass", "this reads compiled kernels"):
        return 2
    if args.list:
        for name, (description, _) in shapes().items():
            print(f"{name:24s} {description}")
        return 0
    import triton

    # an empty Triton cache, so that every kernel is compiled and ptxas reports its registers
    with tempfile.TemporaryDirectory(prefix="sass-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            rows = read(args.shapes)
        except ValueError as error:
            print(f"tools.sass: {error}", file=sys.stderr)
            return 2
    report = {
        "schema": "fastformer.sass/1",
        "date": time.strftime("%Y-%m-%d"),
        "triton": triton.__version__,
        "target": "sm_90a",
        "rows": rows,
        "calls": calls(rows),
    }
    write_report(args.json, report, table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
