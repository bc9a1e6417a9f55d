#!/usr/bin/env bash
# The one command a lent GPU machine runs, from the repository root, as it is. A lease is 15
# minutes of device time in all, the machine's start (one to two minutes) included: ONE call of
# this script, with the device tool's timeout_s 600.
#
#     bash tools/gpu_run.sh                  # the one run: tools.gpu_check --one, into $OUT (else ./gpu-out)
#     bash tools/gpu_run.sh --quick          # a part of it alone: the kernel and model stages, the parity subset
#     bash tools/gpu_run.sh --rest           # another: the other tests, compile, determinism, the default job
#     bash tools/gpu_run.sh --sweep          # tools.sweep alone, its budget the time left less 30 s
#     bash tools/gpu_run.sh --smoke          # every stage at tiny sizes (a CPU's check of the command)
#     bash tools/gpu_run.sh --quick --stage model   # any further arguments go to tools.gpu_check
#
# The one run (tools/gpu_check/plan.py, one_run) is planned for 540 s and says in its first lines
# what it runs and why, from what the repository holds: without a sweep committed for this GPU
# model, the sweep first (tools.sweep, a family at a time), then the kernel and model stages with
# the sweep's winners in force beside the peers, then the parity subset with the time left; with
# one, the kernel and model stages on the committed table, or what the last committed run did not
# reach. On a CPU it is its own rehearsal (smoke sizes, the sweep a dry run).
# 1. installs this checkout offline with what the machine has (torch, Triton, sentencepiece,
#    pytest, pytest-benchmark, pytest-xdist and setuptools are there; nothing can be fetched);
# 2. installs what the session carried for it (tools/gpu_carry.sh fills gpu-carry/ here; the device
#    tool's `carry` takes it there): the wheels in gpu-carry/wheels, into a folder of its own put
#    on PYTHONPATH, and says which; without them the peers they provide are skipped with the reason;
# 3. prints the versions and `nvidia-smi -L`;
# 4. runs `python3 -m tools.gpu_check [mode] --out "$OUT"`, its files straight into $OUT (at most
#    6 files in the one run, no subfolders: the device tool brings back 8), and stops it with SIGINT
#    to the whole process group when this script has run GPU_RUN_SECONDS (default 570, inside the
#    device tool's 600 s), so that it still writes what every stage and sweep family measured and
#    marks the one it was in "interrupted"; SIGKILL 15 s after that. With --sweep: `python3 -m
#    tools.sweep --out "$OUT" --budget <left - 30>`, stopped the same way (it then writes what it
#    timed, the rest "not timed").
# The versions are printed again at the end, after the run's summary, so the tool's output tail
# (its last 12,000 characters, which come back even when no file does) holds both.
# Exit status: tools.gpu_check's (0 no stage failed, 1 one did, 2 a bad command line) or
# tools.sweep's (0, 1 a launch failed, 2 a bad command line, 130 interrupted), 124 when it was
# stopped at the limit, 3 when an install failed.
set -uo pipefail
cd "$(dirname "$0")/.."

out="${OUT:-gpu-out}"
seconds="${GPU_RUN_SECONDS:-570}"  # counted from this script's start (bash's SECONDS)
python="${PYTHON:-python3}"
carry="${GPU_CARRY:-gpu-carry}"
mode="--one"
case "${1:-}" in
    --one | --quick | --rest | --full | --smoke | --sweep) mode="$1"; shift ;;
esac
mkdir -p "$out"

echo "== install (offline)"
if ! "$python" -m pip install --quiet --no-deps --no-build-isolation --no-index -e .; then
    echo "gpu_run: the offline install failed (see above); nothing was run" >&2
    exit 3
fi
shopt -s nullglob
wheels=("$carry"/wheels/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
    site="$(mktemp -d "${TMPDIR:-/tmp}/gpu-run-site.XXXXXX")"
    if ! "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}"; then
        echo "gpu_run: installing the carried wheels failed (see above); nothing was run" >&2
        exit 3
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "carried wheels installed into $site: $(for w in "${wheels[@]}"; do basename "$w"; done | tr '\n' ' ')"
else
    echo "no carried wheels in $carry/wheels (tools/gpu_carry.sh fetches them): the peers they provide are skipped"
fi

preamble="$(
    date -u '+%Y-%m-%d %H:%M:%S UTC'
    # a device tool's copy of a working tree can carry an older .git: say how far the tree is from it
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
        "+ $(git status --porcelain --untracked-files=no 2>/dev/null | wc -l) paths changed"
    "$python" - <<'EOF'
import platform, sys
import torch
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "not installed"
import fastformer
print(f"python {platform.python_version()} ({sys.executable}); torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"triton {triton_version}; fastformer {fastformer.__version__} from {fastformer.__file__}")
print(f"torch.cuda.is_available(): {torch.cuda.is_available()}")
EOF
    if command -v nvidia-smi >/dev/null; then nvidia-smi -L; else echo "nvidia-smi: not found"; fi
)"
echo "== versions"
echo "$preamble"

left=$((seconds - SECONDS))
if [ "$mode" = "--sweep" ]; then
    echo "== tools.sweep, stopped after ${left} s"
    PYTHONUNBUFFERED=1 timeout --signal=INT --kill-after=15 "$left" \
        "$python" -m tools.sweep --out "$out" --budget "$((left > 60 ? left - 30 : 30))" "$@"
else
    echo "== tools.gpu_check $mode, stopped after ${left} s"
    PYTHONUNBUFFERED=1 timeout --signal=INT --kill-after=15 "$left" \
        "$python" -m tools.gpu_check "$mode" --out "$out" "$@"
fi
status=$?

echo "== done: exit ${status}; files in ${out}: $(ls "$out" | tr '\n' ' ')"
echo "$preamble"
exit "$status"
