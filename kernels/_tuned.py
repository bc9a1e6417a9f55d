"""What a GPU's sweep decided for the kernels: per launch it timed, the variant and config that ran
fastest, where they beat the written rule's pick by more than the noise.

The written rules (each kernel's candidates in order, its `fits`, PREFERS_TMA, PREFERS_CUBLAS) pick
without measuring. `python -m tools.sweep` times every variant (tile loads through pointers or
tensor descriptors; for the FFN's first GEMM, cuBLAS's product too) and every config the rules keep,
on the shapes the targets are judged at, and its report of a GPU is committed as
tools/results/sweep-<gpu>.json. `python -m tools.sweep --adopt tools/results/sweep-<gpu>.json`
turns it into a table, kernels/tuned/<gpu>.json, installed with the package and read here: never
a hand edit (tests/test_tuned.py makes every committed table again from its sweep and compares).

A table (schema "fastformer.tuned/1"): `gpu`, the device name it was timed on ("NVIDIA H200");
`source`, where it came from; `launches`, one entry per (family, pass) whose fastest beat the rule's
pick outside the noise (tools.sweep.adopt): the kernel (its Configs' name), the launch's `key` (the
values of its Configs key but TMA: flags, head dim, length buckets), the first tensor's `dtype`,
the `variant` and the config (`meta`, `num_warps`, `num_stages`; none for "cublas", whose product
is cuBLAS's), and the speed-up it was adopted on.

Which table is in force: `set_tuned`'s (a table, a path to one, or False for none), else
FASTFORMER_TUNED's (a path; 0 for none), else the one installed for the GPU the launch goes to, by
its name; none under the interpreter (one config) or while autotuning (every config is timed).

How a launch reads it (kernels._configs.Configs.tuned): the entry of its kernel whose key has the
launch's flags and head dims exactly, in its dtype, and the nearest length buckets (`*_BUCKET`)
within a factor of 4 of the launch's, takes the entry's variant and config, when the kernel's rule
lets the launch run that config in that variant (`fits`); any other launch runs as the rule says.
"""

import json
import math
import os
from pathlib import Path

from ._runtime import Choice

SCHEMA = "fastformer.tuned/1"
ENV_VAR = "FASTFORMER_TUNED"
FOLDER = Path(__file__).resolve().parent / "tuned"
VARIANTS = ("pointer", "tma", "cublas")
# a launch's length bucket and an entry's must be within this factor of each other (each bucket key)
NEAREST_FACTOR = 4
# what an entry holds (tools.sweep.adopt writes them, and the pass's name)
_ENTRY_KEYS = frozenset(
    ("kernel", "family", "key", "dtype", "variant", "meta", "num_warps", "num_stages", "speedup", "low", "high")
)


class Entry:
    """One launch family's decision: `variant` and `config` ((meta, num_warps, num_stages), or
    None for the cuBLAS variant) for launches of `kernel` in `dtype` whose key matches `key`."""

    __slots__ = ("config", "dtype", "family", "kernel", "key", "speedup", "variant")

    def __init__(self, fields, where):
        missing = _ENTRY_KEYS - set(fields)
        if missing:
            raise ValueError(f"{where}: missing {', '.join(sorted(missing))}")
        if fields["variant"] not in VARIANTS:
            raise ValueError(f"{where}: variant must be one of {', '.join(VARIANTS)}, got {fields['variant']!r}")
        if not isinstance(fields["key"], dict) or not all(isinstance(k, str) for k in fields["key"]):
            raise ValueError(f"{where}: key must be an object of the launch's key arguments")
        self.kernel, self.family, self.dtype = fields["kernel"], fields["family"], fields["dtype"]
        self.key, self.variant, self.speedup = dict(fields["key"]), fields["variant"], fields["speedup"]
        if self.variant == "cublas":
            self.config = None
        else:
            meta, warps, stages = fields["meta"], fields["num_warps"], fields["num_stages"]
            if not isinstance(meta, dict) or not all(isinstance(v, int) for v in (warps, stages, *meta.values())):
                raise ValueError(f"{where}: meta must map constexprs to ints, num_warps and num_stages be ints")
            self.config = (dict(meta), warps, stages)

    def distance(self, key):
        """How far a launch's key is from this entry's: None where a key other than a length bucket
        differs or a bucket is more than NEAREST_FACTOR away, else the sum of the buckets' log2
        distances (0: the family's own lengths)."""
        if key.keys() != self.key.keys():
            return None
        total = 0.0
        for name, value in key.items():
            mine = self.key[name]
            if not name.endswith("_BUCKET"):
                if value != mine:
                    return None
                continue
            if not (isinstance(value, int) and value > 0 and isinstance(mine, int) and mine > 0):
                return None
            apart = abs(math.log2(value) - math.log2(mine))
            if apart > math.log2(NEAREST_FACTOR):
                return None
            total += apart
        return total

    def __repr__(self):
        return f"Entry({self.kernel!r}, {self.family!r}, {self.variant}, {self.config})"


