#!/usr/bin/env bash
# The one command a lent GPU machine runs, from the repository root, as it is:
#
#     bash tools/gpu_run.sh                  # the first call: gpu_check --quick, into $OUT (else ./gpu-out)
#     bash tools/gpu_run.sh --rest           # the second call: gpu_check --rest
#     bash tools/gpu_run.sh --quick --stage model   # any further arguments go to tools.gpu_check
#     bash tools/gpu_run.sh --sweep          # a call of its own: tools.sweep, the kernels' variants x configs
#
# The first argument picks the mode (--quick, the default; --rest; --full; --smoke, the CPU rehearsal;
# --sweep, which runs tools.sweep in place of tools.gpu_check, its budget the time left less 30 s).
# 1. installs this checkout offline with what the machine has (torch, Triton, sentencepiece,
#    pytest, pytest-benchmark, pytest-xdist and setuptools are there; nothing can be fetched);
# 2. installs what the session carried for it (tools/gpu_carry.sh fills gpu-carry/ here; the device
#    tool's `carry` takes it there): the wheels in gpu-carry/wheels, into a folder of its own put
#    on PYTHONPATH, and says which; without them the peers they provide are skipped with the reason;
# 3. prints the versions and `nvidia-smi -L`;
# 4. runs `python3 -m tools.gpu_check <mode> --out "$OUT"`, its files straight into $OUT (at most
#    8 files, no subfolders: what the device tool brings back), and stops it with SIGINT when this
#    script has run GPU_RUN_SECONDS (default 535, inside the device tool's 560 s cut), so that it
#    still writes the stages it finished and marks the one it was in "interrupted"; SIGKILL 15 s
#    after that. With --sweep: `python3 -m tools.sweep --out "$OUT" --budget <left - 30>`, stopped
#    the same way (it then writes what it timed, the rest "not timed").
# The versions are printed again at the end, so the tool's output tail holds them too.
# Exit status: tools.gpu_check's (0 no stage failed, 1 one did, 2 a bad command line) or
# tools.sweep's (0, 1 a launch failed, 2 a bad command line), 124 when it was stopped at the limit,
# 3 when an install failed.
set -uo pipefail
cd "$(dirname "$0")/.."

out="${OUT:-gpu-out}"
seconds="${GPU_RUN_SECONDS:-535}"  # counted from this script's start (bash's SECONDS)
python="${PYTHON:-python3}"
carry="${GPU_CARRY:-gpu-carry}"
mode="--quick"
case "${1:-}" in
    --quick | --rest | --full | --smoke | --sweep) mode="$1"; shift ;;
esac
[ "$mode" = "--full" ] && mode=""  # gpu_check's default mode
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
    echo "== tools.gpu_check ${mode:-(full)}, stopped after ${left} s"
    PYTHONUNBUFFERED=1 timeout --signal=INT --kill-after=15 "$left" \
        "$python" -m tools.gpu_check ${mode:+"$mode"} --out "$out" "$@"
fi
status=$?

echo "== done: exit ${status}; files in ${out}: $(ls "$out" | tr '\n' ' ')"
echo "$preamble"
exit "$status"
