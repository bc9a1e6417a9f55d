#!/usr/bin/env bash
# The one command a lent GPU machine runs, from the repository root, as it is:
#
#     bash tools/gpu_run.sh                  # writes into $OUT (the device tool's folder), else ./gpu-out
#     bash tools/gpu_run.sh --stage model    # any further arguments go to tools.gpu_check
#
# 1. installs this checkout offline with what the machine has (torch, Triton, sentencepiece,
#    pytest, pytest-benchmark and setuptools are there; nothing can be fetched);
# 2. prints the versions and `nvidia-smi -L`;
# 3. runs `python3 -m tools.gpu_check --quick --out "$OUT"`, its files straight into $OUT (at most
#    8 files, no subfolders: what the device tool brings back), and stops it with SIGINT when this
#    script has run GPU_RUN_SECONDS (default 535, inside the device tool's 560 s cut), so that it
#    still writes the stages it finished and marks the one it was in "interrupted"; SIGKILL 15 s
#    after that.
# The versions are printed again at the end, so the tool's output tail holds them too.
# Exit status: tools.gpu_check's (0 no stage failed, 1 one did, 2 a bad command line), 124 when it
# was stopped at the limit, 3 when the install failed.
set -uo pipefail
cd "$(dirname "$0")/.."

out="${OUT:-gpu-out}"
seconds="${GPU_RUN_SECONDS:-535}"  # counted from this script's start (bash's SECONDS)
python="${PYTHON:-python3}"
mkdir -p "$out"

echo "== install (offline)"
if ! "$python" -m pip install --quiet --no-deps --no-build-isolation --no-index -e .; then
    echo "gpu_run: the offline install failed (see above); nothing was run" >&2
    exit 3
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
echo "== tools.gpu_check --quick, stopped after ${left} s"
PYTHONUNBUFFERED=1 timeout --signal=INT --kill-after=15 "$left" \
    "$python" -m tools.gpu_check --quick --out "$out" "$@"
status=$?

echo "== done: exit ${status}; files in ${out}: $(ls "$out" | tr '\n' ' ')"
echo "$preamble"
exit "$status"