class Table:
    """A sweep's decisions for one GPU model (the module's docstring): `entry(kernel, key, dtype)`."""

    def __init__(self, document, where="a tuned table"):
        if not isinstance(document, dict) or document.get("schema") != SCHEMA:
            raise ValueError(f"{where}: not a tuned table (its schema must be {SCHEMA!r})")
        if not isinstance(document.get("gpu"), str) or not isinstance(document.get("launches"), list):
            raise ValueError(f"{where}: a tuned table needs 'gpu' (a device name) and 'launches' (a list)")
        self.document, self.where, self.gpu = document, where, document["gpu"]
        self.by_kernel = {}
        for i, fields in enumerate(document["launches"]):
            if not isinstance(fields, dict):
                raise ValueError(f"{where}: launches[{i}] must be an object")
            entry = Entry(fields, f"{where}: launches[{i}]")
            self.by_kernel.setdefault(entry.kernel, []).append(entry)

    @classmethod
    def read(cls, path):
        path = Path(path)
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path}: cannot read a tuned table ({type(error).__name__}: {error})") from None
        return cls(document, str(path))

    def entry(self, kernel, key, dtype):
        """The entry for a launch of `kernel` (its Configs' name) with `key` (its key arguments but
        TMA, by name) in `dtype` (str of its first tensor's dtype), the nearest (Entry.distance), or None."""
        best, best_distance = None, None
        for entry in self.by_kernel.get(kernel, ()):
            if entry.dtype != dtype:
                continue
            distance = entry.distance(key)
            if distance is not None and (best_distance is None or distance < best_distance):
                best, best_distance = entry, distance
        return best

    def __len__(self):
        return sum(len(entries) for entries in self.by_kernel.values())

    def __repr__(self):
        return f"Table({self.gpu!r}, {len(self)} launches, from {self.where})"


def gpu_slug(name):
    """The file name of a GPU's tables: its device name, lower case, without the vendor, runs of
    other characters as '-' ("NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3")."""
    words = "".join(c if c.isalnum() else " " for c in name.lower()).split()
    if words[:1] == ["nvidia"]:
        words = words[1:]
    return "-".join(words) or "unknown"


_installed = None  # device name -> Table, read from FOLDER on first use


def installed():
    """{device name: Table} of the tables installed with the package (kernels/tuned/*.json)."""
    global _installed
    if _installed is None:
        tables = {}
        for path in sorted(FOLDER.glob("*.json")):
            table = Table.read(path)
            tables[table.gpu] = table
        _installed = tables
    return _installed


def _parse(value):
    if value in (None, ""):
        return None
    if value in ("0", "off", "none"):
        return False
    if not os.path.isfile(value):
        raise ValueError(f"{ENV_VAR} must be the path of a tuned table or 0 (the written rules only), got {value!r}")
    return Table.read(value)


def _check(table):
    if not (table is False or isinstance(table, Table)):
        raise TypeError(f"set_tuned takes a tuned table, its path, False or None, got {table!r}")


# set_tuned's choice, else FASTFORMER_TUNED's (a Table; False for none), else None: the installed table of the GPU
tuned_choice = Choice(ENV_VAR, _parse, _check)


def as_table(table):
    """A Table of a Table, a table's document (a dict) or its path; False and None as they are."""
    if table is None or table is False or isinstance(table, Table):
        return table
    if isinstance(table, dict):
        return Table(table)
    if isinstance(table, (str, os.PathLike)):
        return Table.read(table)
    raise TypeError(f"set_tuned takes a tuned table, its path, False or None, got {table!r}")


def set_tuned(table):
    """Run the launches as the tuned table `table` says (a Table, its document or its path), by the
    written rules alone (False), or as FASTFORMER_TUNED says, else as the table installed for the
    GPU says (None, the default). Takes effect at the next call (the ops' plans are kept per
    choice: kernels._configs.switches)."""
    tuned_choice.set(as_table(table))


def tuned(table):
    """set_tuned(table) inside the block, and the choice in force before it after the block."""
    return tuned_choice.within(as_table(table))


_by_device = {}  # (driver, device index) -> the installed Table of its GPU, or None


def in_force():
    """The Table the next launch reads, or None (the written rules): the choice, else the table
    installed for the name of the GPU the active Triton driver launches on."""
    choice = tuned_choice()
    if choice is not None:
        return None if choice is False else choice
    from triton.runtime.driver import driver

    try:
        active = driver.active
    except RuntimeError:  # no driver: no GPU to launch on (the launch itself will say so)
        return None
    key = (id(active), active.get_current_device())
    try:
        return _by_device[key]
    except KeyError:
        name = active.get_device_interface().get_device_name(active.get_current_device())
        return _by_device.setdefault(key, installed().get(name))
